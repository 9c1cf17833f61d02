"""Command line of the registry:
- `python -m registry compare [--name clip] [--metrics a,b]`: the registered versions, side by side;
- `python -m registry retain [--dry-run]`: the retention policy (`retention` in params.yaml)
  applied now, or only shown (what would be removed, and why);
- `python -m registry nights [--limit N]`: the last nights, one line each (registry/nightlog.py).

Reads the same store as the pipeline (`MLFLOW_TRACKING_URI`, default sqlite:///mlflow.db).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from registry import nightlog
from registry.compare import DEFAULT_METRICS


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m registry")
    sub = parser.add_subparsers(dest="command", required=True)
    compare = sub.add_parser("compare", help="table of the registered versions of a model")
    compare.add_argument("--name", default=None,
                         help="registered model (default: register.model_name in params.yaml)")
    compare.add_argument("--metrics", default=",".join(DEFAULT_METRICS),
                         help="comma-separated metric keys to show")
    compare.add_argument("--limit", type=int, default=20, help="newest N versions")
    compare.add_argument("--params", type=Path, default=Path("params.yaml"),
                         help="the params file --name defaults from (register.model_name)")
    retain = sub.add_parser("retain", help="apply the retention policy of params.yaml now")
    retain.add_argument("--dry-run", action="store_true",
                        help="list what would be removed and why; remove nothing")
    retain.add_argument("--name", default=None,
                        help="registered model (default: register.model_name in params.yaml)")
    retain.add_argument("--params", type=Path, default=Path("params.yaml"),
                        help="the params file with the retention section")
    nightlog.add_command(sub)
    args = parser.parse_args(argv)
    if args.command == "retain":
        return _retain(args)
    if args.command == "nights":
        return nightlog.main(args)

    from registry.compare import collect, render
    from tracking.settings import client

    name = args.name or _default_model_name(args.params)
    rows = collect(client(), name, args.limit)
    print(render(name, rows, [m for m in args.metrics.split(",") if m]))
    return 0


def _retain(args: argparse.Namespace) -> int:
    from pipeline.params import ParamsError
    from registry.retention import RetentionError, retain, retention_params
    from tracking.settings import client

    try:
        params = retention_params(args.params)
    except ParamsError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    name = args.name or _default_model_name(args.params)
    root = args.params.resolve().parent  # the project: its dvc.lock and DVC cache
    try:
        retain(client(), name, params, root, dry_run=True if args.dry_run else None)
    except RetentionError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    return 0


def _default_model_name(params_file: Path) -> str:
    from pipeline.params import ParamsError
    from tracking.settings import RegisterParams, register_params

    try:
        return register_params(params_file).model_name
    except ParamsError as err:  # still usable outside a project, with the default name
        print(f"warning: {err}; using the default model name", file=sys.stderr)
        return str(RegisterParams.model_fields["model_name"].default)


if __name__ == "__main__":
    sys.exit(main())
