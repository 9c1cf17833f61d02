"""MindIR export: the bundle's files and description, and the parity check against the checkpoint
(real MindSpore graphs: export, ms.load + nn.GraphCell, and the checkpoint's model)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from clipms.data.preprocess import preprocess_image
from clipms.text.tokenizer import Tokenizer
from clipms.train.trained import RunConfig, TrainedModelError, load_clip
from tests.tiny_model import CAPTIONS, random_images, write_trained

BATCH_SIZES = (1, 3, 8)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    folder = tmp_path_factory.mktemp("trained")
    return {"a": write_trained(folder / "a", seed=0), "b": write_trained(folder / "b", seed=1)}


@pytest.fixture(scope="module")
def exported(trained, tmp_path_factory):
    from clipms.deploy.export import export_bundle

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


def test_lite_config_for_ascend_has_the_dynamic_batch_profiles_and_precision(exported):
    from clipms.deploy.export import lite_ascend_config

    _, bundle, _ = exported
    cfg = lite_ascend_config(bundle, "image_encoder", [8, 1, 32, 8])
    name = bundle["image_encoder"]["input"]["graph_name"]
    assert cfg == (f"[ascend_context]\ninput_shape={name}:[-1,3,32,32]\n"
                   "dynamic_dims=[1],[8],[32]\nprecision_mode=preferred_fp32\n")
    assert "precision_mode=enforce_origin" in lite_ascend_config(
        {**bundle, "precision": "fp16"}, "text_encoder", [1])
    assert "input_shape=" + bundle["text_encoder"]["input"]["graph_name"] + ":[-1,16]" in (
        lite_ascend_config(bundle, "text_encoder", [1, 4]))


def test_parity_passes_at_every_batch_size(exported, trained):
    from clipms.deploy.export import assert_parity, parity_report

    out, _, run = exported
    net = load_clip(trained["a"]["checkpoint"], run.model)
    images, tokens = sample_inputs(run, trained["a"]["tokenizer"])
    report = parity_report(net, out, images, tokens, BATCH_SIZES, tolerance=1e-5)
    assert report["passed"], report
    assert set(report) >= {f"image_max_abs_error_b{b}" for b in BATCH_SIZES}
    assert report["text_max_abs_error"] <= 1e-5 and report["image_max_abs_error"] <= 1e-5
    assert_parity(report)  # does not raise


def test_the_host_parity_runs_on_cpu_in_a_process_of_its_own_and_gives_this_ones(
        exported, trained):
    # What the export stage gates on when it runs on an NPU: the bar's own machine, the host CPU.
    from clipms.deploy.export import parity_report
    from clipms.deploy.hostparity import host_parity

    out, _, run = exported
    net = load_clip(trained["a"]["checkpoint"], run.model)
    images, tokens = sample_inputs(run, trained["a"]["tokenizer"])
    here = parity_report(net, out, images, tokens, (1, 3))
    host = host_parity(out, trained["a"]["checkpoint"], run.model, images, tokens, (1, 3))
    assert host.pop("parity_device") == "CPU (host)"
    assert host == here and host["passed"]
    wrong = host_parity(out, trained["b"]["checkpoint"], run.model, images, tokens, (1,))
    assert not wrong["passed"]  # it checks the checkpoint it is given


def test_a_different_checkpoint_fails_the_parity_check(exported, trained):
    from clipms.deploy.export import ParityError, assert_parity, parity_report

    out, _, run = exported
    other = load_clip(trained["b"]["checkpoint"], run.model)  # same architecture, other weights
    images, tokens = sample_inputs(run, trained["a"]["tokenizer"])
    report = parity_report(other, out, images, tokens, BATCH_SIZES, tolerance=1e-5)
    assert not report["passed"]
    assert report["image_max_abs_error"] > 1e-3 and report["text_max_abs_error"] > 1e-3
    with pytest.raises(ParityError, match="image_max_abs_error_b1"):
        assert_parity(report)


def test_fp16_bundle_is_half_the_size_and_meets_its_own_bar_not_the_fp32_one(exported, trained,
                                                                             tmp_path):
    from clipms.deploy.export import PARITY, assert_parity, export_bundle, parity_report

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


def test_stage_exports_checks_and_records_the_errors(tmp_path):
    import json

    from tests.tiny_model import make_val_shards
    from tests.workspace import PROJECT_ROOT, run, tool_env

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


def test_bench_encode_bundle_and_retrieval_report_rates(exported):
    import contextlib
    import io
    import json

    from clipms.bench import main

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


@pytest.mark.slow
def test_dvc_repro_to_export_on_the_tiny_synthetic_config(tmp_path):
    """The real pipeline (metadata .. train, evaluate, export) in a fresh git + DVC workspace."""
    import json

    from tests.workspace import make_workspace, run

    ws = make_workspace(tmp_path / "ws")
    # evaluate and export are sibling stages after train (register needs both)
    run(["dvc", "repro", "evaluate", "export"], cwd=ws, timeout=900)
    found = json.loads((ws / "metrics" / "eval.json").read_text())
    keys = ["i2t_R@1", "i2t_R@5", "i2t_R@10", "t2i_R@1", "t2i_R@5", "t2i_R@10", "mAP@10",
            "zeroshot_top1", "zeroshot_top5", "zeroshot_mean_per_class_recall", "num_images",
            "num_captions"]
    assert all(0.0 <= found[k] <= 1.0 for k in keys[:10]), found
    assert found["num_captions"] >= found["num_images"] > 0
    exported = json.loads((ws / "metrics" / "export.json").read_text())
    assert exported["passed"] is True and exported["image_max_abs_error"] <= 1e-5

    shown = json.loads(run(["dvc", "metrics", "show", "--json"], cwd=ws).stdout)
    workspace_metrics = shown[""]["data"]  # DVC 3 keys the working tree as ""
    eval_entry = workspace_metrics["metrics/eval.json"]["data"]
    assert set(keys) <= set(eval_entry)
    assert "text_max_abs_error" in workspace_metrics["metrics/export.json"]["data"]
    # Up to date: a second repro runs nothing.
    again = run(["dvc", "repro", "evaluate", "export"], cwd=ws, timeout=300)
    assert "Running stage" not in again.stdout
    hits = run(["python", "-m", "clipms.deploy.infer", "search", "--bundle", "models/export",
                "--shards", "data/shards/val", "--top", "3", "a red circle"], cwd=ws)
    assert len(hits.stdout.strip().splitlines()) == 4
