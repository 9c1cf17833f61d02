"""Kill `dvc repro` at seeded random moments of every stage, then let it finish: does it recover
exactly, with nothing for a person to clean up?

    python benchmarks/bench_kill.py --seed 0 --extra-kills 4 \
        --out benchmarks/results/kill_recovery.json

Two fresh checkouts of the project with the tests' tiny world (`harness/dvc_workspace.py`: 48
synthetic images, a one-layer model, a few training steps, the whole pipeline from metadata to
register): 1. the reference: `dvc repro` without interruption, timing each stage from its "Running
   stage" line to the next;
2. the killed one: `dvc repro` started again and again, each run killed with SIGKILL - the whole
   process group at once (dvc, the stage's python and any worker it forked), as an OOM kill of the
   job or a lost machine ends it - at a random moment of the next stage on the plan (a uniform
   fraction, 5-80 %, of its reference duration after its "Running stage" line). The plan has one
   kill per stage, in pipeline order, then `--extra-kills` more at stages drawn in proportion to
   their duration; the seed fixes it. A planned kill whose stage is already done (an earlier kill
   landed a stage later) is skipped. After each kill the checkout is inspected (what was left
   behind); then a last `dvc repro` runs to the end, with nothing cleaned by hand.

Checked at the end: `metrics/eval.json` equals the reference's exactly; `dvc status` reports
nothing to do; no writer's temp file is left; no MLflow run is RUNNING; every registry alias
points at a complete version (its gate decision and tags recorded), so a version half-registered
by a killed attempt can never be picked. Writes one JSON (`--out`) with the plan, what each kill
left behind and the checks; exits 1 when a check fails.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import signal
import sqlite3
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

PROJECT_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(PROJECT_ROOT))

import record  # noqa: E402 - benchmarks/record.py, beside this script

from harness.dvc_workspace import make_workspace, tool_env  # noqa: E402  (the tests' tiny world)

STAGE_LINE = re.compile(r"^Running stage '([^']+)':")
TEMP_FILE = re.compile(r"^\..+\.tmp-\d+-[0-9a-f]+")  # clipms.utils.atomic's temp names
REPRO_TIMEOUT_S = 3600.0


@dataclass
class Repro:
    """One `dvc repro`: its exit code, when each stage started (seconds from the start), and
    the kill, if it was killed."""

    returncode: int | None
    seconds: float
    stages: list[tuple[str, float]] = field(default_factory=list)
    killed_in: str | None = None  # the stage running when the kill landed
    killed_after_s: float | None = None  # seconds after that stage's "Running stage" line
    tail: str = ""


def repro_env() -> dict[str, str]:
    """The tests' tool environment, with nothing of this shell's tracking or import path: each
    checkout runs its own code against its own `mlflow.db`."""
    env = tool_env()
    for name in ("MLFLOW_TRACKING_URI", "MLFLOW_REGISTRY_URI", "PYTHONPATH", "PREFECT_API_URL"):
        env.pop(name, None)
    # dvc and the stages write to a pipe here: unbuffered, each "Running stage" line arrives
    # when it is written, not when a buffer fills (a kill timed from it would land late)
    env["PYTHONUNBUFFERED"] = "1"
    return env


def run_repro(checkout: Path, kill: tuple[str, float] | None = None) -> Repro:
    """`dvc repro` in `checkout`; with `kill` = (stage, delay), SIGKILL its process group
    `delay` seconds after `stage` starts (if it is still running then)."""
    started = time.monotonic()
    proc = subprocess.Popen(["dvc", "repro"], cwd=checkout, env=repro_env(), text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True)
    result = Repro(None, 0.0)
    lines: list[str] = []
    timer: threading.Timer | None = None

    def kill_now() -> None:
        if proc.poll() is None:
            result.killed_in, since = result.stages[-1] if result.stages else (None, started)
            result.killed_after_s = round(time.monotonic() - started - since, 2)
            os.killpg(proc.pid, signal.SIGKILL)

    assert proc.stdout is not None
    for line in proc.stdout:
        lines.append(line)
        match = STAGE_LINE.match(line)
        if match:
            result.stages.append((match[1], round(time.monotonic() - started, 2)))
            if kill is not None and match[1] == kill[0] and timer is None:
                timer = threading.Timer(kill[1], kill_now)
                timer.start()
        if time.monotonic() - started > REPRO_TIMEOUT_S:
            os.killpg(proc.pid, signal.SIGKILL)
    result.returncode = proc.wait()
    if timer is not None:
        timer.cancel()
    result.seconds = round(time.monotonic() - started, 2)
    result.tail = "".join(lines[-15:])
    return result


def stage_durations(repro: Repro) -> dict[str, float]:
    """Each stage's time in an uninterrupted run: from its line to the next (or the end), so
    DVC's own work after the command (hashing, caching, dvc.lock) is part of it."""
    ends = [at for _, at in repro.stages[1:]] + [repro.seconds]
    return {name: round(end - at, 2) for (name, at), end in zip(repro.stages, ends, strict=True)}


def kill_plan(durations: dict[str, float], extra: int, seed: int) -> list[tuple[str, float]]:
    """(stage, seconds after its start): one per stage in pipeline order, then `extra` more at
    stages drawn by duration, each at a uniform fraction (5-80 %) of the stage's duration (a
    stage may run faster than in the reference: later fractions would often miss it)."""
    rng = random.Random(seed)
    order = list(durations)
    stages = order + rng.choices(order, weights=[durations[s] for s in order], k=extra)
    stages.sort(key=order.index)  # the pipeline only moves forward
    return [(stage, round(rng.uniform(0.05, 0.8) * durations[stage], 2)) for stage in stages]


# ---------------------------------------------------------------- what a checkout holds


def temp_files(checkout: Path) -> list[str]:
    """Writers' temp files (`.<name>.tmp-<pid>-<hex>`) under the pipeline's folders."""
    found = []
    for folder in ("data", "models", "metrics", "plots"):
        for path in (checkout / folder).rglob(".*"):
            if TEMP_FILE.match(path.name):
                found.append(str(path.relative_to(checkout)))
    return sorted(found)


def dvc_status(checkout: Path) -> dict[str, Any]:
    proc = subprocess.run(["dvc", "status", "--json"], cwd=checkout, env=repro_env(),
                          capture_output=True, text=True, timeout=600)
    try:
        return json.loads(proc.stdout or "{}")
    except json.JSONDecodeError:
        return {"unreadable": proc.stdout[-2000:] + proc.stderr[-2000:]}


def dvc_rwlock(checkout: Path) -> dict[str, int] | None:
    """DVC's read/write lock of the outputs in use, summarised: how many paths each mode holds
    and by how many processes, how many of them alive (entries of a dead pid are DVC's to drop:
    it removes them, with a warning, when it next runs). The repo lock (`.dvc/tmp/lock`) is an
    flock, released by the kernel when its holder dies, so its file says nothing."""
    rwlock = checkout / ".dvc" / "tmp" / "rwlock"
    if not rwlock.exists():
        return None
    held = json.loads(rwlock.read_text() or "{}")
    holders = {entry["pid"] for mode in ("read", "write")
               for entries in held.get(mode, {}).values()
               for entry in (entries if isinstance(entries, list) else [entries])}
    return {"read_paths": len(held.get("read", {})), "write_paths": len(held.get("write", {})),
            "holders": len(holders), "holders_alive": sum(map(alive, holders))}


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def query(checkout: Path, sql: str) -> list[tuple]:
    db = checkout / "mlflow.db"
    if not db.exists():
        return []
    with sqlite3.connect(f"file:{db}?mode=ro", uri=True) as connection:
        try:
            return connection.execute(sql).fetchall()
        except sqlite3.OperationalError:  # the schema is not there yet (a killed first start)
            return []


def mlflow_runs(checkout: Path) -> dict[str, int]:
    """MLflow runs of the checkout's store by status."""
    counts: dict[str, int] = {}
    for (status,) in query(checkout, "SELECT status FROM runs"):
        counts[status] = counts.get(status, 0) + 1
    return counts


def registry(checkout: Path) -> list[dict[str, Any]]:
    """Every registered version: its aliases, whether the gate's decision was recorded (its
    description) and whether it has the gate's metric tag."""
    aliases: dict[str, list[str]] = {}
    for alias, version in query(checkout, "SELECT alias, version FROM registered_model_aliases"):
        aliases.setdefault(str(version), []).append(alias)
    tags: dict[str, set[str]] = {}
    for version, key in query(checkout, "SELECT version, key FROM model_version_tags"):
        tags.setdefault(str(version), set()).add(key)
    out = []
    for version, description in query(checkout, "SELECT version, description FROM "
                                                "model_versions ORDER BY version"):
        decided = (description or "").split(" ", 1)[0]
        out.append({"version": int(version), "aliases": sorted(aliases.get(str(version), [])),
                    "decided": decided if decided in ("champion", "challenger") else None,
                    "metric_tag": any(k.startswith("metric.") for k in tags.get(str(version),
                                                                              ()))})
    return out


def left_behind(checkout: Path) -> dict[str, Any]:
    """What a killed run left: stages DVC would rerun, locks, temp files, runs, versions."""
    status = dvc_status(checkout)
    return {"stages_to_rerun": sorted(status), "dvc_rwlock": dvc_rwlock(checkout),
            "temp_files": temp_files(checkout), "mlflow_runs": mlflow_runs(checkout),
            "registry": registry(checkout),
            "checkpoints": sorted(p.name for p in (checkout / "models" / "checkpoints").glob("*"))
            if (checkout / "models" / "checkpoints").is_dir() else []}


def metrics(checkout: Path) -> dict[str, Any]:
    return {path.name: json.loads(path.read_text())
            for path in sorted((checkout / "metrics").glob("*.json"))}


def differing_keys(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    return sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))


# ---------------------------------------------------------------- the benchmark


def checks(reference: Path, killed: Path, final: Repro) -> dict[str, Any]:
    ref, got = metrics(reference), metrics(killed)
    versions = registry(killed)
    picked = [v for v in versions if v["aliases"]]
    return {
        "final_repro_exit": final.returncode,
        "eval_json_equal": ref.get("eval.json") == got.get("eval.json"),
        "eval_json_keys": len(ref.get("eval.json", {})),
        "eval_json_differing_keys": differing_keys(ref.get("eval.json", {}),
                                                   got.get("eval.json", {})),
        "other_metrics_differing_keys": {name: differing_keys(ref[name], got.get(name, {}))
                                         for name in ref if name != "eval.json"},
        "dvc_status": dvc_status(killed),
        "temp_files": temp_files(killed),
        "mlflow_runs": mlflow_runs(killed),
        "reference_mlflow_runs": mlflow_runs(reference),
        "registry": versions,
        "aliases_on_complete_versions": all(
            v["decided"] is not None and v["metric_tag"] and v["decided"] in v["aliases"]
            for v in picked) and bool(picked),
    }


def passed(result: dict[str, Any]) -> bool:
    return (result["final_repro_exit"] == 0 and result["eval_json_equal"]
            and result["dvc_status"] == {} and not result["temp_files"]
            and "RUNNING" not in result["mlflow_runs"] and result["aliases_on_complete_versions"])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--extra-kills", type=int, default=4,
                        help="kills beyond one per stage, at stages drawn by duration")
    parser.add_argument("--stages", nargs="*", help="kill only in these stages (default: all)")
    parser.add_argument("--out", type=Path, default=PROJECT_ROOT / "benchmarks" / "results" /
                        "kill_recovery.json")
    parser.add_argument("--workdir", type=Path, help="where the two checkouts go (default: a "
                        "temporary folder, removed afterwards)")
    args = parser.parse_args(argv)

    if shutil.which("dvc", path=repro_env()["PATH"]) is None:
        print("bench_kill: no `dvc` on PATH: run it with the project's environment "
              "(source .venv/bin/activate)", file=sys.stderr)
        return 1
    recording = record.start("kill_recovery", sys.argv if argv is None else
                             ["benchmarks/bench_kill.py", *argv])
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="clipms-kill-"))
    started = time.time()
    reference = make_workspace(workdir / "reference")
    ref_run = run_repro(reference)
    if ref_run.returncode != 0:
        print(f"the reference run failed:\n{ref_run.tail}", file=sys.stderr)
        return 1
    durations = stage_durations(ref_run)
    chosen = {s: d for s, d in durations.items() if not args.stages or s in args.stages}
    plan = kill_plan(chosen, args.extra_kills, args.seed)

    killed = make_workspace(workdir / "killed")
    kills = []
    for stage, delay in plan:
        if stage not in dvc_status(killed):  # an earlier kill landed past it: it is done
            kills.append({"planned": {"stage": stage, "after_s": delay}, "skipped": "done"})
            continue
        run = run_repro(killed, kill=(stage, delay))
        kills.append({"planned": {"stage": stage, "after_s": delay},
                      "killed_in": run.killed_in, "killed_after_s": run.killed_after_s,
                      "exit": run.returncode, "stages_run": [s for s, _ in run.stages],
                      "seconds": run.seconds,
                      "left_behind": left_behind(killed) if run.killed_in else None})
        print(f"attempt {len(kills)}/{len(plan)}: planned {stage} +{delay:.1f} s -> "
              f"{'killed in ' + str(run.killed_in) if run.killed_in else 'finished first'} "
              f"(exit {run.returncode})", flush=True)
    final = run_repro(killed)
    result = {
        "seed": args.seed, "extra_kills": args.extra_kills,
        "world": "harness/dvc_workspace.py TINY_PARAMS",
        "reference": {"seconds": ref_run.seconds, "stage_seconds": durations},
        "plan": [{"stage": s, "after_s": d} for s, d in plan],
        "kills": kills,
        "stages_killed": sorted({k["killed_in"] for k in kills if k.get("killed_in")}),
        "final": {"exit": final.returncode, "seconds": final.seconds,
                  "stages_run": [s for s, _ in final.stages],
                  "tail": final.tail if final.returncode else None},
        "checks": checks(reference, killed, final),
        "wall_s": round(time.time() - started, 1),
    }
    result["passed"] = passed(result["checks"])
    recording.write(result, args.out)
    print(json.dumps({k: result[k] for k in ("passed", "stages_killed", "wall_s")}))
    if args.workdir is None:
        shutil.rmtree(workdir, ignore_errors=True)
    return 0 if result["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
