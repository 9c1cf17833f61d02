"""How long the test suite takes, per tier, as `make` runs it: wall and CPU seconds, test counts.

    python benchmarks/suite_time.py                 # both tiers: test-fast, then test
    python benchmarks/suite_time.py --tiers test-fast

Each tier's pytest command is read from the Makefile's target of that name (the Makefile owns
the commands), and run from the repository root; the CPU seconds are those of pytest and every
process it started (servers, `dvc`, `msrun`), from the children's resource usage. Writes
benchmarks/results/suite_time.json, and keeps each tier's whole output and every module's
seconds (`<tier>-modules.json`) in `--log-dir`; a tier that fails is recorded with its outcome
and makes the command fail.
"""

from __future__ import annotations

import argparse
import os
import re
import resource
import shlex
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import record

ROOT = Path(__file__).resolve().parents[1]
TIERS = ("test-fast", "test")
MODULE_TIMES_ENV = "CLIP_SUITE_MODULE_TIMES"  # tests/conftest.py reads the same name
SUMMARY = re.compile(r"(\d+) (passed|failed|skipped|errors?|xfailed|xpassed)")


def tier_command(target: str, makefile: Path = ROOT / "Makefile") -> list[str]:
    """The pytest command of a Makefile target: the recipe line that runs pytest."""
    lines = makefile.read_text().splitlines()
    try:
        start = lines.index(f"{target}: env")
    except ValueError:
        raise SystemExit(f"the Makefile has no target '{target}: env'") from None
    for line in lines[start + 1:]:
        if not line.startswith("\t"):
            break
        if line.strip().startswith("pytest"):
            return shlex.split(line.strip())
    raise SystemExit(f"the Makefile's target {target} runs no pytest command")


def counts(output: str) -> dict[str, int]:
    """pytest's last summary line as outcome -> count ("3 passed, 1 skipped in 2.0s")."""
    line = next((ln for ln in reversed(output.splitlines()) if SUMMARY.search(ln)), "")
    return {outcome.rstrip("s") if outcome.startswith("error") else outcome: int(n)
            for n, outcome in SUMMARY.findall(line)}


def children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def run_tier(target: str, log_dir: Path) -> dict[str, Any]:
    """One tier, its whole output kept in `log_dir/<target>.log` (a failure's traceback with it)."""
    cmd = tier_command(target)
    log_dir.mkdir(parents=True, exist_ok=True)
    # every module's seconds beside the log (tests/conftest.py writes them)
    env = {**os.environ, MODULE_TIMES_ENV: str(log_dir / f"{target}-modules.json")}
    cpu0, t0 = children_cpu_s(), time.monotonic()
    done = subprocess.run([sys.executable, "-m", *cmd], cwd=ROOT, capture_output=True, text=True,
                          env=env)
    wall, cpu = time.monotonic() - t0, children_cpu_s() - cpu0
    (log_dir / f"{target}.log").write_text(done.stdout + done.stderr)
    sys.stderr.write(done.stdout[-2000:] + f"\n(whole output: {log_dir / f'{target}.log'})\n")
    return {"tier": target, "command": shlex.join(cmd), "wall_s": round(wall, 1),
            "cpu_s": round(cpu, 1), "exit_code": done.returncode, **counts(done.stdout)}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiers", nargs="+", choices=TIERS, default=list(TIERS))
    parser.add_argument("--out", type=Path, help="result file (default: benchmarks/results/)")
    parser.add_argument("--log-dir", type=Path, default=Path(tempfile.gettempdir()) / "suite_time",
                        help="where each tier's whole pytest output is kept")
    args = parser.parse_args(argv)
    recording = record.start("suite_time", argv)
    rows = [run_tier(target, args.log_dir) for target in args.tiers]
    print(recording.write(rows, args.out))
    return 1 if any(row["exit_code"] for row in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
