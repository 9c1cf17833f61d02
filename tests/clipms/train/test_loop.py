"""The training loop on a real (micro) CLIP in GRAPH_MODE: the host-sync-free loop against the
former host-fed step, non-finite steps named exactly with nothing bad saved, bitwise resume,
tower locking, amp on CPU, checkpoints of another configuration set aside, the one schema."""

from __future__ import annotations

import dataclasses
import math

import mindspore as ms
import numpy as np
import pytest
from mindspore import Parameter, Tensor, nn

from clipms.model.architecture import CLIPConfig
from clipms.model.clip import CLIP
from clipms.runtime import RuntimeConfig
from clipms.train import checkpoint, schedule
from clipms.train.feed import HostFeed, sink_dataset
from clipms.train.loop import NonFiniteLossError, RandomBatches, Training, train
from clipms.train.recipe import LOSS_INIT, TrainConfig, TrainSettings
from harness.tiny_model import MICRO

# SigLIP's loss and initialisation, and patch dropout (2 of the 4 patches kept)
MICRO_SIGLIP_PD = dataclasses.replace(
    MICRO, vision=dataclasses.replace(MICRO.vision, patch_dropout=0.5), **LOSS_INIT["siglip"])


class HostSchedule(nn.Cell):
    """The former step's inputs: lr_t, eps_t, wd_t computed on the host and fed each step."""

    def __init__(self) -> None:
        super().__init__()
        self.values = [Parameter(Tensor(np.float32(0)), name=f"host_{k}", requires_grad=False)
                       for k in ("lr", "eps", "wd")]
        self.lr, self.eps, self.wd = self.values

    def construct(self, step, t):  # noqa: ARG002 - the host decided them
        return self.lr, self.eps, self.wd


def former_step_losses(cfg: TrainConfig, source: RandomBatches, total: int) -> list[float]:
    """The loop as it was: host-computed learning rate and bias correction fed into every step,
    and every step's loss read back before the next one is launched."""
    ms.set_seed(cfg.seed)
    run = Training.build(cfg, total)
    host = HostSchedule()
    run.step_cell.schedule = host
    losses = []
    for step, (images, tokens) in enumerate(source.stream(0, total)):
        hyper = schedule.folded_hyper(schedule.cosine_lr(step, cfg.lr, cfg.warmup_steps, total),
                                      step + 1, cfg.betas, cfg.eps, cfg.weight_decay)
        for param, value in zip(host.values, hyper.tensors(), strict=True):
            param.set_data(Tensor(value))
        loss, *_ = run.step_cell(Tensor(images), Tensor(tokens))
        losses.append(float(loss.asnumpy()))
    return losses


@pytest.mark.slow  # trains: compiles a training step
def test_the_host_sync_free_loop_gives_the_former_steps_losses_over_20_steps():
    cfg = TrainConfig(model=MICRO, batch_size=8, max_steps=20, lr=2e-3, warmup_steps=5,
                      log_every=10, runtime=RuntimeConfig(kernel_fusion=False))
    source = RandomBatches(MICRO, 8, 20, seed=11)
    result = train(cfg, source, None)
    former = former_step_losses(cfg, source, 20)
    new = [row["loss"] for row in result.history]
    assert len(new) == 20 and new[-1] < new[0]  # it trains
    np.testing.assert_allclose(new, former, rtol=1e-5)  # fp32 rounding of the lr only
    lrs = [row["lr"] for row in result.history]
    assert lrs == [schedule.cosine_lr(s, cfg.lr, 5, 20) for s in range(20)]


class NaNAt(RandomBatches):
    """Random batches whose batch `bad` holds a NaN pixel (float images, normalised already)."""

    def __init__(self, *args, bad: int, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.bad = bad

    def global_batch(self, epoch: int, index: int):
        images, tokens = super().global_batch(epoch, index)
        images = images.astype(np.float32) / 255
        if epoch * self.batches_per_epoch + index == self.bad:
            images[0, 0, 0, 0] = np.nan
        return images, tokens


@pytest.mark.slow  # trains: compiles a training step
def test_a_planted_nan_is_named_at_its_exact_step_although_results_are_read_every_10(tmp_path):
    cfg = TrainConfig(model=MICRO, batch_size=4, epochs=1, lr=1e-3, warmup_steps=1,
                      log_every=10, checkpoint_every=100)
    with pytest.raises(NonFiniteLossError, match=r"loss is nan at step 7 \(epoch 0\)"):
        train(cfg, NaNAt(MICRO, 4, 12, bad=6), None)


@pytest.mark.slow  # trains: compiles a training step
def test_nothing_of_a_bad_step_is_saved_and_the_last_good_checkpoint_is_intact(tmp_path):
    cfg = TrainConfig(model=MICRO, batch_size=4, epochs=1, lr=1e-3, warmup_steps=1,
                      checkpoint_every=2, keep_checkpoints=5, log_every=10)
    with pytest.raises(NonFiniteLossError, match=r"at step 5 \(epoch 0\)"):
        train(cfg, NaNAt(MICRO, 4, 8, bad=4), tmp_path / "ckpt", resume=False)
    saved = checkpoint.list_checkpoints(tmp_path / "ckpt")
    assert [p.name for p in saved] == ["step-00000002.ckpt", "step-00000004.ckpt"]
    last = checkpoint.load(saved[-1])
    assert last.meta["step"] == 4 and int(last.tensors["first_bad_step"]) == 0
    assert all(np.isfinite(v).all() for v in last.tensors.values())


class DiesAt(RandomBatches):
    """Random batches that stop the run (as a crash would) when batch `dies` is asked for."""

    def __init__(self, *args, dies: int, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.dies = dies

    def global_batch(self, epoch: int, index: int):
        if epoch * self.batches_per_epoch + index == self.dies:
            raise RuntimeError("the machine went away")
        return super().global_batch(epoch, index)


@pytest.mark.slow  # trains: compiles a training step
@pytest.mark.parametrize(("model", "loss"), [(MICRO, "clip"), (MICRO_SIGLIP_PD, "siglip")],
                         ids=["clip", "siglip-patch-dropout"])
def test_a_run_resumed_from_a_checkpoint_ends_bitwise_where_an_uninterrupted_one_does(
        tmp_path, model, loss):
    cfg = TrainConfig(model=model, batch_size=4, max_steps=6, lr=2e-3, warmup_steps=2,
                      checkpoint_every=3, log_every=4, accum_steps=2, loss=loss)
    whole = train(cfg, RandomBatches(model, 4, 12, seed=2), tmp_path / "whole")
    folder = tmp_path / "resumed"
    with pytest.raises(RuntimeError, match="went away"):  # during step 5 (micro-batches 8, 9)
        train(cfg, DiesAt(model, 4, 12, seed=2, dies=8), folder)
    assert checkpoint.load_latest(folder).meta["step"] == 3
    resumed = train(cfg, RandomBatches(model, 4, 12, seed=2), folder)
    assert [r["step"] for r in resumed.history] == list(range(1, 7))
    assert [r["loss"] for r in resumed.history] == [r["loss"] for r in whole.history]
    want = dict(whole.model.parameters_and_names())
    for name, param in resumed.model.parameters_and_names():
        np.testing.assert_array_equal(param.asnumpy(), want[name].asnumpy(), err_msg=name)
    if model.vision.patch_dropout:  # one draw per micro-batch forward, counted across the resume
        assert int(want["visual.patch_dropout.draws"].asnumpy()) == 12
        assert whole.summary["logit_bias"] != -10.0  # SigLIP's bias trains


@pytest.mark.slow  # compiles a training step in graph mode: ~10 CPU-s
@pytest.mark.parametrize("mode", ["graph"], indirect=True)
def test_patch_dropout_draws_once_per_forward_and_the_loss_is_the_gradients_loss(mode):
    """A graph-mode step runs its forward once (the loss it returns and the gradient share the
    draw): one step, one draw; and that loss is what the same draw's forward gives."""
    from clipms.model.patch_dropout import start_patch_dropout
    from clipms.train.loss import SigLipLoss
    from clipms.train.step import ClipWithLoss

    cfg = TrainConfig(model=MICRO_SIGLIP_PD, batch_size=4, max_steps=1, loss="siglip", lr=0.0,
                      warmup_steps=1)
    ms.set_seed(0)
    run = Training.build(cfg, 1)
    images, tokens = next(iter(RandomBatches(MICRO_SIGLIP_PD, 4, 1).stream(0, 1)))
    images = Tensor(images.astype(np.float32) / 255)
    loss, *_ = run.step_cell(images, Tensor(tokens))
    assert int(run.model.visual.patch_dropout.draws.asnumpy()) == 1
    ms.set_seed(0)
    again = CLIP(MICRO_SIGLIP_PD)  # the same initial weights; lr 0 left the trained ones there
    start_patch_dropout(again, seed=cfg.seed)
    forward = ClipWithLoss(again, SigLipLoss()).set_train(True)
    assert float(forward(images, Tensor(tokens)).asnumpy()) == float(loss.asnumpy())
    unseen = float(forward(images, Tensor(tokens)).asnumpy())  # draw 1: other patches
    assert unseen != float(loss.asnumpy())


@pytest.mark.parametrize("mode", ["pynative"], indirect=True)
def test_patch_dropout_refuses_pynative_mode(mode):
    """A PyNative step runs the forward twice: its gradient would see another draw than its
    loss, so training with patch dropout there stops, naming the setting to change."""
    cfg = TrainConfig(model=MICRO_SIGLIP_PD, batch_size=4, max_steps=1, loss="siglip")
    with pytest.raises(ValueError, match="patch_dropout needs runtime.mode: graph"):
        Training.build(cfg, 1)


def test_the_loss_and_the_models_logit_bias_must_agree():
    with pytest.raises(ValueError, match="train.loss='siglip' needs a model with a logit bias"):
        TrainConfig(model=MICRO, loss="siglip")
    with pytest.raises(ValueError, match="train.loss='clip' but the model has init_logit_bias"):
        TrainConfig(model=MICRO_SIGLIP_PD)
    assert TrainConfig(model=MICRO_SIGLIP_PD, loss="siglip").model.init_logit_bias == -10.0


@pytest.mark.slow  # trains: compiles a training step
def test_locked_image_tower_does_not_move_and_text_tower_does():
    cfg = TrainConfig(model=MICRO, batch_size=4, epochs=1, lr=1e-2, warmup_steps=1,
                      lock_image=True, checkpoint_every=100)
    ms.set_seed(cfg.seed)
    before = {n: p.asnumpy().copy() for n, p in CLIP(MICRO).parameters_and_names()}
    result = train(cfg, RandomBatches(MICRO, 4, 2), None)
    after = {n: p.asnumpy() for n, p in result.model.parameters_and_names()}
    moved = {n for n in before if not np.array_equal(before[n], after[n])}
    assert moved and not any(n.startswith("visual.") for n in moved)
    assert any(n.startswith("text.") for n in moved)


@pytest.mark.slow  # trains: compiles a training step
def test_amp_runs_on_cpu_with_a_dynamic_loss_scale():
    cfg = TrainConfig(model=MICRO, batch_size=4, epochs=1, lr=1e-3, warmup_steps=1,
                      precision="amp", loss_scale_window=2)
    result = train(cfg, RandomBatches(MICRO, 4, 3), None)
    losses = [row["loss"] for row in result.history]
    assert len(losses) == 3 and all(math.isfinite(x) for x in losses)
    assert result.model.logit_scale.dtype == ms.float32  # master weights stay fp32
    names = [name for name, _ in result.model.parameters_and_names()]
    ms.set_seed(0)
    assert names == [name for name, _ in CLIP(MICRO).parameters_and_names()]  # CLIP's own names


@pytest.mark.slow  # trains: compiles a training step
def test_checkpoints_of_another_config_are_set_aside_not_resumed(tmp_path, caplog):
    folder = tmp_path / "ckpt"
    cfg = TrainConfig(model=MICRO, batch_size=4, epochs=1, lr=1e-3, warmup_steps=1,
                      checkpoint_every=1)
    train(cfg, RandomBatches(MICRO, 4, 2), folder)
    assert [p.name for p in checkpoint.list_checkpoints(folder)] == [
        "step-00000001.ckpt", "step-00000002.ckpt"]
    other = TrainConfig(**{**cfg.__dict__, "lr": 2e-3, "max_steps": 1})
    with caplog.at_level("WARNING", logger="clipms.train.loop"):
        result = train(other, RandomBatches(MICRO, 4, 2), folder)
    assert "belong to another configuration" in caplog.text
    assert [row["step"] for row in result.history] == [1]  # trained from scratch
    saved = checkpoint.list_checkpoints(folder)
    assert [p.name for p in saved] == ["step-00000001.ckpt"]
    assert checkpoint.load(saved[0]).meta["fingerprint"] == other.fingerprint()


@pytest.mark.slow  # starts a process per rank
def test_rank_0_sets_stale_checkpoints_aside_only_after_every_rank_has_read_the_folder(tmp_path):
    # Data parallel: every rank reads the folder (load_latest), then rank 0 moves a stale set
    # aside. The barrier (clipms.train.collectives.barrier under msrun) is what keeps rank 0 from
    # moving files another rank is still reading; here it records what it finds in place.
    folder = tmp_path / "ckpt"
    cfg = TrainConfig(model=MICRO, batch_size=4, max_steps=1, lr=1e-3, warmup_steps=1)
    train(cfg, RandomBatches(MICRO, 4, 2), folder)
    other = Training.build(TrainConfig(**{**cfg.__dict__, "lr": 2e-3}), 1)
    at_barrier = []
    other.resume_or_start(folder, True, barrier=lambda: at_barrier.append(
        [p.name for p in checkpoint.list_checkpoints(folder)]))
    assert at_barrier == [["step-00000001.ckpt"]]  # all still in place while ranks read
    assert checkpoint.list_checkpoints(folder) == [] and len(checkpoint.stale_sets(folder)) == 1


def test_the_fingerprint_covers_every_setting_but_the_cadence_ones():
    cfg = TrainConfig(model=MICRO)
    values = {"precision": "amp", "batch_size": 3, "accum_steps": 2, "epochs": 2, "max_steps": 5,
              "lr": 1e-3, "warmup_steps": 1, "weight_decay": 0.1, "decay_embeddings": False,
              "betas": (0.8, 0.9), "eps": 1e-8, "grad_clip_norm": 2.0, "loss_scale": 8.0,
              "loss_scale_window": 3, "seed": 1, "augment": True, "decode": "cpu",
              "group_by": ("colour",), "group_fraction": 0.25, "loss": "siglip",
              "lock_image": True, "lock_text": True, "init_from": "x.ckpt",
              "workers": 7, "checkpoint_every": 1, "keep_checkpoints": 9, "log_every": 1,
              "max_skipped_share": 0.5, "max_nonfinite_steps": 1}
    assert set(values) == set(TrainSettings.model_fields)  # every setting of the schema is here
    cadence = {"workers", "checkpoint_every", "keep_checkpoints", "log_every",
               "max_skipped_share", "max_nonfinite_steps"}  # alarms stop a run, change no weight
    for name, value in values.items():
        changed = cfg.model_copy(update={name: value}).fingerprint() != cfg.fingerprint()
        assert changed is (name not in cadence), name
    for update in ({"runtime": RuntimeConfig(kernel_fusion=False)},
                   {"data_fingerprint": "other"},
                   {"model": CLIPConfig(embed_dim=8, vision=MICRO.vision, text=MICRO.text)}):
        assert cfg.model_copy(update=update).fingerprint() != cfg.fingerprint()
    assert cfg.model_copy(update={"runtime": RuntimeConfig(device_id=3)}).fingerprint() == (
        cfg.fingerprint())  # which device of the host: the same weights


def test_the_sink_dataset_holds_the_streams_batches_unchanged_in_order_from_any_start():
    source = RandomBatches(MICRO, 4, 6, seed=3)
    dataset = sink_dataset(source, 5, 9)  # a resumed run's remaining batches, across an epoch
    assert dataset.get_dataset_size() == 4
    got = list(dataset.create_tuple_iterator(num_epochs=1, output_numpy=True))
    want = list(source.stream(5, 9))
    assert len(got) == len(want) == 4
    for (images, tokens), (want_images, want_tokens) in zip(got, want, strict=True):
        assert (images.dtype, tokens.dtype) == (np.uint8, np.int32)  # uint8 to the device
        np.testing.assert_array_equal(images, want_images)
        np.testing.assert_array_equal(tokens, want_tokens)


def test_mindspore_sinks_no_data_on_cpu_so_the_cpu_loop_feeds_from_the_host():
    # The reason clipms.runtime selects data_sink on Ascend/GPU only: on CPU MindSpore refuses it.
    with pytest.raises(ValueError, match="supports ascend or gpu"):
        ms.data_sink(lambda images, tokens: images, sink_dataset(RandomBatches(MICRO, 4, 2), 0, 2))
    run = Training.build(TrainConfig(model=MICRO, batch_size=4, max_steps=2), 2)
    assert not run.data_sink and isinstance(run.feed(RandomBatches(MICRO, 4, 2), 2), HostFeed)
