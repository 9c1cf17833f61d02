"""Time to quality: how long training the default world takes to reach a zero-shot target, per
training recipe (the old default, SigLIP, patch dropout, shorter schedules, ...), alternated in
one run over seeds.

    # the default world's shards and tokenizer: a checkout of the project, data stages only
    git clone <this repo> WORK && (cd WORK && dvc repro tokenizer)
    nice -n 5 python benchmarks/time_to_quality.py run --work WORK --seeds 0 1
    python benchmarks/time_to_quality.py table benchmarks/results/time_to_quality.json

Each run is `stages.train`'s own job (`build_job` on WORK's params.yaml with the candidate's
`train` overrides; checkpoints every `checkpoint_every` steps, as `make run` writes them), in a
process of its own, writing into a scratch folder. Every `--eval-every` steps the training is
paused and the model scored as `stages.evaluate` scores it (the val split, `evaluate` params of
WORK): zero-shot top-1 and R@5 both ways. The clock counts training only - model building,
compilation, the loader, checkpoints and the steps - never the pauses. A candidate's time to
quality is its clock at the first check with zero-shot top-1 >= --target; its steps likewise.

Runs alternate: each seed starts with the old default, then goes through the other candidates,
seed 0 in order, seed 1 in reverse, and so on, so the machine's drift falls on all of them alike;
the 1-minute load is recorded before and after each run. The 90-epoch lever runs stop at the
target, or once their clock passes the old default's time to it on the same seed (the lever bought
no time). `--lanes 2` trains two seeds at once, each lane its own sequence; `--all-at-once`
starts every run together, each in a process of its own. The JSON (`--out`) is
rewritten after every run (benchmarks/record.py's envelope), so a long run can be read
as it goes.

Why a script under benchmarks/ and not a `python -m benchmarks.throughput` subcommand: it drives
the pipeline's own train stage and params.yaml (stages/, pipeline/), which the clipms library must
not import.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

DEFAULT_OUT = ROOT / "benchmarks/results/time_to_quality.json"

# The default before this benchmark (90 epochs of the softmax loss at lr 1e-3): every setting a
# candidate changes, stated so that the baseline stays that default whatever params.yaml says now.
# Everything else (batch 64, warmup 100, the model, ...) is WORK's params.yaml.
OLD_DEFAULT: dict[str, Any] = {"loss": "clip", "model.vision.patch_dropout": 0.0, "epochs": 90,
                               "lr": 1.0e-3}
BASELINE = "old-default"
# candidate -> its `train` overrides on top of OLD_DEFAULT (dotted keys, as `dvc exp run -S`)
CANDIDATES: dict[str, dict[str, Any]] = {
    BASELINE: {},
    "siglip": {"loss": "siglip"},
    "pd25": {"model.vision.patch_dropout": 0.25},
    "pd50": {"model.vision.patch_dropout": 0.5},
    "siglip-pd50": {"loss": "siglip", "model.vision.patch_dropout": 0.5},
    "clip-45ep": {"epochs": 45},
    "siglip-45ep": {"loss": "siglip", "epochs": 45},
    "siglip-pd50-45ep": {"loss": "siglip", "model.vision.patch_dropout": 0.5, "epochs": 45},
    "siglip-45ep-lr2e-3": {"loss": "siglip", "epochs": 45, "lr": 2.0e-3},
    "siglip-30ep": {"loss": "siglip", "epochs": 30},
}
# The 90-epoch lever runs answer "how soon does this lever reach the target": they stop there, or
# once their clock passes the time the old default of their seed took to the target (then the
# lever did not buy time), unless --full. The old default and the shorter schedules, candidates
# for the new default, always run to the end, whose i2t R@5 the default must keep.
STOP_AT_TARGET = {"siglip", "pd25", "pd50", "siglip-pd50"}
REPORTED = ("zeroshot_top1", "i2t_R@5", "t2i_R@5", "i2t_R@1", "t2i_R@1")


def _parse(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="train every candidate for every seed, alternated")
    run.add_argument("--work", required=True, type=Path,
                     help="a checkout whose data stages ran (data/shards, models/tokenizer.json)")
    run.add_argument("--candidates", nargs="+", default=list(CANDIDATES),
                     help=f"names of CANDIDATES (default: all: {', '.join(CANDIDATES)})")
    run.add_argument("--seeds", nargs="+", type=int, default=[0, 1])
    run.add_argument("--target", type=float, default=0.85, help="zero-shot top-1 to reach")
    run.add_argument("--eval-every", type=int, default=90, help="steps between checks")
    run.add_argument("--max-steps", type=int, default=None,
                     help="cap every run at this many steps (a smoke test of the benchmark)")
    run.add_argument("--full", action="store_true",
                     help=f"run {', '.join(sorted(STOP_AT_TARGET))} to the end too")
    run.add_argument("--lanes", type=int, default=1,
                     help="seeds trained at the same time, each its own sequence of runs (on a "
                     "machine shared with other work, a second lane takes a second share of it)")
    run.add_argument("--all-at-once", action="store_true",
                     help="every run in its own process, all started together: for a machine "
                     "too busy to run them one after another in the time there is; they share "
                     "its load, and the lever runs stop at the target only (no old default's "
                     "time yet to bound them)")
    run.add_argument("--out", type=Path, default=DEFAULT_OUT)
    one = sub.add_parser("one", help="(internal) one training run; prints its JSON")
    one.add_argument("--work", required=True, type=Path)
    one.add_argument("--overrides", required=True, help="JSON of the train overrides")
    one.add_argument("--eval-every", type=int, required=True)
    one.add_argument("--scratch", required=True, type=Path)
    one.add_argument("--stop-at", type=float, default=None,
                     help="stop when zero-shot top-1 reaches this")
    one.add_argument("--deadline", type=float, default=None,
                     help="stop at the first check after this many training seconds")
    table = sub.add_parser("table", help="markdown tables of a result JSON")
    table.add_argument("result", type=Path, nargs="?", default=DEFAULT_OUT)
    return parser.parse_args(argv)


# ----------------------------------------------------------------------------- one training run
def candidate_overrides(name: str, seed: int, max_steps: int | None) -> dict[str, Any]:
    if name not in CANDIDATES:
        raise SystemExit(f"unknown candidate {name!r}; known: {', '.join(CANDIDATES)}")
    overrides = {**OLD_DEFAULT, **CANDIDATES[name], "seed": seed}
    if max_steps is not None:
        overrides["max_steps"] = max_steps
    return overrides


def train_params(work: Path, overrides: dict[str, Any]) -> Any:
    """WORK's `train` section with the dotted overrides applied, validated."""
    from pipeline.params import read_params, validate_section
    from stages.train import TrainParams

    section = read_params(work / "params.yaml")["train"]
    for dotted, value in overrides.items():
        *parents, leaf = dotted.split(".")
        node = section
        for part in parents:
            if not isinstance(node.get(part), dict):
                node[part] = {}
            node = node[part]
        node[leaf] = value
    return validate_section("train", TrainParams, section)


def scorer(model_config: Any) -> Any:
    """score(model) -> the `evaluate` stage's metrics of the model's current weights (the checkout's
    `evaluate` params), through an evaluation-mode copy (benchmarks.throughput.checks.EvalCopy)."""
    from benchmarks.throughput.checks import EvalCopy
    from clipms.eval.options import EvaluateParams
    from pipeline import paths
    from pipeline.params import load_section

    params = load_section("evaluate", EvaluateParams)
    spec, copy = params.zeroshot_spec(), EvalCopy(model_config)

    def score(model: Any) -> dict[str, float]:
        from clipms.data.preprocess import PreprocessConfig
        from clipms.eval.scoring import evaluate
        from clipms.text.clip_tokenizer import Tokenizer

        preprocess = PreprocessConfig(image_size=model_config.vision.image_size)
        return evaluate(copy(model), Tokenizer.load(paths.TOKENIZER), preprocess, paths.SHARDS,
                        params.batch_size, spec, split=params.split).metrics

    return score


def one(args: argparse.Namespace) -> None:
    """One run in this process (the `run` command starts one per candidate and seed)."""
    import dataclasses

    from benchmarks.throughput.checks import OutOfTime, QualityChecks, TargetReached
    from clipms.runtime import RuntimeConfig, for_precision, prepare_import
    from pipeline.params import load_section

    os.chdir(args.work)  # the stages name their files relative to the checkout
    overrides = json.loads(args.overrides)
    params = train_params(Path("."), overrides)
    runtime = load_section("runtime", RuntimeConfig)
    prepare_import(for_precision(runtime, params.precision))  # before MindSpore's import
    from clipms.train import job as train_job
    from stages.train import build_job

    job = build_job(params, runtime)
    scratch = args.scratch
    outputs = train_job.Outputs(
        checkpoint=str(scratch / "clip.ckpt"), run_config=str(scratch / "clip.json"),
        metrics=str(scratch / "train.json"), plot=str(scratch / "train.csv"))
    job = dataclasses.replace(job, checkpoint_dir=str(scratch / "checkpoints"), resume=False,
                              outputs=outputs)
    stop = None if args.stop_at is None else ("zeroshot_top1", args.stop_at)
    checker = QualityChecks(args.eval_every, scorer(job.config.model), REPORTED, stop,
                            args.deadline)  # the clock starts
    try:
        summary = train_job.run(job, [checker]).summary
    except TargetReached:
        summary = {"steps": checker.curve[-1]["step"], "stopped": "target"}
    except OutOfTime:
        summary = {"steps": checker.curve[-1]["step"], "stopped": "old default's time"}
    steps, train_s = int(summary["steps"]), checker.train_s
    stepping = train_s - (checker.first_step_s or 0.0)  # the steps after the first (compile)
    batch = job.config.batch_size * job.config.accum_steps
    print(json.dumps({"overrides": overrides, "steps": steps, "train_s": round(train_s, 1),
                      "first_step_s": round(checker.first_step_s or 0.0, 1),
                      "samples_per_s": round(batch * (steps - 1) / stepping, 1)
                      if stepping > 0 else None,
                      "stopped": summary.get("stopped"),
                      "final_loss": summary.get("final_loss"),
                      "logit_bias": summary.get("logit_bias"),
                      "peak_rss_mb": round(summary["peak_rss_mb"]) if "peak_rss_mb" in summary
                      else None, "final": checker.curve[-1], "curve": checker.curve}), flush=True)


# ------------------------------------------------------------------------------ the whole run
def schedule(candidates: Sequence[str], seeds: Sequence[int]) -> dict[int, list[str]]:
    """Each seed's candidates in run order: the old default first (its time to the target bounds
    the lever runs of its seed), then the others, in reverse for every other seed (the drift of
    the machine falls on every candidate alike)."""
    first = [name for name in candidates if name == BASELINE]
    rest = [name for name in candidates if name != BASELINE]
    return {seed: first + (rest if i % 2 == 0 else rest[::-1]) for i, seed in enumerate(seeds)}


def lanes_of(plan: dict[int, list[str]], all_at_once: bool) -> list[tuple[int, list[str]]]:
    """The sequences of runs that go side by side: one per seed, or with `all_at_once` one per
    run, every run started together under the same load."""
    if all_at_once:
        return [(seed, [name]) for seed, names in plan.items() for name in names]
    return list(plan.items())


def run_one(args: argparse.Namespace, name: str, seed: int, max_steps: int | None = None,
            stop_at: float | None = None, deadline: float | None = None) -> dict[str, Any]:
    """One run in a process of its own: its JSON, with the load and the start time."""
    overrides = candidate_overrides(name, seed, max_steps)
    load_before = os.getloadavg()
    started = datetime.now(UTC)
    with tempfile.TemporaryDirectory(prefix="ttq-") as scratch:
        cmd = [sys.executable, str(Path(__file__).resolve()), "one", "--work",
               str(args.work.resolve()), "--overrides", json.dumps(overrides),
               "--eval-every", str(args.eval_every), "--scratch", scratch]
        cmd += ["--stop-at", str(stop_at)] if stop_at is not None else []
        cmd += ["--deadline", str(deadline)] if deadline is not None else []
        proc = subprocess.run(cmd,
                              env={**os.environ, "PYTHONPATH": str(ROOT)},
                              stdout=subprocess.PIPE, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"time_to_quality: {name} seed {seed} failed (exit {proc.returncode})")
    found = json.loads(proc.stdout.strip().splitlines()[-1])
    return {"candidate": name, "seed": seed, "started_utc": started.isoformat(timespec="seconds"),
            "load_1m_start": round(load_before[0], 2),
            "load_1m_end": round(os.getloadavg()[0], 2), **found}


def reached(row: dict[str, Any], target: float) -> dict[str, Any] | None:
    """The first check at or above the target, or None."""
    return next((c for c in row["curve"] if c["zeroshot_top1"] >= target), None)


def summarise(runs: list[dict[str, Any]], target: float, min_r5: float = 0.95,
              share: float = 0.5) -> dict[str, Any]:
    """Per candidate and seed: time and steps to the target, and its ratios to the old default of
    the same seed (its time to the target, and its whole training: "today's training time");
    `meets` when on every seed the target came within `share` of the old default's whole
    training time and the whole run (not one stopped early) ended with i2t R@5 >= `min_r5`: a
    recipe that can be the default."""
    baseline = {r["seed"]: r for r in runs if r["candidate"] == BASELINE}
    out: dict[str, Any] = {}
    for row in runs:
        hit, base = reached(row, target), baseline.get(row["seed"])
        entry = {"steps": row["steps"], "train_s": row["train_s"],
                 "samples_per_s": row["samples_per_s"],
                 "stopped": row.get("stopped"),
                 "steps_to_target": hit["step"] if hit else None,
                 "train_s_to_target": hit["train_s"] if hit else None,
                 **{f"final_{k}": row["final"][k] for k in REPORTED}}
        if base is not None:
            base_hit = reached(base, target)
            entry["to_target_over_old_default_train_s"] = (
                round(hit["train_s"] / base["train_s"], 3) if hit else None)
            entry["to_target_over_old_default_to_target"] = (
                round(hit["train_s"] / base_hit["train_s"], 3) if hit and base_hit else None)
        out.setdefault(row["candidate"], {})[str(row["seed"])] = entry
    for seeds in out.values():
        ratios = [s.get("to_target_over_old_default_train_s") for s in seeds.values()]
        whole = [s for s in seeds.values() if not s["stopped"]]
        seeds["meets"] = bool(ratios) and all(r is not None and r <= share for r in ratios) and \
            len(whole) == len(ratios) and all(s["final_i2t_R@5"] >= min_r5 for s in whole)
    return out


def run(args: argparse.Namespace) -> None:
    import record  # benchmarks/record.py: the result file's envelope (command, commit, load)

    for name in args.candidates:
        candidate_overrides(name, 0, None)  # unknown names fail before anything trains
    if BASELINE not in args.candidates:
        print(f"time_to_quality: no {BASELINE!r} among the candidates: no ratios",
              file=sys.stderr)
    # results/<name>.json holds benchmark <name>; the checkout is where the reader puts theirs
    shown = [sys.argv[0], *record.with_placeholders(sys.argv[1:], {"--work": "WORK"})]
    recording = record.start(args.out.stem, shown)
    result: dict[str, Any] = {
        "target": {"zeroshot_top1": args.target, "eval_every": args.eval_every},
        "old_default": OLD_DEFAULT, "candidates": {n: CANDIDATES[n] for n in args.candidates},
        "max_steps": args.max_steps, "lanes": args.lanes, "all_at_once": args.all_at_once,
        "stop_at_target": [] if args.full else sorted(STOP_AT_TARGET & {*args.candidates}),
        "runs": []}
    lock = threading.Lock()

    def lane(seed: int, names: list[str]) -> None:
        deadline = None
        for name in names:
            print(f"time_to_quality: {name} seed {seed}", file=sys.stderr, flush=True)
            lever = name in STOP_AT_TARGET and not args.full
            row = run_one(args, name, seed, args.max_steps, args.target if lever else None,
                          deadline if lever else None)
            if name == BASELINE:
                hit = reached(row, args.target)
                deadline = hit["train_s"] if hit else row["train_s"]
            with lock:
                result["runs"].append(row)
                result["summary"] = summarise(result["runs"], args.target)
                recording.write(result, args.out)

    lanes = lanes_of(schedule(args.candidates, args.seeds), args.all_at_once)
    workers = len(lanes) if args.all_at_once else max(1, args.lanes)
    with ThreadPoolExecutor(max_workers=workers) as pool:
        for done in [pool.submit(lane, seed, names) for seed, names in lanes]:
            done.result()
    print("\n".join(tables(result)))


# --------------------------------------------------------------------------------------- table
def tables(result: dict[str, Any]) -> list[str]:
    """Markdown: per candidate and seed, time and steps to the target and the end-of-run scores;
    then the verdict per candidate. `result`: the result file's `results`."""
    target = result["target"]["zeroshot_top1"]
    lines = [f"| candidate | seed | steps | train s | samples/s | to {target} zero-shot: steps "
             "| train s | / old default's train s | final zero-shot top-1 | i2t R@5 | t2i R@5 "
             "| load 1m start / end |", "|---" * 12 + "|"]
    order = list(result["candidates"])
    for row in sorted(result["runs"], key=lambda r: (order.index(r["candidate"]), r["seed"])):
        hit = reached(row, target)
        entry = result["summary"][row["candidate"]][str(row["seed"])]
        ratio = entry.get("to_target_over_old_default_train_s")
        to_steps, to_s = (hit["step"], f"{hit['train_s']:.0f}") if hit else ("not reached", "-")
        stopped = f" (stopped: {row['stopped']})" if row.get("stopped") else ""
        lines.append(
            f"| {row['candidate']} | {row['seed']} | {row['steps']}{stopped} | "
            f"{row['train_s']:.0f} | "
            f"{row['samples_per_s'] or 0:.0f} | {to_steps} | {to_s} | "
            f"{'-' if ratio is None else f'{ratio:.2f}'} | "
            f"{row['final']['zeroshot_top1']:.3f} | {row['final']['i2t_R@5']:.3f} | "
            f"{row['final']['t2i_R@5']:.3f} | {row['load_1m_start']} / {row['load_1m_end']} |")
    lines += ["", "| candidate | overrides of the old default | on every seed: target within "
              "half the old default's training time, i2t R@5 >= 0.95 at the end |", "|---|---|---|"]
    for name, seeds in result["summary"].items():
        overrides = ", ".join(f"{k}={v}" for k, v in result["candidates"][name].items()) or "-"
        lines.append(f"| {name} | {overrides} | {'yes' if seeds['meets'] else 'no'} |")
    return lines


def main(argv: Sequence[str] | None = None) -> None:
    args = _parse(argv)
    if args.command == "run":
        run(args)
    elif args.command == "one":
        one(args)
    else:
        print("\n".join(tables(json.loads(args.result.read_text())["results"])))


if __name__ == "__main__":
    main()
