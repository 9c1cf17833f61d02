"""Shard stage: per-sample checks, corrupt input tars, deterministic output, the manifest."""

from __future__ import annotations

import hashlib
import io
import json
import shutil
import tarfile
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from clipms.data import webds
from harness.input_tars import good, image_bytes, meta, quiet, write_tar
from pipeline.params import ParamsError, load_section
from prep.shards import ShardError, ShardSettings, build_shards
from stages.shard import ShardParams


def read_output(folder: Path) -> dict[str, dict]:
    samples: dict[str, dict] = {}
    for tar_path in sorted(folder.glob("*/*.tar")):
        found = webds.read_tar(tar_path)
        with tarfile.open(tar_path) as tar:  # fixed headers, each sample's members together
            assert tar.getnames() == [f"{s.key}.{ext}" for s in found for ext in s.files]
            assert all(m.mtime == 0 and m.uid == 0 and m.uname == "" for m in tar)
        for sample in found:
            assert list(sample.files) == ["jpg", "json", "txt"]
            samples[sample.key] = {"tar": tar_path.relative_to(folder).as_posix(),
                                   "jpg": sample.files["jpg"], "json": sample.meta,
                                   "txt": sample.files["txt"]}
    return samples


def noisy_jpeg(size=(64, 64)) -> bytes:
    """A JPEG whose entropy-coded data is most of the file (flat colours compress to ~nothing)."""
    pixels = np.random.default_rng(0).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="JPEG", quality=95)
    return out.getvalue()


def cut_in_image_data() -> bytes:
    """A JPEG cut inside its scan data: the header still parses, only a full decode fails."""
    data = noisy_jpeg()
    truncated = data[: len(data) * 2 // 3]
    with Image.open(io.BytesIO(truncated)) as image:
        assert image.size == (64, 64)  # Image.open alone would accept it
    return truncated


def test_bad_samples_are_dropped_and_counted(tmp_path):
    src = tmp_path / "download"
    src.mkdir()
    bad = [
        {"__key__": "000000100", "jpg": image_bytes(size=(31, 64)), "json": json.dumps(meta(100))},
        {"__key__": "000000101", "jpg": b"not an image", "json": json.dumps(meta(101))},
        {"__key__": "000000102", "jpg": cut_in_image_data(), "json": json.dumps(meta(102))},
        {"__key__": "000000103", "jpg": image_bytes(), "txt": " ",
         "json": json.dumps(meta(103, captions=["", "  "]))},
        {"__key__": "000000104", "jpg": image_bytes(), "json": json.dumps(meta(104, split=None))},
        {"__key__": "000000105", "jpg": image_bytes(), "json": "{not json"},
        {"__key__": "000000106", "txt": "caption", "json": json.dumps(meta(106))},
    ]
    # Keys that would name a path (or are not in the loader's key format) never become members.
    bad_keys = [{"__key__": f"00000020{n}", "jpg": image_bytes(),
                 "json": json.dumps({**meta(200 + n), "image_key": key})}
                for n, key in enumerate(["../../etc/evil", "a/b", "a.b", "", None, "x" * 129])]
    edge = {"__key__": "000000108", "jpg": image_bytes(size=(32, 40)),  # exactly min_image_size
            "json": json.dumps(meta(108))}
    png = {"__key__": "000000107", "png": image_bytes(fmt="PNG"), "json": json.dumps(meta(107))}
    write_tar(src / "00000.tar", [good(0), good(1, "val"), *bad, *bad_keys, edge, png])
    write_tar(src / "00001.tar", [good(2), good(0)])  # good(0) again: a duplicate key
    metrics = build_shards(src, tmp_path / "shards", ShardSettings(samples_per_shard=2,
                                                                   workers=1), quiet)
    assert metrics["dropped"] == {
        "missing_image": 1, "undecodable_image": 2, "too_large": 0, "too_small": 1,
        "no_caption": 1, "missing_split": 1, "bad_metadata": 1, "bad_key": 6, "duplicate_key": 1,
        "not_in_tar": 0,
    }
    assert metrics["samples_in"] == 19 and metrics["samples_out"] == 5
    out = read_output(tmp_path / "shards")
    assert set(out) == {f"{i:016x}" for i in (0, 1, 2, 107, 108)}
    assert (metrics["train"]["samples"], metrics["val"]["samples"]) == (4, 1)
    png = Image.open(io.BytesIO(out[f"{107:016x}"]["jpg"]))
    assert png.format == "JPEG" and png.size == (64, 64)  # a PNG input is converted to JPEG
    for tar_path in (tmp_path / "shards").glob("*/*.tar"):
        with tarfile.open(tar_path) as tar:
            assert all("/" not in n and ".." not in n for n in tar.getnames())


def test_truncated_input_tar_is_reported_and_skipped(tmp_path):
    src = tmp_path / "download"
    src.mkdir()
    write_tar(src / "00000.tar", [good(i) for i in range(4)])
    write_tar(src / "00001.tar", [good(i) for i in range(4, 8)])
    write_tar(src / "00002.tar", [good(i) for i in range(8, 12)])
    whole = (src / "00001.tar").read_bytes()
    (src / "00001.tar").write_bytes(whole[: len(whole) // 3])          # cut inside a member
    with tarfile.open(src / "00002.tar") as tar:
        members = tar.getmembers()
    boundary = members[3].offset                                        # cut between members
    (src / "00002.tar").write_bytes((src / "00002.tar").read_bytes()[:boundary])
    lines: list[str] = []
    metrics = build_shards(src, tmp_path / "shards", ShardSettings(workers=1), lines.append)
    assert metrics["input_shards"] == 3 and metrics["input_shards_corrupt"] == 2
    assert [c.split(":")[0] for c in metrics["corrupt_input_shards"]] == ["00001.tar", "00002.tar"]
    assert metrics["samples_in"] == metrics["samples_out"] == 4
    assert any("skipping corrupt input 00001.tar" in line for line in lines)
    assert set(read_output(tmp_path / "shards")) == {f"{i:016x}" for i in range(4)}


def test_output_format_manifest_and_fixed_shard_size(tmp_path):
    src = tmp_path / "download"
    src.mkdir()
    write_tar(src / "00000.tar", [good(i, "val" if i % 4 == 0 else "train") for i in range(12)])
    write_tar(src / "00001.tar", [good(i, "val" if i % 4 == 0 else "train") for i in range(12, 23)])
    metrics = build_shards(src, tmp_path / "shards", ShardSettings(samples_per_shard=4,
                                                                   workers=2), quiet)
    manifest = json.loads((tmp_path / "shards/manifest.json").read_text())
    assert manifest["samples_per_shard"] == 4
    train, val = manifest["splits"]["train"], manifest["splits"]["val"]
    assert (train["samples"], val["samples"]) == (17, 6)
    assert [s["samples"] for s in train["shards"]] == [4, 4, 4, 4, 1]
    assert [s["name"] for s in val["shards"]] == ["val/000000.tar", "val/000001.tar"]
    for entry in (train, val):
        for shard in entry["shards"]:
            data = (tmp_path / "shards" / shard["name"]).read_bytes()
            assert hashlib.sha256(data).hexdigest() == shard["sha256"]
            assert len(data) == shard["bytes"]
        assert entry["bytes"] == sum(s["bytes"] for s in entry["shards"])
    assert metrics["train"]["samples"] == 17 and metrics["val"]["shards"] == 2

    out = read_output(tmp_path / "shards")
    sample = out[f"{5:016x}"]
    assert sample["tar"].startswith("train/")
    assert sample["json"] == {"captions": ["caption 5", "second caption 5"],
                              "url": "http://x/5.jpg", "key": f"{5:016x}", "split": "train",
                              "labels": {"shape": "circle"}}
    assert sample["txt"] == b"caption 5"
    assert sample["jpg"] == good(5)["jpg"]  # validated JPEG bytes are copied, not re-encoded
    assert all(s["tar"].split("/")[0] == s["json"]["split"] for s in out.values())


def test_same_input_same_bytes_and_seed_shuffles(tmp_path):
    src = tmp_path / "download"
    src.mkdir()
    write_tar(src / "00000.tar", [good(i) for i in range(20)])
    first = build_shards(src, tmp_path / "a", ShardSettings(samples_per_shard=8, workers=1), quiet)
    # Same samples, other input order and tar layout: same output bytes.
    (src / "00000.tar").unlink()
    write_tar(src / "00007.tar", [good(i) for i in reversed(range(10, 20))])
    write_tar(src / "00003.tar", [good(i) for i in range(10)])
    build_shards(src, tmp_path / "b", ShardSettings(samples_per_shard=8, workers=2), quiet)
    manifest_a = (tmp_path / "a/manifest.json").read_text()
    assert manifest_a == (tmp_path / "b/manifest.json").read_text()
    build_shards(src, tmp_path / "c", ShardSettings(samples_per_shard=8, seed=1, workers=1), quiet)
    assert manifest_a != (tmp_path / "c/manifest.json").read_text()

    def order(folder: str) -> list[str]:
        with tarfile.open(tmp_path / folder / "train/000000.tar") as tar:
            return [n for n in tar.getnames() if n.endswith(".json")]
    assert order("a") != order("c") and sorted(order("a")) != order("a")
    assert first["train"]["samples"] == 20


def test_missing_input_folder_is_a_clear_error(tmp_path):
    with pytest.raises(ShardError, match="input folder not found"):
        build_shards(tmp_path / "nope", tmp_path / "out", ShardSettings(workers=1), quiet)


def test_shard_params_validation(tmp_path):
    path = tmp_path / "params.yaml"
    path.write_text("shard:\n  samples_per_shard: 0\n  seeds: 3\n")
    with pytest.raises(ParamsError) as err:
        load_section("shard", ShardParams, path)
    message = str(err.value)
    assert "shard.samples_per_shard = 0" in message and "greater than or equal to 1" in message
    assert "shard.seeds: unknown key" in message and "seed" in message


def test_decompression_bombs_and_other_formats_are_bad_samples_by_reason(tmp_path):
    # The shard stage decodes through clipms.data.preprocess.open_image: a 64 MP PNG bomb (~8 KB)
    # and a header claiming 10^10 pixels are too_large (never allocated); a GIF (which PIL would
    # decode) is undecodable_image.
    from harness.hostile_images import png_bomb, png_header_bomb

    src = tmp_path / "download"
    src.mkdir()
    hostile = [{"__key__": "000000200", "png": png_bomb(), "json": json.dumps(meta(200))},
               {"__key__": "000000201", "jpg": image_bytes(fmt="GIF"),  # named .jpg, a GIF
                "json": json.dumps(meta(201))},
               {"__key__": "000000202", "png": png_header_bomb(), "json": json.dumps(meta(202))}]
    write_tar(src / "00000.tar", [good(0), good(1, "val"), *hostile])
    metrics = build_shards(src, tmp_path / "shards", ShardSettings(samples_per_shard=2,
                                                                   workers=1), quiet)
    dropped = {reason: n for reason, n in metrics["dropped"].items() if n}
    assert dropped == {"too_large": 2, "undecodable_image": 1}
    assert metrics["samples_out"] == 2


def test_jpeg_bytes_are_copied_other_formats_converted_and_the_caption_file_is_a_fallback(
        tmp_path):
    """Mutants `make mutation` found alive: a decoded JPEG re-encoded instead of
    copied (x__validate__mutmut_15/18/19), an RGBA PNG not converted to RGB first (it cannot be
    saved as JPEG: x__to_jpeg__mutmut_8) or at another quality (_7/_13), the .txt caption of a
    sample whose json has none ignored (x__validate__mutmut_34, x__captions__mutmut_7/10/11),
    the output json's fields and labels (x__validate__mutmut_47.._53, _66.._78, _101), labels
    that are not JSON (_55/_56), a corrupt tar's reason lost (x_scan_tar__mutmut_9/10), a
    second duplicate not counted (x__collect__mutmut_31)."""
    src = tmp_path / "download"
    src.mkdir()
    jpeg = noisy_jpeg()
    rgba = io.BytesIO()
    Image.new("RGBA", (48, 40), (10, 200, 30, 128)).save(rgba, format="PNG")
    no_json_captions = {**meta(3, captions=[]), "captions": None}
    write_tar(src / "00000.tar", [
        {"__key__": "000000001", "jpg": jpeg, "txt": "what img2dataset wrote",
         "json": json.dumps(meta(1))},  # the json's captions win over the caption file
        {"__key__": "000000002", "png": rgba.getvalue(), "json": json.dumps(meta(2, "val"))},
        {"__key__": "000000003", "jpg": image_bytes(), "txt": "the caption file",
         "json": json.dumps(no_json_captions)},
        {"__key__": "000000004", "jpg": image_bytes(),
         "json": json.dumps({**meta(4), "labels": {"colour": "red"}})},  # a dict, not a string
        {"__key__": "000000005", "jpg": image_bytes(),
         "json": json.dumps({**meta(5), "labels": "{not json"})}])
    (src / "00001.tar").write_bytes(b"not a tar at all" * 64)
    write_tar(src / "00002.tar", [good(1), good(4)])  # two keys already seen: two duplicates
    shards = tmp_path / "not" / "yet" / "shards"  # parents made (x_build_shards__mutmut_22/23)
    build_shards(src, shards, ShardSettings(workers=1), quiet)
    (shards / "train" / "stale.tar").write_bytes(b"from an older run")
    metrics = build_shards(src, shards, ShardSettings(workers=1), quiet)  # a rerun replaces (_21)
    assert not (shards / "train" / "stale.tar").exists()
    per_split = ["bytes", "excluded", "samples", "samples_new", "shards", "shards_dropped",
                 "shards_kept", "shards_new"]
    assert {split: sorted(metrics[split]) for split in ("train", "val")} == {  # _79/_80
        "train": per_split, "val": per_split}
    assert metrics["train"]["shards_kept"] == 1 and metrics["train"]["samples_new"] == 0
    out = read_output(shards)
    assert out[f"{1:016x}"]["jpg"] == jpeg  # byte for byte, never re-encoded
    expected = io.BytesIO()
    Image.open(io.BytesIO(rgba.getvalue())).convert("RGB").save(expected, format="JPEG",
                                                               quality=95)
    assert out[f"{2:016x}"]["jpg"] == expected.getvalue()
    assert out[f"{3:016x}"]["txt"] == b"the caption file"
    assert out[f"{3:016x}"]["json"]["captions"] == ["the caption file"]
    assert out[f"{1:016x}"]["json"] == {
        "captions": ["caption 1", "second caption 1"], "url": "http://x/1.jpg",
        "key": f"{1:016x}", "split": "train", "labels": {"shape": "circle"}}
    assert out[f"{1:016x}"]["txt"] == b"caption 1"
    assert out[f"{4:016x}"]["json"]["labels"] == {"colour": "red"}
    assert metrics["samples_out"] == 4
    assert {k: v for k, v in metrics["dropped"].items() if v} == {"bad_metadata": 1,
                                                                 "duplicate_key": 2}
    (corrupt,) = metrics["corrupt_input_shards"]
    assert corrupt.startswith("00001.tar: ") and str(src) not in corrupt
    assert "None" not in corrupt and len(corrupt) > len("00001.tar: ") + 5


def test_the_summary_names_drops_corrupt_tars_and_the_rate():
    """x_summary__mutmut_* (the stage's closing line: what was dropped, which tars were skipped,
    the rate, also for a run shorter than a second or of no measurable time)."""
    from prep.shards import summary

    metrics = {"samples_in": 1500, "input_shards": 3, "dropped": {"too_small": 1, "bad_key": 0,
                                                                  "no_caption": 2000},
               "corrupt_input_shards": ["00001.tar: truncated", "00002.tar: empty"],
               "train": {"samples": 1200, "shards": 3}, "val": {"samples": 299, "shards": 1}}
    assert summary(metrics, 0.5) == (
        "shard: 1,500 samples from 3 input tar(s) checked in 0.5 s (~3,000 samples/s) -> 1,200 "
        "train samples in 3 shard(s), 299 val samples in 1 shard(s). Dropped: too_small 1, "
        "no_caption 2,000. Corrupt input tars skipped: 00001.tar: truncated; 00002.tar: empty.")
    clean = {**metrics, "dropped": {"too_small": 0}, "corrupt_input_shards": []}
    assert summary(clean, 0.0).endswith(
        "checked in 0.0 s (~0 samples/s) -> 1,200 train samples in 3 shard(s), 299 val samples "
        "in 1 shard(s). Dropped: none. Corrupt input tars skipped: none.")


# ---------------------------------------------------------------- shards: an fsspec URL input
# Edges `make mutation` (benchmarks/mutation.py) found untested; each docstring names the
# mutants (mutmut's names) the test kills.


def test_shards_from_a_url_are_the_shards_of_the_same_local_folder(tmp_path):
    """prep.shards.x_build_shards__mutmut_3..46 and x_fetch_tars__mutmut_1..22 (the URL
    input: tests/prep/test_remote.py runs it only inside the shard stage's process, where
    mutmut cannot see it): the recorded tars are checked, copied into a hidden temporary folder
    beside the output (made with its parents; gone after) and give the bytes a local input gives;
    the copy line names the URL and its time; a tar that differs from the record, or one that
    cannot be copied, is a ShardError that says so."""
    import re

    from prep.shards import ShardError, ShardSettings, build_shards, fetch_tars

    src = tmp_path / "store"
    src.mkdir()
    write_tar(src / "00000.tar", [good(i) for i in range(5)])
    write_tar(src / "00001.tar", [good(i, "val") for i in range(5, 8)])
    recorded = [{"name": p.name, "bytes": p.stat().st_size} for p in sorted(src.glob("*.tar"))]
    settings = ShardSettings(samples_per_shard=2, workers=1)
    local = build_shards(src, tmp_path / "local", settings, lambda _: None)
    url, out = f"file://{src}", tmp_path / "new" / "deeper" / "shards"
    lines: list[str] = []

    def print_fn(line: str) -> None:  # what is beside the output while the tars are in use
        lines.append(line)
        lines.append(" ".join(sorted(p.name[:13] for p in out.parent.iterdir())))

    for _ in range(2):  # the second time the output's parent exists
        lines.clear()
        shutil.rmtree(out, ignore_errors=True)  # written from scratch, as the local one was
        assert build_shards(url, out, settings, print_fn, recorded) == local
        assert (out / "manifest.json").read_bytes() == \
            (tmp_path / "local/manifest.json").read_bytes()
        assert [p.name for p in out.parent.iterdir()] == ["shards"]
    copied = re.fullmatch(rf"shard: copied 2 tar\(s\) from {re.escape(url)} \((\d+\.\d) s\)",
                          lines[0])
    assert copied and float(copied.group(1)) < 60, lines[0]
    assert lines[1] in (".shard-input-", ".shard-input- shards")

    with pytest.raises(ShardError) as err:
        build_shards(url, out, settings, print_fn, [{**recorded[0], "bytes": 1}, recorded[1]])
    assert str(err.value) == (f"the tars at {url} are not the ones the download stage recorded "
                              "(size changed: 00000.tar); rerun the download stage")
    with pytest.raises(ShardError, match=r"no record of the tars at .* rerun the download stage"):
        build_shards(url, out, settings, print_fn)

    folder = tmp_path / "copies"
    folder.mkdir()
    sources = [str(src / "00001.tar"), str(src / "00000.tar")]
    assert fetch_tars(url, sources, folder) == [folder / "00001.tar", folder / "00000.tar"]
    assert (folder / "00000.tar").read_bytes() == (src / "00000.tar").read_bytes()
    assert fetch_tars(url, [], folder) == []
    with pytest.raises(ShardError) as err:
        fetch_tars(url, [str(src / "gone.tar")], folder)
    assert str(err.value).startswith(f"copying the tars from {url}: ") and "gone.tar" in \
        str(err.value)


def test_a_16_bit_grey_png_is_sharded_as_its_grey_not_as_white(tmp_path):
    # PIL's convert("RGB") clips 16-bit grey at 255: a mid-grey PNG became a white training image.
    src = tmp_path / "download"
    src.mkdir()
    wide = io.BytesIO()
    Image.fromarray(np.full((32, 32), 32896, dtype=np.uint16)).save(wide, format="PNG")
    write_tar(src / "00000.tar", [{"__key__": "000000001", "png": wide.getvalue(),
                                   "json": json.dumps(meta(1))}])
    build_shards(src, tmp_path / "shards", ShardSettings(workers=1), quiet)
    jpg = read_output(tmp_path / "shards")[f"{1:016x}"]["jpg"]
    pixels = np.asarray(Image.open(io.BytesIO(jpg)).convert("RGB"), dtype=np.int64)
    assert abs(pixels.mean() - 128) <= 2

