"""`python -m benchmarks.throughput <subcommand>`: throughput benchmarks; each run prints one JSON
line.

Subcommands live in one registry, `SUBCOMMANDS`, and one module per family: `models` (encode,
forward, retrieval), `loader`, `training` (train). To add one, write `add_<name>_arguments(parser)`
and `run_<name>(args) -> dict` in its module, then `register(Subcommand("<name>", "<help>", add,
run))`. Shared pieces (`benchmarks.throughput.common`): `add_common_arguments`
(--mode/--warmup/--steps/--threads/--kernel-fusion/--device), `setup_mindspore` (mode + threads +
fusion) and `time_steps` (warm-up, then per-step wall times in ms).
"""

from __future__ import annotations

import argparse
import json

from benchmarks.throughput import (  # noqa: F401 - each registers its subcommands
    loader,
    models,
    training,
)
from benchmarks.throughput.common import (
    SUBCOMMANDS,
    Subcommand,
    add_common_arguments,
    random_images,
    random_pixels,
    random_tokens,
    register,
    runtime_config,
    setup_mindspore,
    time_steps,
)
from benchmarks.throughput.loader import DEVICE_RATE, loader_needs, write_synthetic_shards

__all__ = ["DEVICE_RATE", "SUBCOMMANDS", "Subcommand", "add_common_arguments", "build_parser",
           "loader_needs", "main", "random_images", "random_pixels", "random_tokens", "register",
           "runtime_config", "setup_mindspore", "time_steps", "write_synthetic_shards"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.throughput", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    for command in SUBCOMMANDS.values():
        command.add_arguments(sub.add_parser(command.name, help=command.help))
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    result = SUBCOMMANDS[args.command].run(args)
    print(json.dumps(result), flush=True)
    return 0
