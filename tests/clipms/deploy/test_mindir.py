"""MindIR export: the bundle's files and description, and the parity check against the checkpoint
(real MindSpore graphs: export, ms.load + nn.GraphCell, and the checkpoint's model)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pytest

from clipms.data.preprocess import preprocess_image
from clipms.text.clip_tokenizer import Tokenizer
from clipms.train.trained import RunConfig, TrainedModelError, load_clip
from harness.tiny_model import CAPTIONS, random_images, write_trained

BATCH_SIZES = (1, 3, 8)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    folder = tmp_path_factory.mktemp("trained")
    return {"a": write_trained(folder / "a", seed=0), "b": write_trained(folder / "b", seed=1)}


@pytest.fixture(scope="module")
def exported(trained, tmp_path_factory):
    from clipms.deploy.mindir import export_bundle

    paths = trained["a"]
    run = RunConfig.read(paths["config"])
    net = load_clip(paths["checkpoint"], run.model)
    out = tmp_path_factory.mktemp("export") / "bundle"
    bundle = export_bundle(net, run.preprocess, paths["tokenizer"], out)
    return out, bundle, run


def sample_inputs(run, tokenizer_path, n=5):
    images = np.stack([preprocess_image(im, run.preprocess) for im in random_images(n)])
    tokens = Tokenizer.load(tokenizer_path).encode(CAPTIONS[:n])
    return images, tokens


@pytest.mark.slow  # exports MindIR
def test_bundle_has_every_file_and_describes_dynamic_batch_inputs(exported, trained):
    out, bundle, run = exported
    names = sorted(p.name for p in out.iterdir())
    assert names == ["bundle.json", "image_encoder.mindir", "preprocess.json",
                     "text_encoder.mindir", "tokenizer.json"]
    assert bundle["image_encoder"]["input"]["shape"] == [None, 3, 32, 32]
    assert bundle["text_encoder"]["input"]["shape"] == [None, 16]
    assert bundle["text_encoder"]["input"]["dtype"] == "int32"
    assert bundle["image_encoder"]["output"]["shape"] == [None, 32]
    assert bundle["preprocess"] == run.preprocess.to_dict()
    assert (out / "tokenizer.json").read_bytes() == trained["a"]["tokenizer"].read_bytes()
    assert bundle["logit_scale"] == pytest.approx(1 / 0.07, rel=1e-5)
    # the names MindSpore gave the graphs' inputs, as read back from the files
    assert bundle["image_encoder"]["input"]["graph_name"].endswith(":images")
    assert bundle["text_encoder"]["input"]["graph_name"].endswith(":tokens")
    assert json.loads((out / "bundle.json").read_text()) == bundle


@pytest.mark.slow  # exports MindIR
def test_lite_config_for_ascend_has_the_dynamic_batch_profiles_and_precision(exported):
    from clipms.deploy.mindir import lite_ascend_config

    _, bundle, _ = exported
    cfg = lite_ascend_config(bundle, "image_encoder", [8, 1, 32, 8])
    name = bundle["image_encoder"]["input"]["graph_name"]
    assert cfg == (f"[ascend_context]\ninput_shape={name}:[-1,3,32,32]\n"
                   "dynamic_dims=[1],[8],[32]\nprecision_mode=preferred_fp32\n")
    assert "precision_mode=enforce_origin" in lite_ascend_config(
        {**bundle, "precision": "fp16"}, "text_encoder", [1])
    assert "input_shape=" + bundle["text_encoder"]["input"]["graph_name"] + ":[-1,16]" in (
        lite_ascend_config(bundle, "text_encoder", [1, 4]))


@pytest.mark.slow  # exports MindIR
def test_parity_passes_at_every_batch_size(exported, trained):
    from clipms.deploy.mindir import assert_parity, parity_report

    out, _, run = exported
    net = load_clip(trained["a"]["checkpoint"], run.model)
    images, tokens = sample_inputs(run, trained["a"]["tokenizer"])
    report = parity_report(net, out, images, tokens, BATCH_SIZES, tolerance=1e-5)
    assert report["passed"], report
    assert set(report) >= {f"image_max_abs_error_b{b}" for b in BATCH_SIZES}
    assert report["text_max_abs_error"] <= 1e-5 and report["image_max_abs_error"] <= 1e-5
    assert_parity(report)  # does not raise


@pytest.mark.slow  # exports MindIR, loads it in a second process
def test_the_host_parity_runs_on_cpu_in_a_process_of_its_own_and_gives_this_ones(
        exported, trained):
    # What the export stage gates on when it runs on an NPU: the bar's own machine, the host CPU.
    from clipms.deploy.hostparity import host_parity
    from clipms.deploy.mindir import parity_report

    out, _, run = exported
    net = load_clip(trained["a"]["checkpoint"], run.model)
    images, tokens = sample_inputs(run, trained["a"]["tokenizer"])
    here = parity_report(net, out, images, tokens, (1, 3))
    host = host_parity(out, trained["a"]["checkpoint"], run.model, images, tokens, (1, 3))
    assert host.pop("parity_device") == "CPU (host)"
    assert host == here and host["passed"]
    wrong = host_parity(out, trained["b"]["checkpoint"], run.model, images, tokens, (1,))
    assert not wrong["passed"]  # it checks the checkpoint it is given


@pytest.mark.slow  # exports MindIR
def test_a_different_checkpoint_fails_the_parity_check(exported, trained):
    from clipms.deploy.mindir import ParityError, assert_parity, parity_report

    out, _, run = exported
    other = load_clip(trained["b"]["checkpoint"], run.model)  # same architecture, other weights
    images, tokens = sample_inputs(run, trained["a"]["tokenizer"])
    report = parity_report(other, out, images, tokens, BATCH_SIZES, tolerance=1e-5)
    assert not report["passed"]
    assert report["image_max_abs_error"] > 1e-3 and report["text_max_abs_error"] > 1e-3
    with pytest.raises(ParityError, match="image_max_abs_error_b1"):
        assert_parity(report)


@pytest.mark.slow  # exports MindIR
def test_a_graph_below_its_checkpoint_everywhere_fails_the_parity_check(exported, trained):
    """The errors are absolute: a reference that is the bundle's own output plus 0.5 everywhere
    is 0.5 off (without `abs`, the max of got - want was -0.5, and it passed; a reference that
    differs both ways, as another checkpoint does, could not tell)."""
    from clipms.deploy.mindir import IMAGE_ENCODER, TEXT_ENCODER, load_graph, parity_report

    out, _, run = exported
    images, tokens = sample_inputs(run, trained["a"]["tokenizer"])
    image, text = load_graph(out / IMAGE_ENCODER), load_graph(out / TEXT_ENCODER)
    shifted = SimpleNamespace(encode_image=lambda x: image(x) + 0.5,
                              encode_text=lambda x: text(x) + 0.5)
    report = parity_report(shifted, out, images, tokens, (1, 3), tolerance=1e-5)
    for tower in ("image", "text"):
        for batch in (1, 3):
            assert report[f"{tower}_max_abs_error_b{batch}"] == pytest.approx(0.5, abs=1e-5)
        assert report[f"{tower}_max_abs_error_normalized"] > 1e-3
    assert report["passed"] is False


@pytest.mark.slow  # exports MindIR
def test_fp16_bundle_is_half_the_size_and_meets_its_own_bar_not_the_fp32_one(exported, trained,
                                                                             tmp_path):
    from clipms.deploy.mindir import PARITY, assert_parity, export_bundle, parity_report

    fp32_dir, fp32_bundle, run = exported
    paths = trained["a"]
    bundle = export_bundle(load_clip(paths["checkpoint"], run.model), run.preprocess,
                           paths["tokenizer"], tmp_path / "fp16", precision="fp16")
    assert bundle["precision"] == "fp16" and fp32_bundle["precision"] == "fp32"
    assert bundle["image_encoder"]["input"]["graph_name"].endswith(":images")
    assert bundle["parity"] == {"metric": "max_abs_error_normalized",
                                "tolerance": PARITY["fp16"].tolerance}
    assert bundle["logit_scale"] == fp32_bundle["logit_scale"]  # read before the fp16 cast
    for name in ("image_encoder.mindir", "text_encoder.mindir"):
        assert (tmp_path / "fp16" / name).stat().st_size < 0.7 * (fp32_dir / name).stat().st_size

    reference = load_clip(paths["checkpoint"], run.model)  # fp32, fresh from disk
    images, tokens = sample_inputs(run, paths["tokenizer"], n=8)
    report = parity_report(reference, tmp_path / "fp16", images, tokens, BATCH_SIZES, "fp16")
    assert report["passed"], report
    assert_parity(report)
    print({k: f"{v:.2e}" for k, v in report.items() if k.endswith("error")
           or k.endswith("normalized")})  # the measured errors (docs/ascend.md)
    for tower in ("image", "text"):
        assert 1e-5 < report[f"{tower}_max_abs_error_normalized"] <= PARITY["fp16"].tolerance
    strict = parity_report(reference, tmp_path / "fp16", images, tokens, BATCH_SIZES, "fp16",
                           tolerance=1e-5)
    assert not strict["passed"]  # fp16 is not fp32: it fails the fp32 bar


def test_a_checkpoint_of_another_architecture_is_a_clear_error(trained):
    import dataclasses

    run = RunConfig.read(trained["a"]["config"])
    wider = dataclasses.replace(run.model, embed_dim=48)
    with pytest.raises(TrainedModelError, match="has shape"):
        load_clip(trained["a"]["checkpoint"], wider)
    with pytest.raises(TrainedModelError, match="not found"):
        load_clip(trained["a"]["checkpoint"].with_name("missing.ckpt"), run.model)


@pytest.mark.slow  # exports MindIR
def test_stage_exports_checks_and_records_the_errors(tmp_path):
    import json

    from harness.dvc_workspace import PROJECT_ROOT, run, tool_env
    from harness.tiny_model import make_val_shards

    write_trained(tmp_path / "models", seed=0)  # laid out as the train stage leaves it
    make_val_shards(tmp_path / "data" / "shards")
    (tmp_path / "params.yaml").write_text("export:\n  batch_sizes: [1, 4, 16]\n")
    env = {**tool_env(), "PYTHONPATH": str(PROJECT_ROOT)}
    proc = run(["python", "-m", "stages.export"], cwd=tmp_path, timeout=600, env=env)
    assert "fp32 (trained fp32), max_abs_error image" in proc.stdout
    report = json.loads((tmp_path / "metrics" / "export.json").read_text())
    assert report["passed"] is True and report["tolerance"] == 1e-5
    assert (report["precision"], report["gate_metric"]) == ("fp32", "max_abs_error")
    assert report["parity_images"] == 11  # all val images (< 16), cycled up to batch 16
    for batch in (1, 4, 16):
        assert report[f"image_max_abs_error_b{batch}"] <= 1e-5
        assert report[f"text_max_abs_error_b{batch}"] <= 1e-5
    assert sorted(p.name for p in (tmp_path / "models" / "export").iterdir()) == [
        "bundle.json", "image_encoder.mindir", "preprocess.json", "text_encoder.mindir",
        "tokenizer.json"]
    # a rerun replaces the read-only MindIR files of the previous run
    run(["python", "-m", "stages.export"], cwd=tmp_path, timeout=600, env=env)

    (tmp_path / "params.yaml").write_text("export:\n  tolerance: -1\n")
    bad = run(["python", "-m", "stages.export"], cwd=tmp_path, timeout=600, check=False, env=env)
    assert bad.returncode == 1 and "export.tolerance" in bad.stderr

    # An amp-trained checkpoint (fp32 master weights) exported as fp32 meets the fp32 bar, and
    # the report says which precision trained it and which bar applied.
    run_config = tmp_path / "models" / "clip.json"
    run_config.write_text(json.dumps({**json.loads(run_config.read_text()),
                                      "train": {"precision": "amp"}}))
    (tmp_path / "params.yaml").write_text("export:\n  batch_sizes: [1, 4]\n")
    amp = run(["python", "-m", "stages.export"], cwd=tmp_path, timeout=600, env=env)
    assert "fp32 (trained amp), max_abs_error image" in amp.stdout
    report = json.loads((tmp_path / "metrics" / "export.json").read_text())
    assert (report["trained_precision"], report["precision"], report["tolerance"]) == (
        "amp", "fp32", 1e-5) and report["passed"] is True

    # A real parity failure -- an fp16 bundle held to the fp32 bar -- fails the stage (exit 1),
    # after recording the errors, so DVC and Prefect see it.
    (tmp_path / "params.yaml").write_text(
        "export:\n  precision: fp16\n  tolerance: 1.0e-5\n  batch_sizes: [1, 4]\n")
    failed = run(["python", "-m", "stages.export"], cwd=tmp_path, timeout=600, check=False,
                 env=env)
    assert failed.returncode == 1, failed.stdout + failed.stderr
    assert "export: FAILED: exported fp16 MindIR differs" in failed.stderr
    report = json.loads((tmp_path / "metrics" / "export.json").read_text())
    assert report["passed"] is False and report["precision"] == "fp16"
    assert report["image_max_abs_error_normalized"] > 1e-5  # really computed in fp16


@pytest.mark.slow  # exports MindIR
def test_bench_encode_bundle_and_retrieval_report_rates(exported):
    import contextlib
    import io
    import json

    from benchmarks.throughput import main

    out, _, _ = exported
    for argv in (["encode", "--bundle", str(out), "--batch-size", "4", "--warmup", "1",
                  "--steps", "2", "--mode", "pynative"],
                 ["retrieval", "--images", "50", "--dim", "8", "--repeats", "1"]):
        buffer = io.StringIO()
        with contextlib.redirect_stdout(buffer):
            assert main(argv) == 0
        result = json.loads(buffer.getvalue())
        if argv[0] == "encode":
            assert result["source"] == "mindir" and result["images_per_s"] > 0
            assert result["texts_per_s"] > 0 and result["cpu_ms_per_image"] > 0
            assert result["texts_per_s_mean"] > 0 and result["cpu_ms_per_text"] > 0
        else:
            assert result["captions"] == 250 and result["median_s"] > 0


# ---------------------------------------------------------------- export: the parity decision
# Edges `make mutation` (benchmarks/mutation.py) found untested; each docstring names the
# mutants (mutmut's names) the test kills.


def test_parity_errors_are_the_max_raw_and_max_normalised_differences():
    """clipms.deploy.mindir.x__errors__mutmut_* : which difference, which norm (per row, with the
    floor that keeps an all-zero row finite). Row 2's norm is under 1: a floor of 1 would change
    it."""
    import numpy as np

    from clipms.deploy.mindir import _errors

    got = np.array([[0.6, 0.8], [0.0, 0.0], [0.03, 0.04]], np.float32)
    want = np.array([[0.0, 2.0], [0.0, 0.0], [0.04, -0.03]], np.float32)
    errors = _errors(got, want)
    assert list(errors) == ["max_abs_error", "max_abs_error_normalized"]
    assert errors["max_abs_error"] == pytest.approx(1.2, rel=1e-6)  # row 0: |0.8 - 2.0|
    assert errors["max_abs_error_normalized"] == pytest.approx(1.4, rel=1e-6)  # row 2: |0.8+0.6|


def test_parity_failures_name_each_tower_and_batch_size_over_the_tolerance():
    """x_assert_parity__mutmut_* : only the gate metric's per-batch keys count (not the other
    metric, not the max over batches), an error equal to the tolerance passes, the message."""
    from clipms.deploy.mindir import ParityError, assert_parity

    report = {"precision": "fp16", "gate_metric": "max_abs_error_normalized", "tolerance": 2e-3,
              "batch_sizes": [1, 4], "image_max_abs_error_normalized_b1": 2e-3,
              "image_max_abs_error_normalized_b4": 0.0125, "image_max_abs_error_b1": 0.5,
              "image_max_abs_error_normalized": 0.0125, "text_max_abs_error_normalized_b1": 1e-3,
              "text_max_abs_error_normalized_b4": 0.25, "passed": False}
    with pytest.raises(ParityError) as err:
        assert_parity(report)
    assert str(err.value) == (
        "exported fp16 MindIR differs from the checkpoint beyond tolerance 0.002: "
        "image_max_abs_error_normalized_b4 = 0.0125, text_max_abs_error_normalized_b4 = 0.25")
    assert_parity({**report, "image_max_abs_error_normalized_b4": 2e-3,
                   "text_max_abs_error_normalized_b4": 0.0})  # at the tolerance: passes


def test_parity_inputs_are_cycled_up_to_the_batch_size():
    """x__cycle_rows__mutmut_1..3."""
    import numpy as np

    from clipms.deploy.mindir import _cycle_rows

    rows = np.arange(6).reshape(3, 2)
    assert _cycle_rows(rows, 5).tolist() == [[0, 1], [2, 3], [4, 5], [0, 1], [2, 3]]
    assert _cycle_rows(rows, 2).tolist() == [[0, 1], [2, 3]]


def _micro_clip(seed: int, embed_dim: int = 16):
    import mindspore as ms

    from clipms.model.architecture import CLIPConfig, TextConfig, VisionConfig
    from clipms.model.clip import CLIP

    ms.set_seed(seed)
    return CLIP(CLIPConfig(
        embed_dim=embed_dim,
        vision=VisionConfig(image_size=16, patch_size=8, width=32, layers=1, head_width=16),
        text=TextConfig(context_length=8, vocab_size=40, width=32, heads=2, layers=1)))


@pytest.fixture(scope="module")
def micro_bundle(tmp_path_factory):
    """A real MindIR bundle of a micro CLIP (seed 0), and inputs for its parity check."""
    import numpy as np

    import clipms  # noqa: F401  (MindSpore's environment first)
    from clipms.data.preprocess import PreprocessConfig
    from clipms.deploy.mindir import export_bundle

    root = tmp_path_factory.mktemp("micro-export")
    (root / "tokenizer.json").write_text("{}")  # copied into the bundle, not read
    export_bundle(_micro_clip(0), PreprocessConfig(image_size=16), root / "tokenizer.json",
                  root / "bundle")
    rng = np.random.default_rng(0)
    return (root / "bundle", rng.normal(size=(2, 3, 16, 16)).astype(np.float32),
            rng.integers(1, 40, size=(2, 8)).astype(np.int32))


@pytest.mark.slow  # exports MindIR
def test_parity_report_passes_its_own_checkpoint_and_fails_another(micro_bundle):
    """x_parity_report__mutmut_* : the report's keys and values (per tower, per batch size, the
    max over batch sizes), the bar of each precision, `passed` over both towers (all, <=), the
    empty-input (its whole message: x_parity_report__mutmut_11) and wrong-shape errors. Same
    weights and kernels: the fp32 errors are 0.0."""
    from clipms.deploy.mindir import ParityError, parity_report

    bundle, images, tokens = micro_bundle
    empty = "parity check needs at least one image and one caption"
    same = parity_report(_micro_clip(0), bundle, images, tokens, (1, 3), tolerance=0.0)
    metrics = ("max_abs_error", "max_abs_error_normalized")
    assert list(same) == ["precision", "gate_metric", "tolerance", "batch_sizes", *(
        f"{tower}_{m}{b}" for tower in ("image", "text")
        for b in ("_b1", "_b3", "") for m in metrics), "passed"]
    assert (same["precision"], same["gate_metric"], same["tolerance"], same["batch_sizes"],
            same["passed"]) == ("fp32", "max_abs_error", 0.0, [1, 3], True)
    assert {v for k, v in same.items() if k.endswith(metrics + ("_b1", "_b3"))} == {0.0}

    other = parity_report(_micro_clip(1), bundle, images, tokens, (1, 3))
    assert (other["tolerance"], other["passed"]) == (1e-5, False)
    for tower in ("image", "text"):
        for m in metrics:
            b1, b3 = other[f"{tower}_{m}_b1"], other[f"{tower}_{m}_b3"]
            # batch 3 adds the second row; its first row may round differently (fp32) than batch 1
            assert 0.1 < b1 <= b3 + 1e-5 and other[f"{tower}_{m}"] == max(b1, b3)
    # the max over batch sizes: batch 3's second row is the worse one in at least one tower
    assert max(other[f"{t}_max_abs_error_b3"] - other[f"{t}_max_abs_error_b1"]
               for t in ("image", "text")) > 0.1
    raw = sorted((other["image_max_abs_error"], other["text_max_abs_error"]))
    between = parity_report(_micro_clip(1), bundle, images, tokens, (1, 3),
                            tolerance=sum(raw) / 2)
    assert between["passed"] is False  # one tower within, the other not: fails
    assert parity_report(_micro_clip(1), bundle, images, tokens, (3,),
                         tolerance=raw[1] * 1.01)["passed"] is True
    fp16 = parity_report(_micro_clip(1), bundle, images, tokens, (1, 3), precision="fp16")
    assert (fp16["gate_metric"], fp16["tolerance"]) == ("max_abs_error_normalized", 2e-3)
    # the fp16 bar is on the normalised errors (under 1 here; the raw ones are over 2)
    normalised = max(other["image_max_abs_error_normalized"],
                     other["text_max_abs_error_normalized"])
    assert parity_report(_micro_clip(1), bundle, images, tokens, (1, 3), precision="fp16",
                         tolerance=normalised * 1.01)["passed"] is True

    with pytest.raises(ValueError, match=f"^{empty}$"):
        parity_report(_micro_clip(0), bundle, images[:0], tokens, (1,))
    with pytest.raises(ValueError, match=f"^{empty}$"):
        parity_report(_micro_clip(0), bundle, images, tokens[:0], (1,))
    with pytest.raises(ParityError) as err:
        parity_report(_micro_clip(0, embed_dim=8), bundle, images, tokens, (1,))
    assert str(err.value) == ("image encoder: MindIR output float32(1, 16) != checkpoint output "
                              "float32(1, 8) at batch size 1")
