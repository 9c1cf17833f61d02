"""What every `clipms-bench` subcommand shares: the registry (`SUBCOMMANDS`, `register`), the
common arguments (--mode/--warmup/--steps/--threads/--kernel-fusion/--device), `setup_mindspore`
(clipms.runtime + threads + seed), `time_steps` (warm-up, then per-step wall times in ms) and the
random inputs. Pure Python + numpy at import: benchmarks/openclip_peer.py imports it without
MindSpore.
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np


@dataclass(frozen=True)
class Subcommand:
    name: str
    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], dict[str, Any]]


SUBCOMMANDS: dict[str, Subcommand] = {}


def register(command: Subcommand) -> Subcommand:
    SUBCOMMANDS[command.name] = command
    return command


# ---- shared helpers -------------------------------------------------------------------------


def add_common_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--mode", choices=("graph", "pynative"), default="graph",
                        help="MindSpore execution mode (graph is faster on CPU)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps (graph compile)")
    parser.add_argument("--steps", type=int, default=20, help="timed steps; the median is kept")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1,
                        help="MindSpore runtime threads (default: all cores)")
    parser.add_argument("--kernel-fusion", choices=("on", "off"), default="on",
                        help="graph-kernel fusion on CPU (clipms.runtime; default on)")
    parser.add_argument("--device", choices=("CPU", "GPU", "Ascend"), default="CPU",
                        help="device target (clipms.runtime.configure)")


def runtime_config(args: argparse.Namespace):  # noqa: ANN201 - clipms.runtime.RuntimeConfig
    from clipms.runtime import RuntimeConfig

    return RuntimeConfig(device_target=args.device, mode=args.mode,
                         kernel_fusion=args.kernel_fusion == "on")


def setup_mindspore(args: argparse.Namespace) -> None:
    from clipms.runtime import configure

    settings = configure(runtime_config(args))  # before MindSpore is imported
    import mindspore as ms

    ms.set_context(runtime_num_threads=args.threads)
    ms.set_seed(0)
    args.kernel_fusion_active = settings.kernel_fusion


def time_steps(step: Callable[[], Any], warmup: int, steps: int,
               cpu_ms: list[float] | None = None) -> list[float]:
    """Run `step` warmup times untimed, then `steps` times; wall time of each in ms.
    `step` must block until its result exists (e.g. end with .asnumpy()). If `cpu_ms` is a list,
    the process CPU time (all threads) per timed step is appended to it: less sensitive than wall
    time to other processes on a shared machine."""
    for _ in range(warmup):
        step()
    times = []
    cpu_start = time.process_time()
    for _ in range(steps):
        start = time.perf_counter()
        step()
        times.append((time.perf_counter() - start) * 1000)
    if cpu_ms is not None:
        cpu_ms.append((time.process_time() - cpu_start) * 1000 / max(steps, 1))
    return times


def random_tokens(n: int, context_length: int, vocab_size: int, seed: int = 0) -> np.ndarray:
    """Caption-like tokens: SOT, 5-20 words, EOT (the highest id), zero padding."""
    rng = np.random.default_rng(seed)
    tokens = np.zeros((n, context_length), np.int32)
    for row in range(n):
        words = int(rng.integers(5, min(20, context_length - 2) + 1))
        tokens[row, 0] = vocab_size - 2
        tokens[row, 1 : words + 1] = rng.integers(1, vocab_size - 2, words)
        tokens[row, words + 1] = vocab_size - 1
    return tokens


def random_pixels(n: int, image_size: int, seed: int = 0) -> np.ndarray:
    """uint8 (n, 3, S, S): what the training loader hands the train step."""
    return np.random.default_rng(seed).integers(0, 256, (n, 3, image_size, image_size),
                                                dtype=np.uint8)


def random_images(n: int, image_size: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).normal(size=(n, 3, image_size, image_size)).astype(
        np.float32)


def base_result(args: argparse.Namespace, **extra: Any) -> dict[str, Any]:
    return {"device": args.device, "mode": args.mode, "threads": args.threads,
            "batch_size": args.batch_size,
            "warmup": args.warmup, "steps": args.steps,
            "kernel_fusion": getattr(args, "kernel_fusion_active", False), **extra}


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--preset", default="tiny", help="model preset (tiny, small, ViT-B-32...)")
    parser.add_argument("--batch-size", type=int, default=64)
    add_common_arguments(parser)
