"""The MSCOCO dress rehearsal: every pipeline stage on an MSCOCO-sized synthetic world, measured.

    nice -n 5 python benchmarks/rehearsal.py --images 123287     # MSCOCO: 118,287 + 5,000 val
    python benchmarks/rehearsal.py --images 2000                 # the same command, smaller

Builds a scratch clone of this checkout (the files git would see) in `--workdir`, applies
`profiles/mscoco-rehearsal.yaml` (MSCOCO-length captions, 256-px images fetched over HTTP, the
MSCOCO profiles' 256-px download, a bounded training run) plus the size (`--images`, and
`--val-images`, by default MSCOCO's 5,000 of 123,287 in proportion), starts a loopback HTTP server
of the world's images (`python -m http.server` on 127.0.0.1: the internet's part, measured apart),
and runs `dvc repro --single-item <stage>` for every stage of dvc.yaml in order. Each stage's
command is wrapped in `benchmarks/stage_clock.py` in the clone's dvc.yaml, so the figures of the
stage itself and of the whole `dvc repro` (DVC's hashing and caching included) are both kept:
wall time, CPU time, peak RSS (largest process; the tree summed, sampled), bytes written, the size
of the stage's outputs, and items per second (the items each stage counts in its metrics).

Writes one JSON (`--out`, default benchmarks/results/rehearsal-<images>.json) with the command,
commit, machine, load before and after each stage, the world actually generated (caption-length
statistics included) and the per-stage figures; the clone is deleted unless `--keep` (the search
benchmark, benchmarks/rehearsal_search.py, serves its index).
`--until STAGE` stops after that stage. `--resume` finishes a run that stopped (a failed stage, a
timeout, `--until`) in its kept clone (`--workdir`, `--keep`): the clone's code, params and world
are used as they are, a stage whose figures are in `--out` and whose dvc.lock entry is up to date
is skipped with its figures kept, and from the first stage that is not, every stage runs again
(`dvc repro --single-item --force`, measured the same way); the figures are merged into `--out`.
`python benchmarks/rehearsal.py table A.json B.json ...` prints the tables of docs/scaling.md.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks import record  # noqa: E402  (after the path is set)
from benchmarks.stage_clock import measure  # noqa: E402
from harness import processes, project_copy  # noqa: E402

PROFILE = ROOT / "profiles" / "mscoco-rehearsal.yaml"
MSCOCO_IMAGES, MSCOCO_VAL = 123_287, 5_000  # 2017 train + the Karpathy test split's size
BIN = Path(sys.executable).parent


# ------------------------------------------------------------------------------------ the clone
def default_val_images(images: int) -> int:
    """MSCOCO's val share (5,000 of 123,287), at least one image."""
    return max(1, round(images * MSCOCO_VAL / MSCOCO_IMAGES))


def overrides(args: argparse.Namespace, port: int) -> dict[str, Any]:
    """The profile, then the size and the server, then `--set` (last wins)."""
    found = dict(yaml.safe_load(args.profile.read_text()) or {})
    found.update({"metadata.num_images": args.images,
                  "metadata.synthetic_val_images": args.val_images,
                  "metadata.synthetic_url": f"http://127.0.0.1:{port}/",
                  "train.max_steps": args.train_steps})
    for item in args.set:
        key, sep, value = item.partition("=")
        if not sep:
            raise SystemExit(f"--set {item!r}: expected KEY=VALUE")
        found[key] = yaml.safe_load(value)
    return found


def wrap_stage_commands(dvc_yaml: Path, clock_dir: Path) -> list[str]:
    """Put benchmarks/stage_clock.py in front of every stage's command; return the stages in
    dvc.yaml's order (the pipeline's)."""
    spec = yaml.safe_load(dvc_yaml.read_text())
    for name, stage in spec["stages"].items():
        clock = ["python", "benchmarks/stage_clock.py", "--out", str(clock_dir / f"{name}.json"),
                 "--"]
        stage["cmd"] = shlex.join(clock) + " " + stage["cmd"]
    dvc_yaml.write_text(yaml.safe_dump(spec, sort_keys=False))
    return list(spec["stages"])


def stage_outputs(dvc_yaml: Path, stage: str) -> list[str]:
    """The paths a stage declares in dvc.yaml (outs, metrics, plots)."""
    spec = yaml.safe_load(dvc_yaml.read_text())["stages"][stage]
    paths = []
    for kind in ("outs", "metrics", "plots"):
        for entry in spec.get(kind, []):
            paths.append(next(iter(entry)) if isinstance(entry, dict) else entry)
    return paths


def tree_bytes(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    total = 0
    for folder, _, files in os.walk(path):
        for name in files:
            try:
                total += (Path(folder) / name).stat().st_size
            except FileNotFoundError:
                continue
    return total


def stage_env(clone: Path) -> dict[str, str]:
    """The clone's code first (not the checkout's or the venv's editable install), this venv's
    tools on PATH, analytics off, MLflow in the clone's own SQLite store."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_")}
    env.update(PYTHONPATH=str(clone), PATH=f"{BIN}{os.pathsep}{env.get('PATH', '')}",
               DVC_NO_ANALYTICS="1", NO_ALBUMENTATIONS_UPDATE="1", WANDB_MODE="disabled",
               GLOG_v=env.get("GLOG_v", "3"))
    return env


# ------------------------------------------------------------------------------------ the items
def read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.is_file() else {}


def stage_items(clone: Path, stage: str) -> dict[str, Any]:
    """What a stage worked through, from its own metrics: {"items": n, "unit": ...} (plus
    detail), or {} for a stage that handles one thing (a model)."""
    metrics = clone / "metrics"
    if stage == "metadata":
        import pyarrow.parquet as pq

        meta = pq.read_metadata(clone / "data" / "metadata.parquet")
        images = yaml.safe_load((clone / "params.yaml").read_text())["metadata"]["num_images"]
        return {"items": images, "unit": "images", "caption_rows": meta.num_rows}
    if stage == "dedupe":
        found = read_json(metrics / "dedupe.json")
        return {"items": found.get("rows_in"), "unit": "caption rows",
                "images": found.get("images_out"), "captions_kept": found.get("captions_kept")}
    if stage == "download":
        return {"items": read_json(metrics / "download.json").get("successes"), "unit": "images"}
    if stage == "shard":
        return {"items": read_json(metrics / "shard.json").get("samples_out"), "unit": "images"}
    if stage == "tokenizer":
        return {"items": train_captions(clone), "unit": "train captions"}
    if stage == "train":
        found = read_json(metrics / "train.json")
        steps, batch = found.get("steps"), found.get("global_batch_size")
        return {"items": int(steps * batch) if steps and batch else None, "unit": "samples",
                "steps": steps, "samples_per_s_in_loop": found.get("samples_per_s")}
    if stage == "evaluate":
        found = read_json(metrics / "eval.json")
        return {"items": found.get("num_images"), "unit": "val images",
                "captions": found.get("num_captions")}
    if stage == "index":
        return {"items": read_json(metrics / "index.json").get("rows"), "unit": "images"}
    return {}


def train_captions(clone: Path) -> int:
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    images = pq.read_table(clone / "data" / "images.parquet", columns=["captions", "split"])
    train = images.filter(pc.equal(images["split"], "train"))
    return int(pc.sum(pc.list_value_length(train["captions"])).as_py())


def world_summary(clone: Path) -> dict[str, Any]:
    """The generated world as the stages saw it: caption rows, caption lengths, the splits."""
    import numpy as np
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    table = pq.read_table(clone / "data" / "metadata.parquet", columns=["URL", "TEXT", "SPLIT"])
    words = np.asarray(pc.list_value_length(pc.utf8_split_whitespace(table["TEXT"])))
    dedupe = read_json(clone / "metrics" / "dedupe.json")
    return {"caption_rows": table.num_rows,
            "images": pc.count_distinct(table["URL"]).as_py(),
            "caption_words": {"mean": round(float(words.mean()), 3),
                              "median": float(np.median(words)),
                              "p95": float(np.percentile(words, 95)),
                              "max": int(words.max()), "min": int(words.min()),
                              "share_8_to_15": round(float(np.mean((words >= 8) &
                                                                    (words <= 15))), 4)},
            "train_images": dedupe.get("train_images"), "val_images": dedupe.get("val_images"),
            "captions_after_dedupe": dedupe.get("captions_kept"),
            "duplicates_removed": dedupe.get("removed")}


# ------------------------------------------------------------------------------------ the run
def machine() -> dict[str, Any]:
    model = next((line.split(":", 1)[1].strip() for line in
                  Path("/proc/cpuinfo").read_text().splitlines()
                  if line.startswith("model name")), "unknown")
    mem_kb = next(int(line.split()[1]) for line in Path("/proc/meminfo").read_text().splitlines()
                  if line.startswith("MemTotal"))
    return {"cpu": model, "cores": os.cpu_count(), "usable_cores": len(os.sched_getaffinity(0)),
            "memory_gb": round(mem_kb / 2**20, 1), "nice": os.nice(0),
            "shared": "other engineers' tests and benchmarks ran on this machine too"}


def load() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def run_stage(clone: Path, stage: str, clock_dir: Path, logs: Path,
              server: subprocess.Popen[bytes], force: bool = False) -> dict[str, Any]:
    """`dvc repro --single-item <stage>` measured, with the stage command's own figures;
    `force`: run it even if its dvc.lock entry is up to date."""
    import psutil

    server_cpu = sum(psutil.Process(server.pid).cpu_times()[:2])
    entry: dict[str, Any] = {"stage": stage, "load_before": load()}
    (clock_dir / f"{stage}.json").unlink(missing_ok=True)  # a figure of an earlier run is not this
    repro = [str(BIN / "dvc"), "repro", "--single-item", *(["--force"] if force else []), stage]
    with open(logs / f"{stage}.log", "wb") as log:
        cost = measure(repro, cwd=clone,
                       env=stage_env(clone), stdout=log, stderr=subprocess.STDOUT,
                       start_new_session=True)  # interrupted: the whole stage is killed
    entry.update(load_after=load(), dvc_repro=cost.as_dict(),
                 command=read_json(clock_dir / f"{stage}.json"),
                 image_server_cpu_s=round(sum(psutil.Process(server.pid).cpu_times()[:2])
                                          - server_cpu, 2))
    outputs = stage_outputs(clone / "dvc.yaml", stage)
    entry["outputs_mb"] = round(sum(tree_bytes(clone / p) for p in outputs
                                    if (clone / p).exists()) / 2**20, 2)
    if cost.exit_code == 0:
        entry.update(stage_items(clone, stage))
        seconds = entry["command"].get("wall_s") or cost.wall_s
        if entry.get("items"):
            entry["items_per_s"] = round(entry["items"] / seconds, 2)
            entry["cpu_ms_per_item"] = round(
                entry["command"].get("cpu_s", cost.cpu_s) * 1000 / entry["items"], 4)
    return entry


def prepare(args: argparse.Namespace, clone: Path, result: dict[str, Any]) -> tuple[list[str], int]:
    """A new clone with the profile, the size and a free port for its image server applied, every
    stage's command wrapped in the clock; its stages in order and the port."""
    project_copy.copy_project(ROOT, clone)
    port = processes.free_port()
    applied = overrides(args, port)
    project_copy.set_params(clone / "params.yaml", applied)
    stages = wrap_stage_commands(clone / "dvc.yaml", args.workdir / "clock")
    project_copy.commit_all(clone, "MSCOCO rehearsal")
    result["params"] = applied
    return stages, port


def reopen(clone: Path) -> tuple[list[str], int, set[str]]:
    """A kept clone as it is: its stages in order (already wrapped), the port its world's URLs
    name (a new port would change `metadata`'s params) and the stages DVC finds out of date."""
    stages = list(yaml.safe_load((clone / "dvc.yaml").read_text())["stages"])
    url = yaml.safe_load((clone / "params.yaml").read_text())["metadata"]["synthetic_url"]
    port = int(url.rstrip("/").rsplit(":", 1)[1])
    status = subprocess.run([str(BIN / "dvc"), "status", "--json"], cwd=clone, env=stage_env(clone),
                            capture_output=True, text=True, check=True)
    return stages, port, set(json.loads(status.stdout or "{}"))


def stages_to_skip(stages: list[str], recorded: list[dict[str, Any]], stale: set[str]) -> set[str]:
    """The leading stages that need not run again: figures recorded, exit 0, dvc.lock up to
    date. The first that fails any of these and every stage after it run again."""
    done = {s["stage"] for s in recorded if s["dvc_repro"]["exit_code"] == 0}
    skip: set[str] = set()
    for stage in stages:
        if stage not in done or stage in stale:
            break
        skip.add(stage)
    return skip


def rehearse(args: argparse.Namespace, clone: Path, result: dict[str, Any],
             recording: record.Recording) -> bool:
    """Build (or, resuming, reopen) the clone, serve its images, run every stage; False when a
    stage failed."""
    logs = args.workdir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    if args.resume:
        stages, port, stale = reopen(clone)
        skip = stages_to_skip(stages, result["stages"], stale)
        result["stages"] = [s for s in result["stages"] if s["stage"] in skip]
    else:
        (stages, port), skip = prepare(args, clone, result), set()
    if args.until:
        if args.until not in stages:
            raise SystemExit(f"--until {args.until!r}: not a stage of the clone's dvc.yaml "
                             f"({', '.join(stages)})")
        stages = stages[:stages.index(args.until) + 1]
    (clone / "data" / "synthetic").mkdir(parents=True, exist_ok=True)
    server = processes.spawn([str(BIN / "python"), "-m", "http.server", str(port), "--bind",
                              "127.0.0.1", "--directory", str(clone / "data" / "synthetic")],
                             None)
    try:
        processes.wait_until(processes.port_open(port), server, "image server", None, 30)
        for stage in [s for s in stages if s not in skip]:
            entry = run_stage(clone, stage, args.workdir / "clock", logs, server,
                              force=args.resume)
            result["stages"].append(entry)
            print(progress_line(entry), flush=True)
            if stage == "dedupe" and entry["dvc_repro"]["exit_code"] == 0:
                result["world"] = world_summary(clone)
            recording.write(result, args.out)  # what ran so far, should the run be stopped
            if entry["dvc_repro"]["exit_code"] != 0:
                result["failed"] = {"stage": stage, "log_tail": processes.tail(
                    logs / f"{stage}.log", 4000)}
                return False
    finally:
        processes.stop(server)
    result["disk_mb"] = {"clone": round(tree_bytes(clone) / 2**20, 1),
                         "dvc_cache": round(tree_bytes(clone / ".dvc" / "cache") / 2**20, 1)}
    return True


def progress_line(entry: dict[str, Any]) -> str:
    cost, own = entry["dvc_repro"], entry["command"]
    rate = f", {entry['items_per_s']:,.1f} {entry.get('unit', 'items')}/s" \
        if entry.get("items_per_s") else ""
    return (f"{entry['stage']:>9}: exit {cost['exit_code']}, {cost['wall_s']:,.1f} s wall "
            f"({own.get('wall_s', float('nan')):,.1f} s the command), {cost['cpu_s']:,.1f} CPU-s, "
            f"peak RSS {cost['peak_rss_mb']:,.0f} MB (tree {cost['peak_tree_rss_mb']:,.0f} MB), "
            f"{cost['written_mb']:,.0f} MB written{rate}, load {entry['load_after'][0]}")


# ------------------------------------------------------------------------------------ tables
def table(paths: list[Path]) -> str:
    """Markdown tables of rehearsal JSONs (smallest first): every stage at every size, then for
    each size and the next the growth of CPU per item and the peak memory projected linearly
    from the two to 5x MSCOCO (docs/scaling.md)."""
    runs = sorted((json.loads(p.read_text())["results"] for p in paths),
                  key=lambda r: r["images"])
    lines = ["| stage | images | wall s (command / dvc repro) | CPU-s | CPU-ms per item | "
             "items/s | peak RSS MB (largest / tree) | written MB | outputs MB |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    # the pipeline's order, from the run that got furthest (a stopped run has fewer stages)
    stages = [s["stage"] for s in max(runs, key=lambda r: len(r["stages"]))["stages"]]
    for stage in stages:
        for run in runs:
            rec = next((s for s in run["stages"] if s["stage"] == stage), None)
            if rec is None:
                continue
            own, whole = rec["command"], rec["dvc_repro"]
            lines.append(
                f"| `{stage}` | {run['images']:,} | {own['wall_s']:,.1f} / {whole['wall_s']:,.1f}"
                f" | {own['cpu_s']:,.1f} | {_num(rec.get('cpu_ms_per_item'))} | "
                f"{_num(rec.get('items_per_s'))} | {own['peak_rss_mb']:,.0f} / "
                f"{whole['peak_tree_rss_mb']:,.0f} | {whole['written_mb']:,.0f} | "
                f"{rec['outputs_mb']:,.0f} |")
    for mid, big in zip(runs, runs[1:], strict=False):  # each size against the next
        lines += ["", growth_table(mid, big, stages)]
    return "\n".join(lines)


def growth_table(mid: dict[str, Any], big: dict[str, Any], stages: list[str]) -> str:
    scale = 5 * MSCOCO_IMAGES  # the size a 24 GB machine must still hold
    lines = [f"| stage | CPU-ms per item at {mid['images']:,} / {big['images']:,} | ratio | "
             f"peak tree RSS MB at {mid['images']:,} / {big['images']:,} | projected at "
             f"{scale:,} (5x MSCOCO, linear) |", "|---|---:|---:|---:|---:|"]
    for stage in [s for s in stages if _ran(mid, s) and _ran(big, s)]:
        a, b = (next(s for s in r["stages"] if s["stage"] == stage) for r in (mid, big))
        per = (a.get("cpu_ms_per_item"), b.get("cpu_ms_per_item"))
        ratio = f"{per[1] / per[0]:.2f}x" if all(per) else "-"
        rss = (a["dvc_repro"]["peak_tree_rss_mb"], b["dvc_repro"]["peak_tree_rss_mb"])
        slope = (rss[1] - rss[0]) / (big["images"] - mid["images"])
        projected = rss[1] + max(slope, 0.0) * (scale - big["images"])
        lines.append(f"| `{stage}` | {_num(per[0])} / {_num(per[1])} | {ratio} | "
                     f"{rss[0]:,.0f} / {rss[1]:,.0f} | {projected:,.0f} |")
    return "\n".join(lines)


def _ran(run: dict[str, Any], stage: str) -> bool:
    return any(s["stage"] == stage and s["dvc_repro"]["exit_code"] == 0 for s in run["stages"])


def _num(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:,.0f}" if value >= 100 else f"{value:,.2f}"


def shown_argv(argv: list[str]) -> list[str]:
    """The command as recorded: this script, the scratch folder as WORKDIR."""
    return [str(Path(__file__).relative_to(ROOT)),
            *record.with_placeholders(argv, {"--workdir": "WORKDIR", "--out": "OUT"})]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--images", type=int, default=MSCOCO_IMAGES, help="train + val images")
    p.add_argument("--val-images", type=int, default=None,
                   help="val images (default: 5,000 / 123,287 of --images)")
    p.add_argument("--train-steps", type=int, default=300, help="train.max_steps")
    p.add_argument("--profile", type=Path, default=PROFILE)
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="one more params override, as `dvc exp run -S` (after the profile)")
    p.add_argument("--workdir", type=Path, default=None,
                   help="where the clone and logs go (default: a new temporary folder)")
    p.add_argument("--keep", action="store_true", help="keep the clone (default: delete it)")
    p.add_argument("--out", type=Path, default=None,
                   help="JSON figures (default: benchmarks/results/rehearsal-<images>.json)")
    p.add_argument("--until", metavar="STAGE", default=None,
                   help="stop after this stage (default: run to the last)")
    p.add_argument("--resume", action="store_true",
                   help="finish the run recorded in --out in its kept clone in --workdir: "
                   "skip the stages recorded and up to date in dvc.lock, run the rest, merge "
                   "(the clone is kept)")
    args = p.parse_args(argv)
    if args.resume and args.workdir is None:
        p.error("--resume needs the --workdir of the run to finish")
    args.val_images = args.val_images or default_val_images(args.images)
    args.out = args.out or ROOT / "benchmarks" / "results" / f"rehearsal-{args.images}.json"
    args.workdir = args.workdir or Path(tempfile.mkdtemp(prefix="clipms-rehearsal-"))
    return args


def fresh(args: argparse.Namespace, clone: Path) -> dict[str, Any]:
    if clone.exists():
        raise SystemExit(f"{clone} exists: give another --workdir, remove it, or --resume")
    clone.mkdir(parents=True)
    return {"machine": machine(), "images": args.images, "val_images": args.val_images,
            "train_steps": args.train_steps, "stages": []}


def resumed(args: argparse.Namespace, clone: Path) -> dict[str, Any]:
    """The recorded run to finish, its envelope kept as an earlier part (command, commit,
    times, load, wall) so that the merged record says which stages ran when."""
    if not (clone / "dvc.yaml").is_file() or not args.out.is_file():
        raise SystemExit(f"--resume: needs the kept clone {clone} and the run's figures "
                         f"{args.out}; one is missing")
    earlier = json.loads(args.out.read_text())
    result = earlier["results"]
    if result["images"] != args.images:
        raise SystemExit(f"--resume: {args.out} records {result['images']:,} images, "
                         f"not --images {args.images:,}")
    parts = result.get("earlier_parts", [])
    ran_before = {stage for part in parts for stage in part["stages"]}
    part = {**earlier["meta"],
            "wall_s": round(result.get("wall_s", 0.0) - sum(p["wall_s"] for p in parts), 1),
            "stages": [s["stage"] for s in result["stages"] if s["stage"] not in ran_before]}
    result["earlier_parts"] = [*parts, part]
    result.pop("failed", None)
    return result


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["table"]:  # rehearsal.py table A.json B.json ...: the docs' tables
        print(table([Path(p) for p in argv[1:]]))
        return 0
    args = parse_args(argv)
    # SIGTERM (a timeout, a scheduler) ends the run like Ctrl-C: the stage and the image server
    # are stopped and the figures so far written.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    clone = args.workdir / "clone"
    recording = record.start(f"rehearsal-{args.images}", shown_argv(argv))
    result = resumed(args, clone) if args.resume else fresh(args, clone)
    started, ok = time.perf_counter(), False
    try:
        ok = rehearse(args, clone, result, recording)
    finally:
        result["wall_s"] = round(time.perf_counter() - started, 1)
        if args.resume:  # the whole rehearsal's: the earlier parts' and this one's
            result["wall_s"] += sum(part["wall_s"] for part in result["earlier_parts"])
        recording.write(result, args.out)
        if not (args.keep or args.resume):  # a clone kept once stays kept
            shutil.rmtree(clone, ignore_errors=True)
    print(f"rehearsal: {'done' if ok else 'FAILED at ' + result['failed']['stage']} in "
          f"{result['wall_s']:,.0f} s; figures in {args.out}"
          + (f"; the clone is kept in {clone}" if args.keep or args.resume else ""))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
