"""`python -m benchmarks.throughput train`: the training loop of `stages.train`
(clipms.train.loop.train) on one random batch: everything but the data loader."""

from __future__ import annotations

import argparse
import os
import time
from typing import Any

import numpy as np

from benchmarks.throughput.common import (
    Subcommand,
    add_model_arguments,
    base_result,
    random_pixels,
    random_tokens,
    register,
    runtime_config,
    setup_mindspore,
)


def add_train_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_arguments(parser)
    parser.add_argument("--precision", choices=("fp32", "amp"), default="fp32")
    parser.add_argument("--lr", type=float, default=5e-4)
    parser.add_argument("--log-every", type=int, default=10,
                        help="steps between reads of the results (train.log_every)")


class _RepeatedBatch:
    """A BatchSource serving one pre-made batch: the loop's cost without the loader's."""

    def __init__(self, images: np.ndarray, tokens: np.ndarray, batches: int) -> None:
        self.batch, self.batches_per_epoch = (images, tokens), batches

    def stream(self, start: int, stop: int):  # noqa: ANN201 - an iterator of batches
        for _ in range(start, stop):
            yield self.batch


class _CpuClock:
    """Process CPU time from the first read-back (after graph compilation) to the end."""

    def __init__(self) -> None:
        self.start: float | None = None
        self.seconds = 0.0

    def on_step_end(self, step: int, metrics: dict[str, float]) -> None:
        if self.start is None:
            self.start = time.process_time()

    def on_train_end(self, summary: dict[str, float]) -> None:
        self.seconds = time.process_time() - (self.start or time.process_time())


def run_train(args: argparse.Namespace) -> dict[str, Any]:
    """The training loop of `stages.train` (clipms.train.loop.train: the compiled step, read back
    every --log-every steps) on one random batch, i.e. everything but the data loader.
    samples/s counts every step after the first (graph compilation), as metrics/train.json."""
    setup_mindspore(args)
    from clipms.model.architecture import get_preset
    from clipms.train.loop import TrainConfig, train

    steps = args.warmup + args.steps
    cfg = TrainConfig(model=get_preset(args.preset), batch_size=args.batch_size,
                      precision=args.precision, runtime=runtime_config(args), lr=args.lr,
                      max_steps=steps, warmup_steps=steps, log_every=args.log_every)
    images = random_pixels(args.batch_size, cfg.model.vision.image_size)
    tokens = random_tokens(args.batch_size, cfg.model.text.context_length,
                           cfg.model.text.vocab_size)
    clock, load_before = _CpuClock(), os.getloadavg()[0]
    summary = train(cfg, _RepeatedBatch(images, tokens, steps), None, callbacks=[clock]).summary
    return base_result(
        args, bench="train", preset=args.preset, precision=args.precision,
        log_every=args.log_every, samples_per_s=round(summary["samples_per_s"], 2),
        timed_steps=steps - 1, cpu_step_ms=round(1000 * clock.seconds / max(1, steps - 1), 1),
        peak_rss_mb=round(summary["peak_rss_mb"], 1),
        load_avg_1m=[round(load_before, 2), round(os.getloadavg()[0], 2)])


register(Subcommand("train", "training step throughput (forward + backward + AdamW)",
                    add_train_arguments, run_train))
