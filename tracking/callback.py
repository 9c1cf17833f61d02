"""The training callback: per-step metrics into the pipeline's MLflow run without stalling training.

`on_step_end` only appends to the run's queue and, every `flush_every_s`, asks the run's sender
thread to send it (`PipelineRun.flush(timeout=0)` returns at once). So a tracking server that is
slow, down or hanging costs a training step a list append and a lock, never a network round trip;
the only wait is the bounded one at the end of the stage (`PipelineRun.close`).

The first step also tells the run whether training resumed from a checkpoint (a first step after
1, or a finished run without steps): then it continues the MLflow run that wrote the checkpoint.
"""

# tested by: tests/integration/test_registry_postgres.py

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import TYPE_CHECKING

from tracking.journal import finite_number

if TYPE_CHECKING:
    from tracking.run import PipelineRun


class TrainCallback:
    """Trainer callback (duck-typed: `on_step_end`, `on_train_end`)."""

    def __init__(self, run: PipelineRun, flush_every_s: float = 10.0, prefix: str = "",
                 retry_after_s: float = 60.0) -> None:
        self.run = run
        self.flush_every_s = flush_every_s
        self.retry_after_s = retry_after_s  # after a failed send, ask less often
        self.prefix = prefix
        self._seen_step = False
        self._next_flush = time.monotonic() + flush_every_s

    def on_step_end(self, step: int, metrics: Mapping[str, float]) -> None:
        if not self._seen_step:
            self._seen_step = True
            self.run.resolve(resumed=step > 1)
        self.run.log_metrics({self.prefix + k: v for k, v in metrics.items()
                              if k != "step" and finite_number(v)}, step=step)
        if time.monotonic() >= self._next_flush:
            failing = self.run.last_error is not None
            self.run.flush(timeout=0)
            wait = self.retry_after_s if failing else self.flush_every_s
            self._next_flush = time.monotonic() + wait

    def on_train_end(self, summary: Mapping[str, float]) -> None:
        if not self._seen_step:  # resumed from the final checkpoint: nothing left to train
            self.run.resolve(resumed=bool(summary.get("steps")))
        final = {k if k.startswith("train") else f"train_{k}": v for k, v in summary.items()}
        self.run.log_metrics({k: v for k, v in final.items() if finite_number(v)})
        self.run.flush(timeout=0)
