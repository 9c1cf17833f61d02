"""What every `python -m benchmarks.throughput` subcommand shares: the registry (`SUBCOMMANDS`,
`register`), the common arguments (--mode/--warmup/--steps/--threads/--kernel-fusion/--device),
`setup_mindspore` (clipms.runtime + threads + seed), `time_steps` (warm-up, then per-step wall
times in ms), `timed_steps` (the same with the timed steps' total wall and CPU time: median and
mean rates) and the random inputs. Pure Python + numpy at import: benchmarks/openclip_peer.py
imports it without MindSpore.
"""

from __future__ import annotations

import argparse
import os
import statistics
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


@dataclass(frozen=True)
class StepTimes:
    """The timed steps of a run (warm-up excluded): each step's wall time, the wall time of
    all of them together (first start to last end, the loop between steps included) and the
    process CPU time (all threads) they took."""

    times_ms: list[float]
    wall_s: float
    cpu_s: float

    @property
    def median_ms(self) -> float:
        return statistics.median(self.times_ms)

    def median_rate(self, items_per_step: int) -> float:
        """Items per second at the median step: a step no other process interrupted."""
        return items_per_step / self.median_ms * 1000

    def mean_rate(self, items_per_step: int) -> float:
        """Items per second over all timed steps (total items / total time): every interruption
        counted, as a service's requests per second over a span of seconds count them."""
        return items_per_step * len(self.times_ms) / self.wall_s

    def cpu_ms_per_item(self, items_per_step: int) -> float:
        return self.cpu_s * 1000 / (items_per_step * len(self.times_ms))


def timed_steps(step: Callable[[], Any], warmup: int, steps: int) -> StepTimes:
    """Run `step` warmup times untimed, then `steps` (>= 1) times timed. `step` must block until
    its result exists (e.g. end with .asnumpy())."""
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    for _ in range(warmup):
        step()
    times = []
    cpu_start, wall_start = time.process_time(), time.perf_counter()
    for _ in range(steps):
        start = time.perf_counter()
        step()
        times.append((time.perf_counter() - start) * 1000)
    wall, cpu = time.perf_counter() - wall_start, time.process_time() - cpu_start
    return StepTimes(times, wall, cpu)


def time_steps(step: Callable[[], Any], warmup: int, steps: int,
               cpu_ms: list[float] | None = None) -> list[float]:
    """Run `step` warmup times untimed, then `steps` (>= 1) times; wall time of each in ms.
    `step` must block until its result exists (e.g. end with .asnumpy()). If `cpu_ms` is a list,
    the process CPU time (all threads) per timed step is appended to it: less sensitive than wall
    time to other processes on a shared machine."""
    run = timed_steps(step, warmup, steps)
    if cpu_ms is not None:
        cpu_ms.append(run.cpu_s * 1000 / len(run.times_ms))
    return run.times_ms


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
