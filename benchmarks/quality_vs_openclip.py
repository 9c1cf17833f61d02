"""Does clipms's training recipe learn as well as open_clip's? Both train on the same real shards.

    # 1. shards + OpenAI BPE tokenizer from any parquet of URL/TEXT, through the project's own data
    #    stages (metadata -> dedupe -> download -> shard -> tokenizer) in WORK/, e.g. a folder of
    #    images with its metadata.parquet whose URLs point at http://127.0.0.1:8123/:
    python benchmarks/quality_vs_openclip.py prepare --work WORK \\
        --parquet DATA/metadata.parquet --serve DATA/images --port 8123
    # 2. one training run per side and seed (ours in this process; open_clip in the peer venv,
    #    benchmarks/openclip_fit.py); each appends a JSON line to WORK/results.jsonl
    python benchmarks/quality_vs_openclip.py run --work WORK --side ours --seed 0
    python benchmarks/quality_vs_openclip.py run --work WORK --side openclip --seed 0 \\
        --peer-python PEER_VENV/bin/python
    # 3. the table (per seed and mean; then every arm, ours from each --init and open_clip, over
    #    all its seeds: n, mean +- sd, ratio of the means, Welch t, paired t over common seeds;
    #    and, for runs with --eval-every, each side's time to the quality both reached)
    python benchmarks/quality_vs_openclip.py table --work WORK [--json-out RESULT.json]

The levers of open_clip's trainer, on both sides alike: `--loss siglip` (open_clip's SigLipLoss
and `--siglip` initialisation: logit scale ln 10, bias -10) and `--patch-dropout P` (the image
tower's vision_cfg.patch_dropout). `--eval-every N` scores the val split every N steps on both
sides with the training clock paused, for the time each side takes to a quality.

Same on both sides: architecture (`--preset`, open_clip's CLIP built from `to_openclip()`), the
OpenAI BPE tokenizer (`tokenizer.kind: openai`), batches (the same samples, captions and
preprocessing per seed, from clipms.data.dataset), steps, lr, warmup + cosine, AdamW betas/eps,
weight decay and its rule (`--wd-rule openclip`: not on < 2-D tensors, norms, biases, logit_scale;
`embeddings`: also not on the token/positional embeddings), grad clipping, the logit-scale clamp,
and the scoring: every val image and caption, clipms.eval.metrics.retrieval_metrics. Each side keeps
its own initialisation. One MindSpore training at a time: run the commands one after another.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import http.server
import json
import logging
import math
import os
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

DATA_STAGES = ("metadata", "dedupe", "download", "shard", "tokenizer")
REPORTED = ("i2t_R@1", "i2t_R@5", "i2t_R@10", "t2i_R@1", "t2i_R@5", "t2i_R@10", "mAP@10")
TABLED = REPORTED[:6]
CURVE_KEYS = TABLED  # what a check records (benchmarks/openclip_fit.py's CURVE_KEYS too)


def _parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    prep = sub.add_parser("prepare", help="shards + tokenizer from a URL/TEXT parquet")
    prep.add_argument("--work", required=True, type=Path)
    prep.add_argument("--parquet", required=True, type=Path)
    prep.add_argument("--serve", type=Path, help="serve this folder on 127.0.0.1:--port meanwhile")
    prep.add_argument("--port", type=int, default=8123)
    prep.add_argument("--val-fraction", type=float, default=0.25)
    prep.add_argument("--image-size", type=int, default=64, help="download.image_size")
    prep.add_argument("--context-length", type=int, default=32)
    run = sub.add_parser("run", help="train one side with one seed, score it")
    run.add_argument("--work", required=True, type=Path)
    run.add_argument("--side", choices=("ours", "openclip"), required=True)
    run.add_argument("--seed", type=int, default=0)
    run.add_argument("--preset", default="tiny")
    run.add_argument("--steps", type=int, default=160)
    run.add_argument("--batch-size", type=int, default=64)
    run.add_argument("--lr", type=float, default=5e-4)
    run.add_argument("--warmup", type=int, default=16)
    run.add_argument("--wd", type=float, default=0.2)
    run.add_argument("--wd-rule", choices=("openclip", "embeddings"), default="openclip")
    run.add_argument("--grad-clip-norm", type=float, default=1.0)
    run.add_argument("--init", choices=("own", "openclip"), default="own",
                     help="--side ours: openclip = start from open_clip's initial weights for the "
                     "seed (converted by clipms.model.convert; needs --peer-python), to isolate "
                     "init")
    run.add_argument("--peer-python", help="--side openclip: the python of a venv with "
                     "torch + open_clip_torch (see benchmarks/openclip_fit.py)")
    run.add_argument("--loss", choices=("clip", "siglip"), default="clip")
    run.add_argument("--patch-dropout", type=float, default=0.0)
    run.add_argument("--eval-every", type=int, default=0,
                     help="score the val split every this many steps (0: only at the end)")
    table = sub.add_parser("table", help="markdown table of WORK/results.jsonl")
    table.add_argument("--work", required=True, type=Path)
    table.add_argument("--json-out", type=Path, help="also write the comparison as JSON here")
    return parser.parse_args()


# ------------------------------------------------------------------------------------- prepare
@contextlib.contextmanager
def loopback_server(folder: Path | None, port: int) -> Iterator[None]:
    """A static file server on 127.0.0.1 for the download stage (img2dataset fetches over HTTP)."""
    if folder is None:
        yield
        return
    handler = functools.partial(_QuietHandler, directory=str(folder))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", port), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield
    finally:
        server.shutdown()
        server.server_close()


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base's name
        pass


def work_params(args: argparse.Namespace) -> dict[str, Any]:
    """The project's params.yaml with the benchmark's data settings."""
    params = yaml.safe_load((ROOT / "params.yaml").read_text())
    params["metadata"].update(source="local", path=str(args.parquet.resolve()))
    params["dedupe"]["val_fraction"] = args.val_fraction
    params["download"]["image_size"] = args.image_size
    if "allow_private_addresses" in params["download"]:  # the loopback server is private
        params["download"]["allow_private_addresses"] = args.serve is not None
    params["tokenizer"].update(kind="openai", context_length=args.context_length)
    return params


def prepare(args: argparse.Namespace) -> None:
    args.work.mkdir(parents=True, exist_ok=True)
    (args.work / "params.yaml").write_text(yaml.safe_dump(work_params(args), sort_keys=False))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    with loopback_server(args.serve, args.port):
        for stage in DATA_STAGES:
            started = time.perf_counter()
            subprocess.run([sys.executable, "-m", f"stages.{stage}"], cwd=args.work, env=env,
                           check=True)
            print(f"prepare: {stage} {time.perf_counter() - started:.1f} s", flush=True)
    manifest = json.loads((args.work / "data/shards/manifest.json").read_text())
    print(json.dumps({"prepared": str(args.work), "splits": {
        k: v["samples"] for k, v in manifest["splits"].items()}}))


# ----------------------------------------------------------------------------------------- run
def model_config(args: argparse.Namespace) -> Any:
    """The preset with the tokenizer's vocabulary, the loss's initial scale and bias and the
    patch dropout: one config, so both sides build the same model (`to_openclip` carries them)."""
    from clipms.model.architecture import get_preset
    from clipms.text.clip_tokenizer import Tokenizer
    from clipms.train.recipe import LOSS_INIT

    tokenizer = Tokenizer.load(args.work / "models/tokenizer.json")
    cfg = get_preset(args.preset)
    text = dataclasses.replace(cfg.text, vocab_size=tokenizer.vocab_size,
                               context_length=tokenizer.context_length)
    vision = dataclasses.replace(cfg.vision, patch_dropout=args.patch_dropout)
    return dataclasses.replace(cfg, text=text, vision=vision, **LOSS_INIT[args.loss]), tokenizer


def train_ours(args: argparse.Namespace) -> tuple[dict[str, Any], dict[str, Any]]:
    """clipms's trainer on the shards; (features for scoring, run facts)."""
    from benchmarks.throughput.checks import EvalCopy, QualityChecks
    from clipms.data.loading import LoaderSettings
    from clipms.data.preprocess import PreprocessConfig
    from clipms.eval import metrics
    from clipms.eval.embed import CellTowers, embed_split
    from clipms.runtime import for_precision, prepare_import
    from clipms.train.loop import ShardBatches, TrainConfig, train

    cfg, tokenizer = model_config(args)
    config = TrainConfig(model=cfg, batch_size=args.batch_size, max_steps=args.steps,
                         lr=args.lr, warmup_steps=args.warmup, weight_decay=args.wd,
                         grad_clip_norm=args.grad_clip_norm or None, seed=args.seed,
                         decay_embeddings=args.wd_rule == "openclip",
                         log_every=args.eval_every or 20, loss=args.loss)
    if args.init == "openclip":
        # the conversion imports MindSpore before train() configures the runtime: export what
        # MindSpore reads at import (OMP_WAIT_POLICY) first, or its idle threads spin
        prepare_import(for_precision(config.runtime, config.precision))
        config = config.model_copy(update={"init_from": openclip_init(args)})
    preprocess = PreprocessConfig(image_size=cfg.vision.image_size)
    shards = args.work / "data/shards"
    source = ShardBatches(shards, tokenizer, preprocess, args.batch_size,
                          LoaderSettings(seed=args.seed))
    copy = EvalCopy(cfg)

    def score(model: Any) -> dict[str, float]:
        val = embed_split(CellTowers(copy(model), tokenizer, 128), preprocess, shards, 128, "val")
        return metrics.retrieval_metrics(val.image_features, val.text_features,
                                         val.text_to_image)

    checks = QualityChecks(args.eval_every, score, CURVE_KEYS)  # the clock starts
    result = train(config, source, checkpoint_dir=None, callbacks=[checks])
    curve = checks.curve if args.eval_every else []
    val = embed_split(CellTowers(result.model, tokenizer, 128), preprocess, shards, 128, "val")
    return ({"image_features": val.image_features, "text_features": val.text_features,
             "text_to_image": val.text_to_image},
            {"side": "ours", "final_loss": result.summary["final_loss"],
             "train_s": round(checks.train_s, 1), "curve": curve,
             "first_step_s": round(checks.first_step_s or 0.0, 1),  # startup + compilation
             "logit_bias": result.summary.get("logit_bias"),
             "peak_rss_mb": result.summary.get("peak_rss_mb")})


def peer_command(args: argparse.Namespace) -> tuple[Path, list[str]]:
    """The model's open_clip config written under the work folder, and the peer's command line up
    to its per-use options (the shards, tokenizer, config and seed both peer runs share)."""
    cfg, _ = model_config(args)
    run_dir = args.work / "runs"
    run_dir.mkdir(exist_ok=True)
    config_path = run_dir / f"openclip-{args.preset}-{args.loss}-pd{args.patch_dropout:g}.json"
    config_path.write_text(json.dumps(cfg.to_openclip()))
    return config_path, [args.peer_python, str(ROOT / "benchmarks/openclip_fit.py"),
                         "--shards", str(args.work / "data/shards"),
                         "--tokenizer", str(args.work / "models/tokenizer.json"),
                         "--model-config", str(config_path), "--seed", str(args.seed)]


def openclip_init(args: argparse.Namespace) -> str:
    """open_clip's initial weights for the seed (the peer's own init), as a clipms checkpoint."""
    from clipms.model import convert

    config_path, base = peer_command(args)
    weights = config_path.parent / f"openclip-init-{args.preset}-seed{args.seed}.safetensors"
    subprocess.run([*base, "--out", "unused.npz", "--dump-init", str(weights)], check=True)
    out = weights.with_suffix(".ckpt")
    convert.main(["from-openclip", "--config", str(config_path), "--weights", str(weights),
                  "--out", str(out)])
    return str(out)


def train_peer(args: argparse.Namespace) -> tuple[dict[str, Any], dict[str, Any]]:
    import numpy as np

    if not args.peer_python:
        raise SystemExit("--side openclip needs --peer-python (a venv with open_clip_torch)")
    config_path, base = peer_command(args)
    out = config_path.with_name(f"{config_path.stem}-seed{args.seed}-{args.wd_rule}.npz")
    cmd = [*base, "--out", str(out), "--steps", str(args.steps),
           "--batch-size", str(args.batch_size), "--lr", str(args.lr),
           "--warmup", str(args.warmup), "--wd", str(args.wd), "--wd-rule", args.wd_rule,
           "--eval-every", str(args.eval_every)]
    if args.grad_clip_norm:
        cmd += ["--grad-clip-norm", str(args.grad_clip_norm)]
    proc = subprocess.run(cmd, check=True, stdout=subprocess.PIPE, text=True)
    facts = json.loads(proc.stdout.strip().splitlines()[-1])
    with np.load(out) as features:
        return {k: features[k] for k in features.files}, facts


def run(args: argparse.Namespace) -> None:
    import numpy as np

    from clipms.eval import metrics

    features, facts = (train_ours if args.side == "ours" else train_peer)(args)
    found = metrics.retrieval_metrics(features["image_features"], features["text_features"],
                                      features["text_to_image"])
    counts = [int(c) for c in np.bincount(features["text_to_image"])]
    chance = metrics.retrieval_chance_levels(counts)
    record = {**facts, "seed": args.seed, "wd_rule": args.wd_rule, "init": args.init,
              "loss": args.loss, "patch_dropout": args.patch_dropout,
              "eval_every": args.eval_every, "steps": args.steps,
              "batch_size": args.batch_size, "lr": args.lr, "warmup": args.warmup,
              "wd": args.wd, "grad_clip_norm": args.grad_clip_norm, "preset": args.preset,
              "val_images": len(counts), "val_captions": sum(counts),
              "load_avg_1m": round(os.getloadavg()[0], 1),
              **{k: found[k] for k in REPORTED}, "chance_i2t_R@5": chance["i2t_R@5"],
              "chance_t2i_R@5": chance["t2i_R@5"]}
    with open(args.work / "results.jsonl", "a") as handle:
        handle.write(json.dumps(record) + "\n")
    print(json.dumps(record), flush=True)


# --------------------------------------------------------------------------------------- table
def setting(row: dict) -> tuple:
    """What a run trained: (preset, wd rule, steps, lr, batch, loss, patch dropout); runs from
    before the loss and patch dropout were options trained the softmax loss without dropout."""
    return (row["preset"], row["wd_rule"], row["steps"], row["lr"], row["batch_size"],
            row.get("loss", "clip"), float(row.get("patch_dropout", 0.0)))


def describe(key: tuple) -> str:
    preset, rule, steps, lr, batch, loss, dropout = key
    return (f"{preset}, wd rule {rule}, {steps} steps, lr {lr}, batch {batch}, loss {loss}, "
            f"patch dropout {dropout:g}")


def table(args: argparse.Namespace) -> None:
    """Print `tables` of WORK/results.jsonl; `--json-out` also writes its runs and comparisons
    in benchmarks/record.py's envelope, from which benchmarks/RESULTS.md renders the same
    tables."""
    rows = [json.loads(line) for line in (args.work / "results.jsonl").read_text().splitlines()
            if line.strip()]
    print("\n".join(tables(rows)))
    out = getattr(args, "json_out", None)
    if out:
        import record  # benchmarks/record.py: the result file's envelope (command, commit, load)

        shown = [sys.argv[0], *record.with_placeholders(sys.argv[1:], {"--work": "WORK"})]
        record.start(out.stem, shown).write(summary(rows), out)


def groups_of(rows: list[dict]) -> dict[tuple, dict[str, dict[int, dict]]]:
    """`setting` (ours from another init a setting of its own) -> side -> seed -> row; the last
    run of each counts."""
    groups: dict[tuple, dict[str, dict[int, dict]]] = {}
    for row in rows:
        key = setting(row)
        if row.get("init", "own") != "own":
            key = (key[0], f"{key[1]}, init {row['init']}", *key[2:])
        groups.setdefault(key, {}).setdefault(row["side"], {})[row["seed"]] = row
    return groups


def tables(rows: list[dict]) -> list[str]:
    """Markdown, per setting: every run's recalls (both directions), mean +- sample sd over the
    seeds both sides ran, and ours / open_clip of the R@5 means; then per setting every arm (ours
    from each init, open_clip) over all its seeds, compared (`comparison`); then, where both
    sides checked quality as they trained, each side's time to the quality both reached
    (`equal_quality`)."""
    lines: list[str] = []
    groups = groups_of(rows)
    for key, sides in sorted(groups.items()):
        both = sorted(set(sides.get("ours", {})) & set(sides.get("open_clip", {})))
        lines += [f"\n{describe(key)}; seeds with both sides {both}\n",
                  "| side | seed | " + " | ".join(TABLED) + " | final loss | train s | load 1m |",
                  "|---" * (len(TABLED) + 5) + "|"]
        for side in ("ours", "open_clip"):
            by_seed = sides.get(side, {})
            for seed in sorted(by_seed):
                run = by_seed[seed]
                lines.append(f"| {side} | {seed} | " + " | ".join(
                    f"{run[k]:.3f}" for k in TABLED) + f" | {run['final_loss']:.3f} | "
                    f"{run['train_s']:.0f} | {run['load_avg_1m']} |")
            seeds = both or sorted(by_seed)
            if len(seeds) > 1:
                lines.append(f"| {side} | mean +- sd {seeds} | " + " | ".join(
                    _mean_sd([by_seed[s][k] for s in seeds]) for k in TABLED) + " | | | |")
        if both:
            ratio = {k: statistics.mean(sides["ours"][s][k] for s in both)
                     / statistics.mean(sides["open_clip"][s][k] for s in both)
                     for k in ("i2t_R@5", "t2i_R@5")}
            lines.append(f"\nours / open_clip (means over {both}): i2t R@5 "
                         f"{ratio['i2t_R@5']:.2f}, t2i R@5 {ratio['t2i_R@5']:.2f}")
    for key, by_arm in sorted(arms(rows).items()):
        if len(by_arm) > 1:
            lines += [f"\nComparison of the arms, {describe(key)} (mean +- sample sd over each "
                      "arm's seeds)\n", *comparison(by_arm)]
    for key, sides in sorted(groups.items()):
        found = equal_quality(sides)
        if found:
            lines += [f"\nTime to equal quality, {describe(key)}\n", *equal_quality_table(found)]
    return lines


def summary(rows: list[dict]) -> dict[str, Any]:
    """The JSON of `table --json-out`: every run (the tables are made again from them) and, per
    setting, the time to equal quality and each arm's mean and sd."""
    groups = groups_of(rows)
    return {"quality": QUALITY, "runs": rows,
            "settings": [{"setting": describe(key), "equal_quality": equal_quality(sides),
                          "arms": {arm: {k: _mean_sd_pair([r[k] for r in by_seed.values()])
                                         for k in COMPARED} | {"seeds": sorted(by_seed)}
                                   for arm, by_seed in arms(rows).get(key, {}).items()}}
                         for key, sides in sorted(groups.items())]}


QUALITY = "R@5, both directions' mean"


def r5_mean(check: dict) -> float:
    return (check["i2t_R@5"] + check["t2i_R@5"]) / 2


def equal_quality(sides: dict[str, dict[int, dict]]) -> list[dict[str, Any]]:
    """Per seed where both sides scored the val split as they trained: the quality both reached
    (the lower of the two final R@5 means) and each side's first check at or above it (step,
    training seconds, the load at the run's start), with ours / open_clip of the seconds."""
    found = []
    for seed in sorted(set(sides.get("ours", {})) & set(sides.get("open_clip", {}))):
        ours, peer = sides["ours"][seed], sides["open_clip"][seed]
        if not ours.get("curve") or not peer.get("curve"):
            continue
        level = min(r5_mean(ours["curve"][-1]), r5_mean(peer["curve"][-1]))
        hit = {side: next(c for c in run["curve"] if r5_mean(c) >= level)
               for side, run in (("ours", ours), ("open_clip", peer))}
        found.append({"seed": seed, "quality": round(level, 4),
                      **{f"{side}_{k}": hit[side][k] for side in hit for k in ("step", "train_s")},
                      "ours_load_1m": ours["load_avg_1m"], "open_clip_load_1m": peer["load_avg_1m"],
                      "ours_over_open_clip_s": round(hit["ours"]["train_s"]
                                                     / hit["open_clip"]["train_s"], 3)})
        if ours.get("first_step_s"):  # ours compiles its graph in the first step; torch does not
            found[-1]["ours_first_step_s"] = ours["first_step_s"]
            found[-1]["ours_over_open_clip_s_after_first_step"] = round(
                (hit["ours"]["train_s"] - ours["first_step_s"]) / hit["open_clip"]["train_s"], 3)
    return found


def equal_quality_table(found: list[dict[str, Any]]) -> list[str]:
    """Each side's step and seconds to the quality; the ratio of the seconds, whole and with our
    first step (startup and graph compilation, once per run) left out."""
    lines = [f"| seed | quality ({QUALITY}) | ours: step | s | open_clip: step | s | ours / "
             "open_clip, s | the same, our first step left out | load 1m ours / open_clip |",
             "|---" * 9 + "|"]
    for f in found:
        after = f.get("ours_over_open_clip_s_after_first_step")
        lines.append(f"| {f['seed']} | {f['quality']:.3f} | {f['ours_step']} | "
                     f"{f['ours_train_s']:.0f} | {f['open_clip_step']} | "
                     f"{f['open_clip_train_s']:.0f} | {f['ours_over_open_clip_s']:.2f} | "
                     f"{'-' if after is None else f'{after:.2f}'} | "
                     f"{f['ours_load_1m']} / {f['open_clip_load_1m']} |")
    ratios = [f["ours_over_open_clip_s"] for f in found]
    after = [f["ours_over_open_clip_s_after_first_step"] for f in found
             if "ours_over_open_clip_s_after_first_step" in f]
    if len(ratios) > 1:
        lines.append(f"| mean +- sd | | | | | | {_mean_sd(ratios)} | "
                     f"{_mean_sd(after) if len(after) == len(ratios) else ''} | |")
    return lines


def _mean_sd_pair(values: list[float]) -> list[float]:
    return [statistics.mean(values), statistics.stdev(values) if len(values) > 1 else 0.0]


def _mean_sd(values: list[float]) -> str:
    return f"{statistics.mean(values):.3f} +- {statistics.stdev(values):.3f}"


COMPARED = ("i2t_R@5", "t2i_R@5", "i2t_R@1", "t2i_R@1", "i2t_R@10", "t2i_R@10")


def welch(a: list[float], b: list[float]) -> tuple[float, float]:
    """Welch's t of mean(a) - mean(b) (unequal variances) and its Welch-Satterthwaite df."""
    va, vb = statistics.variance(a) / len(a), statistics.variance(b) / len(b)
    t = (statistics.mean(a) - statistics.mean(b)) / (va + vb) ** 0.5
    df = (va + vb) ** 2 / (va**2 / (len(a) - 1) + vb**2 / (len(b) - 1))
    return t, df


def paired(a: dict[int, float], b: dict[int, float]) -> tuple[list[int], float, float, float]:
    """Over the seeds both have (same batches per seed): (seeds, mean and sd of a - b, t)."""
    seeds = sorted(set(a) & set(b))
    diffs = [a[s] - b[s] for s in seeds]
    mean, sd = statistics.mean(diffs), statistics.stdev(diffs)
    if sd:
        return seeds, mean, sd, mean / (sd / len(seeds) ** 0.5)
    return seeds, mean, sd, math.copysign(math.inf, mean) if mean else math.nan


def arms(rows: list[dict]) -> dict[tuple, dict[str, dict[int, dict]]]:
    """`setting` -> arm ("ours, init X" or "open_clip") -> seed -> row (the last run of each
    counts)."""
    found: dict[tuple, dict[str, dict[int, dict]]] = {}
    for row in rows:
        key = setting(row)
        arm = "open_clip" if row["side"] == "open_clip" else f"ours, init {row.get('init', 'own')}"
        found.setdefault(key, {}).setdefault(arm, {})[row["seed"]] = row
    return found


def comparison(by_arm: dict[str, dict[int, dict]], metrics: tuple[str, ...] = COMPARED,
               compared: tuple[str, ...] = ("i2t_R@5", "t2i_R@5")) -> list[str]:
    """Markdown: every arm's n, mean +- sd per metric; then, per `compared` metric, every pair of
    ours arms and every ours arm against open_clip: ratio of the means, Welch t (df), and the
    paired difference by seed (mean +- sd, t) over the seeds both ran (the same batches), where
    there are two or more."""
    names = sorted(by_arm, key=lambda arm: (arm == "open_clip", arm))
    lines = ["| arm | n | seeds | " + " | ".join(metrics) + " |", "|---" * (len(metrics) + 3) + "|"]
    for arm in names:
        seeds = sorted(by_arm[arm])
        cells = [_mean_sd([by_arm[arm][s][k] for s in seeds]) if len(seeds) > 1
                 else f"{by_arm[arm][seeds[0]][k]:.3f}" for k in metrics]
        lines.append(f"| {arm} | {len(seeds)} | {_seed_span(seeds)} | " + " | ".join(cells) + " |")
    ours = [arm for arm in names if arm != "open_clip"]
    pairs = [(a, b) for i, b in enumerate(ours) for a in ours[i + 1:]]
    pairs += [(a, "open_clip") for a in ours if "open_clip" in by_arm]
    tested = []
    for a, b in pairs:
        for k in compared:
            x = {s: r[k] for s, r in by_arm[a].items()}
            y = {s: r[k] for s, r in by_arm[b].items()}
            if min(len(x), len(y)) < 2:
                continue
            t, df = welch(list(x.values()), list(y.values()))
            ratio = statistics.mean(x.values()) / statistics.mean(y.values())
            cells = ["", "", ""]
            if len(set(x) & set(y)) > 1:
                seeds, mean, sd, pt = paired(x, y)
                cells = [_seed_span(seeds), f"{mean:+.4f} +- {sd:.4f}",
                         "identical" if math.isnan(pt) else f"{pt:+.2f}"]
            tested.append(f"| {a} - {b} | {k} | {ratio:.2f} | {t:+.2f} ({df:.1f}) | "
                          + " | ".join(cells) + " |")
    if tested:  # a t needs two seeds a side
        lines += ["", "| arm - reference | metric | ratio of means | Welch t (df) | paired seeds "
                  "| paired diff mean +- sd | paired t |", "|---" * 7 + "|", *tested]
    return lines


def _seed_span(seeds: list[int]) -> str:
    return (f"{seeds[0]}-{seeds[-1]}" if seeds == list(range(seeds[0], seeds[-1] + 1))
            else ",".join(map(str, seeds)))


def main() -> None:
    args = _parse()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    {"prepare": prepare, "run": run, "table": table}[args.command](args)


if __name__ == "__main__":
    main()
