"""Mutation score of the critical modules: `make mutation` runs this.

For each module of MODULES (or those named on the command line) it runs `mutmut run` on that
module's mutants only (mutmut's configuration is `[tool.mutmut]` in pyproject.toml: which files
are mutated and which fast tests run), one module at a time, then prints killed / survived /
timeout / other per module from mutmut's own result files (mutants/<file>.meta). A mutant that no
fast test calls counts as "no tests": it is a survivor too, and is listed with the others.
Each module's counts and wall minutes are recorded, with the commit and the load, in
benchmarks/results/mutation.json (`--results`); modules not run keep their last entry.

    python benchmarks/mutation.py                 # every module (slow: see benchmarks/RESULTS.md)
    python benchmarks/mutation.py urlguard gate   # some of them
    python benchmarks/mutation.py --score-only    # the table of the last run, no mutmut run
    python benchmarks/mutation.py --survivors urlguard   # the names of its surviving mutants
    python benchmarks/mutation.py --tiers checkpoint loss  # the fast tier against all the tests

`--tiers` scores each module twice from a fresh mutants/ (deleted first: it is mutmut's scratch
folder), once with the tests above (the fast tier's: `-m "not slow"`) and once with the same test
files' slow tests too (mutmut's configuration with `-m "not slow"` taken out; the tests that start
a process of the project stay deselected, see pyproject.toml), and records both, with the mutants
only the slow tests kill, in benchmarks/results/mutation_tiers.json.

`mutmut show <name>` prints a mutant's diff; `mutmut apply <name>` writes it into the work tree
(undo with git). Runs use MUTATION_CHILDREN parallel children (default 1: the machine is shared).
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import os
import shutil
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import record  # benchmarks/record.py, beside this script

ROOT = Path(__file__).resolve().parents[1]

# label -> (file, mutant-name globs). Globs pick the functions a module's guarantee lives in;
# "<module>.*" is the whole file. mutmut names a mutant <module>.x_<function>__mutmut_<n> and a
# method's <module>.xǁ<Class>ǁ<method>__mutmut_<n>.
MODULES: dict[str, tuple[str, tuple[str, ...]]] = {
    "urlguard": ("prep/urlguard.py", ("prep.urlguard.*",)),
    "captions": ("prep/captions.py", ("prep.captions.*",)),
    "metrics": ("clipms/eval/metrics.py", ("clipms.eval.metrics.*",)),
    # the pure decision; current_champion/apply talk to MLflow (tests/registry/test_gate_mlflow.py,
    # slow)
    "gate": ("registry/gate.py", ("registry.gate.x_decide__*",
                                  "registry.gate.x_primary_direction__*",
                                  "registry.gate.x_describe__*",
                                  "registry.gate.x_decided_alias__*",
                                  "registry.gate.x_candidate_from_version__*")),
    "params": ("pipeline/params.py", ("pipeline.params.*",)),
    "loss": ("clipms/train/loss.py", ("clipms.train.loss.*",)),
    "tokenizer": ("clipms/text/clip_tokenizer.py", ("clipms.text.clip_tokenizer.*",)),
    "bpe": ("clipms/text/bpe.py", ("clipms.text.bpe.*",)),
    "shards": ("prep/shards.py", ("prep.shards.*",)),
    "checkpoint": ("clipms/train/checkpoint.py", ("clipms.train.checkpoint.*",)),
    # the parity part of export: the report, its error measure and the pass/fail decision
    "export": ("clipms/deploy/mindir.py", ("clipms.deploy.mindir.x_parity_report__*",
                                    "clipms.deploy.mindir.x__errors__*",
                                    "clipms.deploy.mindir.x_assert_parity__*",
                                    "clipms.deploy.mindir.x__cycle_rows__*")),
}
KILLED = {1, 3}  # mutmut's exit codes: 1 a test failed, 3 pytest's internal error
SURVIVED = {0}
TIMEOUT = {36, 24, -24, 152, 255}
NO_TESTS = {5, 33}


def mutant_results(file: str, globs: tuple[str, ...]) -> dict[str, int | None]:
    """mutant name -> mutmut's exit code (None: not run yet), for the mutants the globs select."""
    meta = ROOT / "mutants" / (file + ".meta")
    if not meta.exists():
        return {}
    codes = json.loads(meta.read_text())["exit_code_by_key"]
    return {name: code for name, code in codes.items()
            if any(fnmatch.fnmatchcase(name, g) for g in globs)}


def status(code: int | None) -> str:
    if code in KILLED:
        return "killed"
    if code in SURVIVED:
        return "survived"
    if code in TIMEOUT:
        return "timeout"
    if code in NO_TESTS:
        return "no tests"
    return "not run" if code is None else f"other ({code})"


def module_counts(label: str) -> dict[str, int]:
    """killed / survived / no tests / timeout / other counts of one module's last run."""
    file, globs = MODULES[label]
    counts = Counter(status(c) for c in mutant_results(file, globs).values())
    named = {k: counts[k] for k in ("killed", "survived", "no tests", "timeout")}
    return {"file": file, "mutants": sum(counts.values()), **named,
            "other": sum(counts.values()) - sum(named.values())}


def record_scores(labels: list[str], recording: record.Recording, out: Path | None,
                  minutes: dict[str, float] | None = None) -> None:
    """Each module's counts and wall minutes, with the commit, machine and load of its run, into
    the result file; the modules not run this time keep their last entry (a run of all of them
    takes hours)."""
    path = out or record.default_path("mutation")
    modules = json.loads(path.read_text())["results"] if path.exists() else {}
    meta = recording.meta()
    for label in labels:
        modules[label] = {**module_counts(label), "wall_min": (minutes or {}).get(label),
                          "meta": meta}
    recording.write(dict(sorted(modules.items())), path)


def score_table(labels: list[str]) -> str:
    rows = ["module      file                       mutants  killed  survived  no tests  "
            "timeout  other  score"]
    for label in labels:
        file, globs = MODULES[label]
        counts = Counter(status(c) for c in mutant_results(file, globs).values())
        total = sum(counts.values())
        killed, timeout = counts["killed"], counts["timeout"]
        other = total - killed - counts["survived"] - counts["no tests"] - timeout
        score = f"{100 * (killed + timeout) / total:5.1f}%" if total else "    -"
        rows.append(f"{label:<11} {file:<26} {total:>7}  {killed:>6}  {counts['survived']:>8}  "
                    f"{counts['no tests']:>8}  {timeout:>7}  {other:>5}  {score}")
    return "\n".join(rows) + "\n(score = (killed + timeout) / mutants; a timeout is a mutant " \
        "that made a test hang, which the tests notice)"


def run_module(label: str, children: int, with_slow: bool = False) -> int:
    _, globs = MODULES[label]
    print(f"== mutmut run {label}{' (slow tests too)' if with_slow else ''}", flush=True)
    # tokenizers' thread pool and mutmut's fork per mutant do not mix (it warns, may deadlock)
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    mutmut = [__file__, WITH_SLOW] if with_slow else ["-m", "mutmut"]
    return subprocess.run([sys.executable, *mutmut, "run", "--max-children", str(children),
                           *globs], cwd=ROOT, env=env).returncode


# ---- the fast tier against all the tests of the same files (--tiers)

WITH_SLOW = "--mutmut-with-slow-tests"  # how run_module asks this script to be mutmut itself
TIERS = {"fast": False, "all": True}  # tier -> with slow tests


def mutmut_with_slow_tests(mutmut_args: list[str]) -> None:
    """mutmut's command line, its configuration read as usual and `-m "not slow"` dropped. The
    configuration is read once, in this process; mutmut's fork server and the children it forks
    for the mutants inherit it."""
    from mutmut import configuration
    from mutmut.__main__ import cli

    config = configuration.config()
    args = config.pytest_add_cli_args
    at = next((i for i in range(len(args) - 1) if args[i:i + 2] == ["-m", "not slow"]), None)
    if at is None:
        raise SystemExit('[tool.mutmut] pytest_add_cli_args has no "-m", "not slow" to take out')
    del args[at:at + 2]
    print(f"mutmut's pytest arguments: {' '.join(args)}", flush=True)
    cli(mutmut_args)


def run_tiers(label: str, children: int) -> dict[str, object]:
    """Both tiers of one module, each from a fresh mutants/: counts, time, load, survivors."""
    file, globs = MODULES[label]
    entry: dict[str, object] = {"file": file}
    survivors: dict[str, set[str]] = {}
    for tier, with_slow in TIERS.items():
        shutil.rmtree(ROOT / "mutants", ignore_errors=True)
        load, started = record.load_avg(), time.monotonic()
        if run_module(label, children, with_slow) != 0:
            raise RuntimeError(f"mutmut did not finish for {label} ({tier} tier)")
        codes = mutant_results(file, globs)
        survivors[tier] = {n for n, c in codes.items() if status(c) in ("survived", "no tests")}
        entry[tier] = {**module_counts(label), "wall_min": round((time.monotonic() - started) / 60,
                                                                 1),
                       "load_avg": {"start": load, "end": record.load_avg()}}
    entry["killed_only_with_slow_tests"] = sorted(survivors["fast"] - survivors["all"])
    entry["killed_only_without"] = sorted(survivors["all"] - survivors["fast"])  # expected: none
    return entry


def record_tiers(labels: list[str], children: int, recording: record.Recording) -> None:
    """benchmarks/results/mutation_tiers.json, the modules not run keeping their last entry."""
    path = record.default_path("mutation_tiers")
    modules = json.loads(path.read_text())["results"] if path.exists() else {}
    for label in labels:
        modules[label] = run_tiers(label, children)
        recording.write(dict(sorted(modules.items())), path)  # after each: a long run may stop


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("modules", nargs="*", metavar="MODULE",
                        help=f"some of: {', '.join(MODULES)} (default: all)")
    parser.add_argument("--score-only", action="store_true", help="print the last run's table")
    parser.add_argument("--survivors", action="store_true",
                        help="list the surviving (and untested) mutants of the modules")
    parser.add_argument("--results", type=Path,
                        help="result file (default: benchmarks/results/mutation.json)")
    parser.add_argument("--tiers", action="store_true",
                        help="score the fast tier against the same files' slow tests too")
    args = parser.parse_args(argv)
    recording = record.start("mutation_tiers" if args.tiers else "mutation",
                             sys.argv if argv is None else ["benchmarks/mutation.py", *argv])
    unknown = [m for m in args.modules if m not in MODULES]
    if unknown:
        parser.error(f"unknown module(s) {', '.join(unknown)}; allowed: {', '.join(MODULES)}")
    labels = args.modules or list(MODULES)
    if args.survivors:
        for label in labels:
            file, globs = MODULES[label]
            for name, code in sorted(mutant_results(file, globs).items()):
                if status(code) in ("survived", "no tests"):
                    print(f"{status(code):<9} {name}")
        return 0
    if args.tiers:
        record_tiers(labels, int(os.environ.get("MUTATION_CHILDREN", "1")), recording)
        return 0
    failed, minutes = [], {}
    if not args.score_only:
        children = int(os.environ.get("MUTATION_CHILDREN", "1"))
        for label in labels:
            started = time.monotonic()
            if run_module(label, children) != 0:
                failed.append(label)
            minutes[label] = round((time.monotonic() - started) / 60, 1)
        record_scores([label for label in labels if label not in failed], recording, args.results,
                      minutes)
    print(score_table(labels))
    if failed:
        print(f"mutmut did not finish for: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    if sys.argv[1:2] == [WITH_SLOW]:
        mutmut_with_slow_tests(sys.argv[2:])
    sys.exit(main())
