"""How a failed night is named in its notice: the stage, the kind, the reason line, what to do.

The outputs below are the lines DVC and the stages print for each failure (DVC's own summary line
is verbatim; the stage lines are the project's messages and Python's)."""

from __future__ import annotations

from flows.night import NightFailed, diagnose

FAILED = ("ERROR: failed to reproduce '{stage}': failed to run: python -m stages.{stage}, "
          "exited with {code}")


def output(stage: str, *lines: str, code: int = 1) -> str:
    return "\n".join([f"Running stage '{stage}':", f"> python -m stages.{stage}", *lines,
                      FAILED.format(stage=stage, code=code)])


def test_a_killed_stage_is_named_killed_with_the_exit_line() -> None:
    found = diagnose("train", output("train", "step 3 loss 4.1", code=-9))
    assert (found.kind, found.stage) == ("killed", "train")
    assert "exited with -9" in found.reason and "resumes" in found.advice


def test_a_full_disk_wins_over_the_stage_it_happened_in() -> None:
    found = diagnose("export", output("export", 'File "x.py", line 3, in save',
                                      "OSError: [Errno 28] No space left on device"))
    assert found.kind == "disk full"
    assert found.reason == "OSError: [Errno 28] No space left on device"
    capped = diagnose("shard", output("shard", "OSError: [Errno 27] File too large"))
    assert capped.kind == "disk full"  # a file-size limit (RLIMIT_FSIZE, a quota) reads the same


def test_a_diverging_training_names_the_step_and_says_what_to_lower() -> None:
    message = ("clipms.train.loop.NonFiniteLossError: loss is nan at step 7 (epoch 0); stopping. "
               "Nothing of step 7 or later was saved")
    found = diagnose("train", output("train", message))
    assert found.kind == "diverging training" and "step 7" in found.reason
    assert "train.lr" in found.advice


def test_a_refused_connection_is_the_registry_after_training_and_the_source_before() -> None:
    refused = "urllib.error.URLError: <urlopen error [Errno 111] Connection refused>"
    assert diagnose("register", output("register", refused)).kind == "registry outage"
    assert diagnose("metadata", output("metadata", refused)).kind == "broken source"


def test_an_unknown_failure_names_its_last_error_line_and_the_command_to_reproduce() -> None:
    found = diagnose("index", output("index", "index: error: bundle has no embeddings"))
    assert found.kind == "stage failed"
    assert found.reason == "index: error: bundle has no embeddings"
    assert "dvc repro index" in found.advice
    source = diagnose("metadata", output("metadata", "metadata: error: no column 'TEXT'"))
    assert (source.kind, source.reason) == ("broken source", "metadata: error: no column 'TEXT'")


def test_a_failed_night_keeps_the_stage_own_words_after_the_diagnosis() -> None:
    """A params error spans lines; the reason holds one, the failure (and its notice) all."""
    text = output("train", "train: error: params.yaml: invalid 'train' params:",
                  "  train.epochs = 'many': Input should be a valid integer")
    failed = NightFailed(diagnose("train", text), text)
    assert str(failed).startswith("stage 'train': stage failed: train: error: params.yaml")
    assert "train.epochs = 'many'" in str(failed) and failed.diagnosis.stage == "train"
