"""Checkpoints: atomic writes and rotation; a real training process killed with SIGKILL mid-run and
resumed (`resume`) ends with the same weights as an uninterrupted run of the same seed."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

from clipms.train import checkpoint
from harness.dvc_workspace import checkpoint_arrays

PROJECT = Path(__file__).resolve().parents[3]

# A training process: micro CLIP, random batches (a function of seed and batch index) served with a
# little latency so that the kill lands mid-run, a checkpoint every 2 steps.
TRAIN_SCRIPT = textwrap.dedent("""
    import logging, sys, time
    import clipms
    from clipms.model.architecture import CLIPConfig, TextConfig, VisionConfig
    from clipms.train.loop import RandomBatches, TrainConfig, save_model, train

    class SlowBatches(RandomBatches):
        def global_batch(self, epoch, index):
            time.sleep(0.3)
            return super().global_batch(epoch, index)

    logging.basicConfig(level=logging.INFO, stream=sys.stdout, force=True)
    micro = CLIPConfig(
        embed_dim=16,
        vision=VisionConfig(image_size=16, patch_size=8, width=32, layers=1, head_width=16),
        text=TextConfig(context_length=8, vocab_size=40, width=32, heads=2, layers=1))
    cfg = TrainConfig(model=micro, batch_size=4, epochs=2, lr=2e-3, warmup_steps=2,
                      checkpoint_every=2, keep_checkpoints=2, accum_steps=2)
    result = train(cfg, SlowBatches(micro, 4, 10, seed=7), sys.argv[1], resume=True)
    save_model(result.model, sys.argv[2])
    print("DONE", result.history[-1]["loss"], flush=True)
""")


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(PROJECT), "GLOG_v": "3"}


def _start(script: Path, ckpt: Path, out: Path, log: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, str(script), str(ckpt), str(out)], cwd=PROJECT,
                            env=_env(), stdout=log.open("w"), stderr=subprocess.STDOUT)


@pytest.mark.slow
def test_sigkill_then_resume_reaches_the_uninterruptedcheckpoint_arrays(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(TRAIN_SCRIPT)
    # The reference and the run to kill start together (2 cores, both mostly wait on data).
    reference = _start(script, tmp_path / "ref_ckpt", tmp_path / "ref.ckpt", tmp_path / "ref.log")
    victim = _start(script, tmp_path / "ckpt", tmp_path / "victim.ckpt", tmp_path / "victim.log")
    try:
        deadline = time.monotonic() + 300
        while not (tmp_path / "ckpt" / "step-00000004.ckpt").exists():
            assert victim.poll() is None, (tmp_path / "victim.log").read_text()
            assert time.monotonic() < deadline, "no checkpoint at step 4 within 300 s"
            time.sleep(0.05)
        victim.send_signal(signal.SIGKILL)
        victim.wait(timeout=30)
        assert not (tmp_path / "victim.ckpt").exists()  # it really died before the end
        killed_at = [p.name for p in checkpoint.list_checkpoints(tmp_path / "ckpt")]
        assert "step-00000010.ckpt" not in killed_at
        resumed = _start(script, tmp_path / "ckpt", tmp_path / "victim.ckpt",
                         tmp_path / "resumed.log")
        assert resumed.wait(timeout=300) == 0, (tmp_path / "resumed.log").read_text()
        assert reference.wait(timeout=300) == 0, (tmp_path / "ref.log").read_text()
    finally:
        for proc in (reference, victim):
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    resumed_log = (tmp_path / "resumed.log").read_text()
    assert "resuming from" in resumed_log and "from step 0" not in resumed_log
    expected = checkpoint_arrays(tmp_path / "ref.ckpt")
    got = checkpoint_arrays(tmp_path / "victim.ckpt")
    assert expected.keys() == got.keys() and len(expected) > 10
    for name in expected:
        np.testing.assert_array_equal(got[name], expected[name], err_msg=name)
    # keep-the-last-2 rotation, and the history survives the kill (all 10 steps in the final one)
    final = checkpoint.list_checkpoints(tmp_path / "ckpt")
    assert [p.name for p in final] == ["step-00000008.ckpt", "step-00000010.ckpt"]
    history = checkpoint.load(final[-1]).meta["history"]
    assert [row["step"] for row in history] == list(range(1, 11))


def test_save_is_atomic_and_temp_files_of_dead_writers_are_ignored(tmp_path):
    folder = tmp_path / "ckpt"
    checkpoint.save(folder, 1, {"w": np.ones(3, np.float32)}, {"step": 1})

    class Exploding:
        def __array__(self, dtype=None, copy=None):
            raise RuntimeError("disk full")

    with pytest.raises(RuntimeError, match="disk full"):
        checkpoint.save(folder, 2, {"w": np.ones(3, np.float32), "x": Exploding()}, {"step": 2})
    assert [p.name for p in folder.iterdir()] == ["step-00000001.ckpt"]
    # what a writer killed mid-write leaves behind: a temp file, never a final-looking name
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = folder / f".step-00000002.ckpt.tmp-{dead.pid}-0badf00d.ckpt"
    stale.write_bytes(b"\x00" * 10)
    latest = checkpoint.load_latest(folder)
    assert latest is not None and latest.meta == {"step": 1}
    np.testing.assert_array_equal(latest.tensors["w"], np.ones(3, np.float32))
    for step in (3, 4, 5):
        checkpoint.save(folder, step, {"w": np.full(2, step, np.float32)}, {"step": step}, keep=2)
    assert sorted(p.name for p in folder.iterdir()) == ["step-00000004.ckpt", "step-00000005.ckpt"]


def test_a_corrupt_newest_checkpoint_falls_back_to_the_previous_one(tmp_path):
    checkpoint.save(tmp_path, 1, {"w": np.zeros(2, np.float32)}, {"step": 1})
    checkpoint.checkpoint_path(tmp_path, 2).write_bytes(b"not a checkpoint")
    latest = checkpoint.load_latest(tmp_path)
    assert latest is not None and latest.meta["step"] == 1


# A process that writes a good checkpoint of step 2, then rewrites step 2 and writes step 3 while
# the kernel refuses to grow any file past half the good file's size (RLIMIT_FSIZE: the write
# fails with EFBIG part-way through, as on a full disk). Each failure must leave nothing behind
# under a checkpoint's name and the good file untouched.
FAILING_WRITE = textwrap.dedent("""
    import resource, signal, sys
    import numpy as np
    from clipms.train import checkpoint

    folder, use_writer = sys.argv[1], sys.argv[2] == "writer"
    checkpoint.save(folder, 2, {"w": np.zeros(4096, np.float32)}, {"step": 2})
    size = checkpoint.checkpoint_path(folder, 2).stat().st_size
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG from write() instead of a kill
    resource.setrlimit(resource.RLIMIT_FSIZE, (size // 2, resource.RLIM_INFINITY))
    for step in (2, 3):
        try:
            if use_writer:
                writer = checkpoint.CheckpointWriter(folder, keep=5)
                writer.submit(step, {"w": np.ones(4096, np.float32)}, {"step": step})
                writer.close()
            else:
                checkpoint.save(folder, step, {"w": np.ones(4096, np.float32)}, {"step": step})
            print("SAVED", step)
        except Exception as err:
            print("FAILED", step, type(err).__name__)
""")


@pytest.mark.parametrize("how", ["save", "writer"])
@pytest.mark.slow  # trains, or starts a writer process
def test_a_write_that_fails_part_way_leaves_the_previous_checkpoint_intact(tmp_path, how):
    script = tmp_path / "fail.py"
    script.write_text(FAILING_WRITE)
    folder = tmp_path / "ckpt"
    proc = subprocess.run([sys.executable, str(script), str(folder), how], cwd=PROJECT,
                          env=_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    expected_error = "CheckpointWriteError" if how == "writer" else "OSError"
    assert f"FAILED 2 {expected_error}" in proc.stdout, proc.stdout + proc.stderr
    assert f"FAILED 3 {expected_error}" in proc.stdout, proc.stdout + proc.stderr
    # the good step-2 file is still there, whole, with its old values; no step-3 file exists
    assert [p.name for p in checkpoint.list_checkpoints(folder)] == ["step-00000002.ckpt"]
    good = checkpoint.load(checkpoint.checkpoint_path(folder, 2))
    np.testing.assert_array_equal(good.tensors["w"], np.zeros(4096, np.float32))
    # and whatever the failed writes left is a temp file, not a checkpoint
    assert all(p.name.startswith(".") for p in folder.iterdir() if p.name != "step-00000002.ckpt")




def _micro():
    from clipms.model.architecture import CLIPConfig, TextConfig, VisionConfig

    return CLIPConfig(
        embed_dim=16,
        vision=VisionConfig(image_size=16, patch_size=8, width=32, layers=1, head_width=16),
        text=TextConfig(context_length=8, vocab_size=40, width=32, heads=2, layers=1))


def _digests(folder: Path) -> dict[str, str]:
    import hashlib

    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest()
            for p in checkpoint.list_checkpoints(folder)}


@pytest.fixture
def restore_mode():
    """train() sets MindSpore's global execution mode; put back the one the next test expects."""
    import mindspore as ms

    previous = ms.get_context("mode")
    yield
    ms.set_context(mode=previous)


@pytest.mark.slow  # trains, or starts a writer process
def test_checkpoints_of_other_data_are_moved_aside_after_the_new_config_is_validated(
        tmp_path, caplog, restore_mode):
    from clipms.runtime import RuntimeConfig
    from clipms.train.loop import RandomBatches, TrainConfig, train

    micro, folder = _micro(), tmp_path / "ckpt"
    # PyNative: four short runs, no graph to compile for each
    first = TrainConfig(model=micro, batch_size=4, epochs=1, lr=1e-3, warmup_steps=1,
                        checkpoint_every=1, data_fingerprint="0123456789abcdef",
                        runtime=RuntimeConfig(mode="pynative"))
    train(first, RandomBatches(micro, 4, 2), folder)
    before = _digests(folder)
    assert list(before) == ["step-00000001.ckpt", "step-00000002.ckpt"]

    # Same config, other data: the run fails to start (no full batch), nothing is moved.
    other_data = TrainConfig(**{**first.__dict__, "data_fingerprint": "fedcba9876543210"})
    with pytest.raises(ValueError, match="not one optimizer step"):
        train(other_data, RandomBatches(micro, 4, 0), folder)
    assert _digests(folder) == before and checkpoint.stale_sets(folder) == []

    # It starts: the old set is moved, byte for byte, and the run does not resume from it.
    with caplog.at_level("WARNING", logger="clipms.train.loop"):
        result = train(other_data, RandomBatches(micro, 4, 2), folder)
    assert f"moved to {folder / ('stale-' + first.fingerprint())}" in caplog.text
    assert [row["step"] for row in result.history] == [1, 2]
    (stale,) = checkpoint.stale_sets(folder)
    assert stale.name == f"stale-{first.fingerprint()}" and _digests(stale) == before
    assert checkpoint.load_latest(folder).meta["fingerprint"] == other_data.fingerprint()

    # resume off: even matching checkpoints are set aside rather than overwritten
    train(other_data, RandomBatches(micro, 4, 2), folder, resume=False)
    assert [p.name for p in checkpoint.stale_sets(folder)] == [
        f"stale-{other_data.fingerprint()}", f"stale-{first.fingerprint()}"]


def test_only_the_newest_stale_sets_are_kept_and_names_never_collide(tmp_path):
    import os

    folder = tmp_path / "ckpt"
    assert checkpoint.set_aside(folder, "abc") is None  # nothing to move
    made = []
    for i, label in enumerate(["aaa", "bbb", "aaa", "../../etc", "ccc"]):
        checkpoint.save(folder, 1, {"w": np.full(2, i, np.float32)}, {"step": 1, "i": i})
        made.append(checkpoint.set_aside(folder, label, keep_sets=3))
        os.utime(made[-1], ns=(i * 10**9, i * 10**9))  # set-aside order, whatever the clock
    assert [p.name for p in made] == ["stale-aaa", "stale-bbb", "stale-aaa-2", "stale-unknown",
                                      "stale-ccc"]
    kept = checkpoint.stale_sets(folder)
    assert [p.name for p in kept] == ["stale-ccc", "stale-unknown", "stale-aaa-2"]
    for path, i in zip(kept, (4, 3, 2), strict=True):
        assert checkpoint.load(path / "step-00000001.ckpt").meta["i"] == i
    assert checkpoint.list_checkpoints(folder) == []


@pytest.mark.slow  # trains, or starts a writer process
def test_fingerprint_changes_with_the_data_and_data_fingerprint_covers_the_manifest(tmp_path):
    import json

    from clipms.train.job import data_fingerprint
    from clipms.train.loop import TrainConfig

    shards, tokenizer = tmp_path / "shards", tmp_path / "tokenizer.json"
    shards.mkdir()
    manifest = {"splits": {"train": {"samples": 8, "shards": [
        {"name": "train/000000.tar", "samples": 8, "sha256": "a" * 64}]}}}
    (shards / "manifest.json").write_text(json.dumps(manifest))
    tokenizer.write_text('{"kind": "bpe"}')
    base = data_fingerprint(shards, tokenizer)
    assert data_fingerprint(shards, tokenizer) == base  # a function of the files only

    manifest["splits"]["train"]["shards"][0]["sha256"] = "b" * 64  # one shard's bytes changed
    (shards / "manifest.json").write_text(json.dumps(manifest))
    changed_shards = data_fingerprint(shards, tokenizer)
    tokenizer.write_text('{"kind": "openai"}')
    changed_tokenizer = data_fingerprint(shards, tokenizer)
    assert len({base, changed_shards, changed_tokenizer}) == 3

    cfg = TrainConfig(model=_micro(), data_fingerprint=base)
    assert TrainConfig(**{**cfg.__dict__, "data_fingerprint": changed_shards}).fingerprint() \
        != cfg.fingerprint()
    # the cadence of checkpoints and logs does not change what is trained
    cadence = {"checkpoint_every": 7, "keep_checkpoints": 9, "log_every": 3}
    assert TrainConfig(**{**cfg.__dict__, **cadence}).fingerprint() == cfg.fingerprint()


# ---------------------------------------------------------------- checkpoint
# Edges `make mutation` (benchmarks/mutation.py) found untested; each docstring names the
# mutants (mutmut's names) the test kills.


def test_host_copies_are_this_instants_values():
    """clipms.train.checkpoint.x__host_copy__mutmut_1..6, x__as_tensor__mutmut_1: a Tensor's
    asnumpy() shares its memory (an in-place update, as an optimizer step makes, shows through it),
    and
    np.array(copy=False/None) of an array is the array: without the copies a checkpoint submitted
    before a step could hold the step's values."""
    import numpy as np

    import clipms  # noqa: F401  (MindSpore's environment first)

    # isort: split
    import mindspore as ms
    from mindspore import ops

    from clipms.train.checkpoint import _as_tensor, _host_copy

    param = ms.Parameter(ms.Tensor(np.zeros(3, np.float32)), name="w")
    host, tensor = _host_copy(param), _as_tensor(param)
    array = np.zeros(2, np.float32)
    array_copy, from_list = _host_copy(array), _host_copy([1.5, 2.5])
    ops.assign(param, ms.Tensor(np.ones(3, np.float32)))
    array[:] = 7
    assert host.tolist() == [0, 0, 0] and tensor.asnumpy().tolist() == [0, 0, 0]
    assert array_copy.tolist() == [0, 0] and array_copy.dtype == np.float32
    assert from_list.tolist() == [1.5, 2.5]


def test_the_writer_keeps_the_last_k_logs_each_write_and_can_be_waited_on_twice(
        tmp_path, caplog):
    """xǁCheckpointWriterǁ_write__mutmut_5/10 (keep dropped), 11-16 (the "saved" line),
    xǁCheckpointWriterǁwait__mutmut_2 (a second wait after the thread is gone),
    submit 14/18 (the thread's name), submit 20 (a daemon thread: the interpreter would not wait
    for a write in flight at exit)."""
    import numpy as np

    from clipms.train import checkpoint

    writer = checkpoint.CheckpointWriter(tmp_path, keep=2)
    with caplog.at_level("INFO", logger="clipms.train.checkpoint"):
        for step in (1, 2, 3):
            path = writer.submit(step, {"w": np.full(2, step, np.float32)}, {"step": step})
            assert path == checkpoint.checkpoint_path(tmp_path, step)
            assert writer._thread.name == f"clipms-checkpoint-{step}"
            assert not writer._thread.daemon
        writer.wait()
        writer.close()
    assert [p.name for p in checkpoint.list_checkpoints(tmp_path)] == [
        "step-00000002.ckpt", "step-00000003.ckpt"]
    assert [r.getMessage() for r in caplog.records if r.name == "clipms.train.checkpoint"] == [
        f"saved {checkpoint.checkpoint_path(tmp_path, s)}" for s in (1, 2, 3)]


def test_a_failed_background_write_is_raised_once_by_the_next_call(tmp_path):
    """xǁCheckpointWriterǁ_write__mutmut_17 (the error lost), wait__mutmut_4/5 (how it is
    raised, its message), submit__mutmut_6 (the path in it): the folder is a regular file, so the
    write fails (FileExistsError) on the writer's thread; `close` raises it, then it is gone."""
    import numpy as np

    from clipms.train import checkpoint

    folder = tmp_path / "not-a-folder"
    folder.write_text("a file")
    writer = checkpoint.CheckpointWriter(folder)
    writer.submit(4, {"w": np.zeros(2, np.float32)}, {"step": 4})
    with pytest.raises(checkpoint.CheckpointWriteError) as err:
        writer.close()
    assert str(err.value).startswith(f"writing {folder / 'step-00000004.ckpt'} failed: ")
    assert isinstance(err.value.__cause__, FileExistsError)
    writer.close()  # reported once


def test_the_writer_as_a_context_reports_its_error_unless_the_loop_failed(tmp_path, caplog):
    """xǁCheckpointWriterǁ__exit____mutmut_1..7: a clean exit raises the write's error; when the
    loop itself failed, the loop's error goes on and the write's is logged."""
    import numpy as np

    from clipms.train import checkpoint

    folder = tmp_path / "not-a-folder"
    folder.write_text("a file")
    tensors, meta = {"w": np.zeros(2, np.float32)}, {"step": 1}
    with pytest.raises(checkpoint.CheckpointWriteError), checkpoint.CheckpointWriter(folder) as w:
        w.submit(1, tensors, meta)
    with (caplog.at_level("ERROR", logger="clipms.train.checkpoint"),
          pytest.raises(KeyError, match="the loop"),
          checkpoint.CheckpointWriter(folder) as writer):
        writer.submit(1, tensors, meta)
        raise KeyError("the loop")
    (record,) = [r for r in caplog.records if r.name == "clipms.train.checkpoint"]
    assert record.getMessage().startswith(f"writing {folder / 'step-00000001.ckpt'} failed: ")
    with checkpoint.CheckpointWriter(tmp_path / "ok") as writer:  # a clean exit waits
        writer.submit(1, tensors, meta)
    assert checkpoint.load(checkpoint.checkpoint_path(tmp_path / "ok", 1)).meta == meta


def test_prune_keeps_at_least_one_and_load_names_a_foreign_checkpoint(tmp_path, caplog):
    """x_prune__mutmut_1..3 (keep=1 allowed, 0 refused with its message), x_load__mutmut_7/9/11
    (a MindSpore checkpoint without clipms' meta: a ValueError naming it; the path read back),
    x_load_latest__mutmut_5/6/10 (the warning about a skipped file)."""
    import numpy as np

    import clipms  # noqa: F401  (MindSpore's environment first)

    # isort: split
    import mindspore as ms

    from clipms.train import checkpoint

    for step in (1, 2):
        checkpoint.save(tmp_path, step, {"w": np.full(2, step, np.float32)}, {"step": step})
    checkpoint.prune(tmp_path, 1)
    assert [p.name for p in checkpoint.list_checkpoints(tmp_path)] == ["step-00000002.ckpt"]
    with pytest.raises(ValueError) as err:
        checkpoint.prune(tmp_path, 0)
    assert str(err.value) == "keep must be >= 1, got 0"
    kept = checkpoint.checkpoint_path(tmp_path, 2)
    assert checkpoint.load(kept).path == kept

    foreign = checkpoint.checkpoint_path(tmp_path, 3)
    ms.save_checkpoint([{"name": "w", "data": ms.Tensor(np.ones(2, np.float32))}], str(foreign))
    with pytest.raises(ValueError) as err:
        checkpoint.load(foreign)
    assert str(err.value) == f"{foreign}: not a clipms training checkpoint (no 'clipms_meta' entry)"
    with caplog.at_level("WARNING", logger="clipms.train.checkpoint"):
        assert checkpoint.load_latest(tmp_path).path == kept
    assert [r.getMessage() for r in caplog.records if r.name == "clipms.train.checkpoint"] == [
        f"skipping unreadable checkpoint {foreign}: {err.value}"]


def test_stale_sets_are_folders_with_the_prefix_and_removing_one_is_logged(tmp_path, caplog):
    """x_stale_sets__mutmut_5 (`and` -> `or`: any folder, or a file named stale-...),
    x_set_aside__mutmut_30..37 (the line that names a removed set)."""
    import numpy as np

    from clipms.train import checkpoint

    (tmp_path / "other").mkdir()
    (tmp_path / "stale-notes.txt").write_text("not a set")
    with caplog.at_level("INFO", logger="clipms.train.checkpoint"):
        for label in ("aaa", "bbb"):
            checkpoint.save(tmp_path, 1, {"w": np.zeros(2, np.float32)}, {"step": 1})
            checkpoint.set_aside(tmp_path, label, keep_sets=1)
    assert [p.name for p in checkpoint.stale_sets(tmp_path)] == ["stale-bbb"]
    assert (tmp_path / "other").is_dir() and (tmp_path / "stale-notes.txt").is_file()
    assert [r.getMessage() for r in caplog.records if r.name == "clipms.train.checkpoint"] == [
        f"removed {tmp_path / 'stale-aaa'} (only the newest 1 stale checkpoint sets are kept)"]
