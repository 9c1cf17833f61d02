"""Quality as training goes: a training callback that scores the model every N steps with its
clock paused, so a benchmark can say how long training took to reach a quality (the time-to-
quality and open_clip comparison scripts under benchmarks/).

`QualityChecks(every, score)` is a `clipms.train.loop` callback: after the device has finished
step N (a multiple of `every`), and once more at the end, it calls `score(model)` and records the
metrics beside the training clock - wall time since the callback was made, without the pauses
to score. `stop_at` ends the run (raises `TargetReached`) at the first check where a metric
reaches a value. `EvalCopy` scores a training model through a model of the same config in
evaluation mode that holds a copy of its weights: patch dropout off, the training model
untouched.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

Scores = dict[str, float]


class TargetReached(Exception):
    """A QualityChecks told to stop at a target reached it: the run has answered its question."""


class OutOfTime(Exception):
    """A QualityChecks given a deadline passed it without reaching its target."""


class QualityChecks:
    """Callback: every `every` steps and at the end, pause the clock and record `score(model)`'s
    `keys`; `first_step_s` is the clock when the first step was read back (startup and graph
    compilation). With `deadline_s`, a check on a clock past it ends the run (`OutOfTime`)."""

    def __init__(self, every: int, score: Callable[[Any], Scores], keys: Sequence[str],
                 stop_at: tuple[str, float] | None = None,
                 deadline_s: float | None = None) -> None:
        self.every, self.score, self.keys, self.stop_at = every, score, tuple(keys), stop_at
        self.deadline_s = deadline_s
        self.started = time.perf_counter()
        self.paused = 0.0  # seconds spent scoring
        self.curve: list[dict[str, float]] = []
        self.run: Any = None
        self.train_s = 0.0
        self.first_step_s: float | None = None

    def clock(self) -> float:
        return time.perf_counter() - self.started - self.paused

    def on_train_begin(self, run: Any) -> None:
        if self.every and self.every % run.cfg.log_every:
            raise ValueError(f"checks every {self.every} steps need train.log_every "
                             f"({run.cfg.log_every}) to divide {self.every}: the loop reads the "
                             "device, and so reports steps, every log_every steps")
        self.run = run

    def on_step_end(self, step: int, metrics: Scores) -> None:
        if self.first_step_s is None:
            self.first_step_s = self.clock()
        # rows arrive after a read of the device; the weights are step's when it is the last
        if self.every and step % self.every == 0 and step == self.run.step:
            self.check(step)
            last = self.curve[-1]
            if self.stop_at is not None and last[self.stop_at[0]] >= self.stop_at[1]:
                self.train_s = last["train_s"]
                raise TargetReached(step)
            if self.deadline_s is not None and last["train_s"] >= self.deadline_s:
                self.train_s = last["train_s"]
                raise OutOfTime(step)

    def on_train_end(self, summary: Scores) -> None:
        self.train_s = self.clock()
        if not self.curve or self.curve[-1]["step"] != int(summary["steps"]):
            self.check(int(summary["steps"]))

    def check(self, step: int) -> None:
        at, began = self.clock(), time.perf_counter()
        found = self.score(self.run.model)
        took = time.perf_counter() - began
        self.paused += took
        self.curve.append({"step": step, "train_s": round(at, 2), "eval_s": round(took, 2),
                           **{k: round(float(found[k]), 4) for k in self.keys}})
        print(f"check: step {step} train {at:.1f} s " + " ".join(
            f"{k} {found[k]:.3f}" for k in self.keys), file=sys.stderr, flush=True)


class EvalCopy:
    """`EvalCopy(config)(model)`: an evaluation-mode CLIP of `config` holding a copy of `model`'s
    weights (made at the first call, after the training model has drawn its own initial weights,
    so their seed stays theirs). Training state such as the patch-dropout draw counter is not a
    weight of the copy and is left out."""

    def __init__(self, config: Any) -> None:
        self.config = config
        self.net: Any = None

    def __call__(self, model: Any) -> Any:
        import mindspore as ms

        from clipms.model.clip import CLIP

        if self.net is None:
            self.net = CLIP(self.config).set_train(False)
        own = dict(self.net.parameters_and_names())
        for name, param in model.parameters_and_names():
            if name in own:
                own[name].set_data(ms.Tensor(param.asnumpy()))
        return self.net
