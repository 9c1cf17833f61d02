"""`python -m ops.pin_evalset`: freeze today's evaluation split into a pinned set, or check one.

    python -m ops.pin_evalset freeze 2026-12-05   # data/shards' val -> data/evalsets/2026-12-05
    python -m ops.pin_evalset verify 2026-12-05   # every shard still the one recorded

`freeze` copies the split (checked against the shard manifest first) into a new folder under
data/evalsets/, with a manifest of its own, and - in a DVC project - runs `dvc add` on it, so the
set is versioned by the `.dvc` file git tracks and travels with `dvc push` / `dvc pull`. Nothing
is ever overwritten: a new yardstick is a new name. Then set `evaluate.pinned_set: <name>`:
`evaluate` scores that set every night and the gate compares versions on it
(docs/mlflow.md, "A pinned evaluation set").
"""

# tested by: tests/clipms/data/test_evalset.py

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

from clipms.data.evalset import freeze, verify
from clipms.data.webds import DataError
from clipms.eval.options import PINNED_SET_NAME
from pipeline import paths

NAME_HELP = "the set's name: letters, digits, '.', '_', '-' (e.g. a date)"


def _name(value: str) -> str:
    if not PINNED_SET_NAME.fullmatch(value):
        raise argparse.ArgumentTypeError(f"{value!r}: {NAME_HELP}")
    return value


def dvc_add(folder: Path) -> str | None:
    """`dvc add folder` in a DVC project (the .dvc file to commit), else None."""
    if not Path(".dvc").is_dir() or shutil.which("dvc") is None:
        return None
    subprocess.run(["dvc", "add", str(folder)], check=True)
    return f"{folder}.dvc"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ops.pin_evalset", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    make = commands.add_parser("freeze", help="copy a split of data/shards into a pinned set")
    make.add_argument("name", type=_name, help=NAME_HELP)
    make.add_argument("--split", default="val", help="the split of data/shards (default val)")
    make.add_argument("--no-dvc", action="store_true", help="do not run `dvc add` on it")
    check = commands.add_parser("verify", help="check a pinned set against its manifest")
    check.add_argument("name", type=_name, help=NAME_HELP)
    args = parser.parse_args(argv)
    folder = paths.EVALSETS / args.name
    try:
        if args.command == "verify":
            manifest = verify(folder)
        else:
            manifest = freeze(paths.SHARDS, args.split, folder)
    except DataError as err:
        print(f"evalset: error: {err}", file=sys.stderr)
        return 1
    from tracking.lineage import val_digest

    samples = manifest["splits"]["val"]["samples"]
    digest = val_digest(folder / "manifest.json")
    print(f"evalset: {folder}: {samples} samples, evaluation-set digest {digest}")
    if args.command == "freeze":
        tracked = None if args.no_dvc else dvc_add(folder)
        if tracked:
            print(f"evalset: versioned by {tracked}: git add {tracked} "
                  f"{paths.EVALSETS}/.gitignore && git commit; dvc push")
        print(f"evalset: to score it every night: evaluate.pinned_set: {args.name} "
              f"(e.g. dvc exp run -S evaluate.pinned_set={args.name})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
