"""How a benchmark records its result: `benchmarks/results/<name>.json`, one file per benchmark.

Every result file has the same envelope, so benchmarks/RESULTS.md can say for each table what was
run, on which commit, on what machine and under what load (benchmarks/render_results.py renders
the tables from these files):

    {"benchmark": "<name>",
     "meta": {"command": "...", "commit": "1a2b3c4", "dirty": false,
              "started_utc": "...", "finished_utc": "...",
              "machine": {"cpu": "...", "simd": "avx2", "cores": 2, "memory_gb": 23.5},
              "load_avg": {"start": [1m, 5m, 15m], "end": [1m, 5m, 15m]},
              "note": "..."},
     "results": ...}

`note` comes from the environment variable CLIPMS_BENCH_NOTE (for example "shared with other
work"): a benchmark cannot tell whether the machine was shared; the load average only hints.

As a command, it records any command that prints JSON lines (`python -m benchmarks.throughput`
prints one per run):

    python benchmarks/record.py loader --repeat 2 -- python -m benchmarks.throughput loader
    --batches 30

runs the command `--repeat` times and writes the last JSON line of each run to
benchmarks/results/loader.json (`--results` for another path).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import shlex
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
NOTE_VARIABLE = "CLIPMS_BENCH_NOTE"


def default_path(name: str) -> Path:
    return RESULTS / f"{name}.json"


def utc_now() -> str:
    return dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def load_avg() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def git_state(root: Path = ROOT) -> dict[str, Any]:
    """The commit the benchmark ran on, and whether the tree had uncommitted changes to tracked
    files (results/ itself excluded: a rerun rewrites it)."""
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True,
                              check=True).stdout.strip()
    try:
        commit = git("rev-parse", "--short=7", "HEAD")
        changed = git("status", "--porcelain", "--untracked-files=no", "--", ".",
                      ":(exclude)benchmarks/results")
    except (OSError, subprocess.CalledProcessError):
        return {"commit": None, "dirty": None}
    return {"commit": commit, "dirty": bool(changed)}


# The widest vector extension first: MindSpore's CPU kernels pick their code path by it, so two
# machines with different ones train to different weights (docs/evaluation-and-export.md).
SIMD_LEVELS = ("avx512f", "avx2", "avx", "sse4_2", "asimd")


def cpu_fields() -> dict[str, str]:
    """/proc/cpuinfo's first processor block as name -> value (empty where it cannot be read)."""
    try:
        block = Path("/proc/cpuinfo").read_text().split("\n\n", 1)[0]
    except OSError:
        return {}
    pairs = (line.partition(":") for line in block.splitlines())
    return {name.strip(): value.strip() for name, _, value in pairs}


def simd(flags: str) -> str | None:
    """The widest of SIMD_LEVELS among the CPU's flags (x86 `flags`, arm `Features`)."""
    have = set(flags.split())
    return next((level for level in SIMD_LEVELS if level in have), None)


def machine() -> dict[str, Any]:
    """What the figures depend on: the CPU model and its vector extension, how many cores this
    process may use, memory."""
    fields = cpu_fields()
    cpu = fields.get("model name") or platform.processor() or platform.machine()
    memory_gb = None
    try:
        kb = next(int(line.split()[1]) for line in Path("/proc/meminfo").read_text().splitlines()
                  if line.startswith("MemTotal:"))
        memory_gb = round(kb / 2**20, 1)
    except (OSError, StopIteration):
        pass
    return {"cpu": cpu, "simd": simd(fields.get("flags") or fields.get("Features") or ""),
            "cores": len(os.sched_getaffinity(0)), "memory_gb": memory_gb}


def shown_path(arg: str) -> str:
    """A path inside the repository (or the working directory) relative to it, as a reader
    would type it there; anything else as given."""
    path = Path(arg)
    for base in (ROOT, Path.cwd()):
        if path.is_absolute() and path.is_relative_to(base):
            return str(path.relative_to(base))
    return arg


def shown_command(argv: Sequence[str]) -> str:
    """The command as a reader would type it in the repository: the interpreter as `python`, a
    console script of the environment by its name, paths inside the repository relative to it."""
    shown = [shown_path(arg) for arg in argv]
    if argv and Path(argv[0]).name.startswith("python"):
        shown[0] = "python"
    elif argv and Path(argv[0]).parent == Path(sys.executable).parent:
        shown[0] = Path(argv[0]).name  # clipms-serve
    return shlex.join(shown)


def with_placeholders(argv: Sequence[str], names: dict[str, str]) -> list[str]:
    """`argv` with the values of the options in `names` (e.g. {"--workdir": "WORKDIR"}) replaced
    by their placeholder: a scratch folder is where the reader puts theirs, not this machine's."""
    shown, hide = [], None
    for arg in argv:
        option, sep, _ = arg.partition("=")
        shown.append(hide if hide else f"{option}={names[option]}" if sep and option in names
                     else arg)
        hide = names.get(arg)
    return shown


@dataclass
class Recording:
    """Started when the benchmark starts (load and time), written when it ends."""

    name: str
    command: str
    started_utc: str = field(default_factory=utc_now)
    load_start: list[float] = field(default_factory=load_avg)
    # the tree the benchmark measures: a long one may end after the checkout moved on
    source: dict[str, Any] = field(default_factory=git_state)

    def meta(self) -> dict[str, Any]:
        meta = {"command": self.command, **self.source, "started_utc": self.started_utc,
                "finished_utc": utc_now(), "machine": machine(),
                "load_avg": {"start": self.load_start, "end": load_avg()}}
        if os.environ.get(NOTE_VARIABLE):
            meta["note"] = os.environ[NOTE_VARIABLE]
        return meta

    def write(self, results: Any, out: Path | None = None) -> Path:
        path = out or default_path(self.name)
        path.parent.mkdir(parents=True, exist_ok=True)
        record = {"benchmark": self.name, "meta": self.meta(), "results": results}
        tmp = path.with_suffix(path.suffix + ".tmp")
        tmp.write_text(json.dumps(record, indent=2) + "\n")
        tmp.replace(path)
        return path


def start(name: str, argv: Sequence[str] | None = None) -> Recording:
    """A recording of this process's own command line (`sys.argv`)."""
    return Recording(name, shown_command([sys.executable, *(argv or sys.argv)]))


def json_lines(cmd: Sequence[str], env: dict[str, str] | None = None) -> list[dict[str, Any]]:
    """Run `cmd` and return the JSON objects it printed, one per line; its other output is
    passed through to stderr. A failed command raises, naming it."""
    proc = subprocess.run(list(cmd), capture_output=True, text=True, env=env)
    sys.stderr.write(proc.stderr)
    found = []
    for line in proc.stdout.splitlines():
        try:
            value = json.loads(line)
        except json.JSONDecodeError:
            sys.stderr.write(line + "\n")
            continue
        if isinstance(value, dict):
            found.append(value)
    if proc.returncode != 0 or not found:
        raise RuntimeError(f"{shlex.join(cmd)} exited {proc.returncode} with "
                           f"{len(found)} JSON lines; its stderr is above")
    return found


def alternate(commands: dict[str, list[str]], rounds: int,
              env: dict[str, str] | None = None) -> list[dict[str, Any]]:
    """Every command once per round, in an order that rotates by one each round (so that no
    command always runs first, after the machine was idle): the way two things are compared on a
    machine whose speed drifts. Each entry: label, round, the command's last JSON line."""
    labels, runs = list(commands), []
    for rnd in range(rounds):
        shift = rnd % len(labels)
        for label in labels[shift:] + labels[:shift]:
            started = time.perf_counter()
            result = json_lines(commands[label], env)[-1]
            runs.append({"label": label, "round": rnd, "wall_s": round(
                time.perf_counter() - started, 1), "result": result})
            print(json.dumps(runs[-1]), flush=True)
    return runs


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if "--" not in args:
        print("usage: record.py NAME [--repeat N] [--results PATH] -- COMMAND ...", file=sys.stderr)
        return 2
    cut = args.index("--")
    parser = argparse.ArgumentParser(prog="record.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("name", help="the benchmark's name: results/<name>.json")
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--results", type=Path, help="default: benchmarks/results/NAME.json")
    options, command = parser.parse_args(args[:cut]), args[cut + 1:]
    if options.repeat < 1 or not command:
        parser.error("--repeat must be at least 1 and a command must follow --")
    recording = Recording(options.name, shown_command(command))
    runs = [json_lines(command)[-1] for _ in range(options.repeat)]
    print(recording.write(runs, options.results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
