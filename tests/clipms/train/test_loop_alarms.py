"""A wasted run fails loudly: under amp a step whose gradients (or loss) are not finite is skipped
and the loss scale halves; the trainer counts the skipped steps and reports the scale (log line,
per-step rows, the summary that becomes metrics/train.json), and stops a run that skips more than
`train.max_skipped_share` of its steps or whose loss is not finite `train.max_nonfinite_steps`
steps in a row. The alarm's arithmetic is checked on rows; a real amp run on a micro CLIP forced
to overflow (`loss_scale: 1e30`) shows it end to end, and a healthy amp run never meets it."""

from __future__ import annotations

import logging
import math

import numpy as np
import pytest

from clipms.model.architecture import CLIPConfig, TextConfig, VisionConfig
from clipms.runtime import RuntimeConfig
from clipms.train.job import CSV_COLUMNS, history_csv
from clipms.train.loop import NonFiniteLossError, RandomBatches, SkippedStepsError, Training, train
from clipms.train.recipe import TrainConfig

MICRO = CLIPConfig(
    embed_dim=16,
    vision=VisionConfig(image_size=16, patch_size=8, width=32, layers=1, head_width=16),
    text=TextConfig(context_length=8, vocab_size=40, width=32, heads=2, layers=1),
)


def _rows(skipped: list[bool], losses: list[float] | None = None) -> list[dict]:
    losses = losses or [1.0] * len(skipped)
    return [{"step": i + 1, "loss": loss, "loss_scale": 2.0 ** -i, "skipped": flag}
            for i, (flag, loss) in enumerate(zip(skipped, losses, strict=True))]


def _host_side(**settings) -> Training:
    """A Training with only what its host-side accounting reads (no model, no step)."""
    return Training(TrainConfig(model=MICRO, precision="amp", **settings), None, None, [])


def test_the_skipped_steps_are_counted_across_reads_and_the_share_is_of_the_whole_run():
    run = _host_side(max_skipped_share=0.25)
    first = _rows([True] * 16 + [False] * 4)
    run._count_skipped(first, total=100)  # the loss scale calibrating: never an alarm
    run.history.extend(first)
    assert [r["skipped_steps"] for r in first] == [*range(1, 17), 16, 16, 16, 16]
    later = _rows([False] * 15 + [True] * 10)
    for i, row in enumerate(later):
        row["step"] = 21 + i
    with pytest.raises(SkippedStepsError, match=r"26 of the first 45 steps were skipped .* loss "
                       r"scale now [^)]+\), more than train.max_skipped_share 0.25 of the "
                       r"run's 100 steps"):
        run._count_skipped(later, total=100)  # 26 > 25: no later step can bring it back


def test_the_loss_scales_calibration_never_stops_a_run_however_short():
    short = _host_side()
    short._count_skipped(_rows([True, True, True]), total=3)  # 2^16 -> 2^13, all 3 skipped
    # no alarm: the scale may skip 16 steps to calibrate
    longer = _host_side()
    with pytest.raises(SkippedStepsError, match=r"17 of the first 17 steps were skipped"):
        longer._count_skipped(_rows([True] * 17), total=20)
    allowed = _host_side(max_skipped_share=1.0)
    allowed._count_skipped(_rows([True] * 20), total=20)  # the user allowed it


def test_a_run_of_non_finite_losses_stops_at_max_nonfinite_steps_only_when_consecutive():
    nan = float("nan")
    run = _host_side(max_skipped_share=1.0, max_nonfinite_steps=3)
    spaced = _rows([True, True, False, True, True], [nan, nan, 1.0, nan, nan])
    run._count_skipped(spaced, total=10)  # two, a finite one, two: never three in a row
    run.history.extend(spaced)
    third = [{"step": 6, "loss": nan, "loss_scale": 1.0, "skipped": True}]
    with pytest.raises(NonFiniteLossError, match=r"not finite at steps 4-6, 3 in a row "
                       r"\(train.max_nonfinite_steps: 3\).* weights are those of step 3"):
        run._count_skipped(third, total=10)  # the streak continues across reads


def test_the_alarms_are_params_with_defaults_and_bounds():
    from pipeline.params import ParamsError, validate_section
    from stages.train import TrainParams

    params = validate_section("train", TrainParams, {})
    assert (params.max_skipped_share, params.max_nonfinite_steps) == (0.25, 3)
    with pytest.raises(ParamsError, match=r"train.max_skipped_share = 1.5"):
        validate_section("train", TrainParams, {"max_skipped_share": 1.5})
    with pytest.raises(ParamsError, match=r"train.max_nonfinite_steps = 0"):
        validate_section("train", TrainParams, {"max_nonfinite_steps": 0})


def _amp(**settings) -> TrainConfig:
    return TrainConfig(model=MICRO, batch_size=4, lr=1e-3, warmup_steps=1, precision="amp",
                       runtime=RuntimeConfig(kernel_fusion=False), **settings)


@pytest.mark.slow  # trains: compiles an amp training step
def test_an_amp_run_forced_to_overflow_is_counted_and_stopped(caplog):
    # Allowed to skip every step, it runs through and says so in every place it reports.
    with caplog.at_level(logging.INFO, logger="clipms.train.loop"):
        result = train(_amp(max_steps=4, loss_scale=1e30, max_skipped_share=1.0, log_every=2),
                       RandomBatches(MICRO, 4, 4), None)
    assert [r["skipped_steps"] for r in result.history] == [1, 2, 3, 4]
    assert [r["loss_scale"] for r in result.history] == pytest.approx(
        [1e30 / 2, 1e30 / 4, 1e30 / 8, 1e30 / 16], rel=1e-6)
    assert result.summary["skipped_steps"] == 4
    assert result.summary["loss_scale"] == pytest.approx(1e30 / 16, rel=1e-6)
    assert "loss_scale 6.25e+28 skipped 4" in caplog.text  # the log line of step 4
    header, *lines = history_csv(result.history).splitlines()
    assert header.split(",") == list(CSV_COLUMNS) and header.endswith("loss_scale,skipped_steps")
    assert lines[-1].endswith(",6.25e+28,4")
    # With the default share, the run stops once it cannot end below it, past the calibration:
    # 17 of 40 steps (a night of 40 steps at this scale skipped all of them, and registered).
    with pytest.raises(SkippedStepsError, match=r"17 of the first 17 steps were skipped"):
        train(_amp(max_steps=40, loss_scale=1e30, log_every=1), RandomBatches(MICRO, 4, 40),
              None)


class NaNImages(RandomBatches):
    """Every batch holds a NaN pixel (float images, normalised already): a loss never finite."""

    def global_batch(self, epoch: int, index: int):
        images, tokens = super().global_batch(epoch, index)
        images = images.astype(np.float32) / 255
        images[:, 0, 0, 0] = np.nan
        return images, tokens


@pytest.mark.slow  # trains: compiles an amp training step
def test_an_amp_loss_that_stays_non_finite_stops_the_run_after_max_nonfinite_steps():
    with pytest.raises(NonFiniteLossError, match=r"not finite at steps 1-3, 3 in a row"):
        train(_amp(max_steps=6, max_skipped_share=1.0, log_every=10),
              NaNImages(MICRO, 4, 6), None)


@pytest.mark.slow  # trains: compiles an amp training step
def test_a_healthy_amp_run_skips_nothing_and_meets_no_alarm():
    # The loss scale calibrates from 2^16 by skipping (here the first 2 steps), then trains.
    result = train(_amp(max_steps=6, log_every=3), RandomBatches(MICRO, 4, 6), None)
    skipped = result.summary["skipped_steps"]
    assert skipped == result.history[-1]["skipped_steps"] < 6
    assert result.summary["loss_scale"] == 65536.0 / 2**skipped
    assert all(math.isfinite(r["loss"]) for r in result.history)
