"""dedupe -> download (real img2dataset) -> shard against a loopback HTTP server started here.

The server serves good JPEGs plus the failure cases img2dataset meets on the web: 404s, a truncated
JPEG, a text file named .jpg and a URL slower than the timeout. The metadata also holds a file://
URL pointing at a real local JPEG, empty captions and duplicate rows. The stages run as the
`python -m stages.<name>` subprocesses DVC would run, in a temporary folder with a params.yaml.
"""

from __future__ import annotations

import io
import json
import time
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import yaml
from PIL import Image

from clipms.data import webds
from harness.image_site import (
    COLOURS,
    Site,
    jpeg,
    kill_download_in_shard_1,
    part_folder,
    run_stage,
    stage_env,
    write_params,
)
from prep.fetch import read_parquet

LOCAL_COLOUR = (255, 0, 255)  # the local file only: magenta never appears in a served image


def quiet(_message: str) -> None:
    pass


def read_shards(folder: Path) -> dict[str, dict]:
    """{key: {"json": ..., "txt": ..., "jpg": bytes, "split_dir": ...}} over data/shards/*/*.tar."""
    return {sample.key: {**sample.files, "json": sample.meta, "split_dir": tar_path.parent.name}
            for tar_path in sorted(folder.glob("*/*.tar")) for sample in webds.read_tar(tar_path)}


def metadata_rows(base: str, local_file: Path) -> tuple[list[dict], dict[str, list[str]]]:
    """The metadata rows, and the captions each good image must arrive with."""
    good = {f"{base}/good/{i}.jpg": i for i in range(6)}
    url = list(good)
    rows = [
        (url[0], "A red square."), (url[0], "a  red square"),          # near duplicate
        (url[0], "A red square."),                                   # exact duplicate row
        (url[0], "Two red squares on white"),
        (url[1], "Blue circle on grey"), (url[1], ""), (url[1], "   "),  # empty captions
        (url[2], "Green triangle"), (url[2], "Green triangle"),     # duplicate row
        (url[3], "hi"), (url[3], "Yellow star shape"),              # "hi" is too short
        (url[4], "A purple blob"), (url[5], "An orange thing"),
        (f"{base}/good/6.jpg", ""), (f"{base}/good/6.jpg", " "),    # only empty captions
        (f"{base}/missing.jpg", "This one is a 404"),
        (f"{base}/truncated.jpg", "A truncated jpeg"),
        (f"{base}/text.jpg", "A text file named jpg"),
        (f"{base}/slow.jpg", "Too slow to arrive"),
        (f"{base}/redirect.jpg", "A redirect to the local file"),
        (local_file.as_uri(), "A local file that must stay local"),
    ]
    expected = {
        url[0]: ["A red square.", "Two red squares on white"],
        url[1]: ["Blue circle on grey"],
        url[2]: ["Green triangle"],
        url[3]: ["Yellow star shape"],
        url[4]: ["A purple blob"],
        url[5]: ["An orange thing"],
    }
    return [{"URL": u, "TEXT": t, "LABELS": None} for u, t in rows], expected


@pytest.mark.slow
def test_dedupe_download_shard_against_loopback_server(tmp_path):
    local_file = tmp_path / "secret.jpg"
    local_file.write_bytes(jpeg(LOCAL_COLOUR))
    write_params(tmp_path)
    with Site(redirect_to=local_file.as_uri()) as site:
        rows, expected = metadata_rows(site.base, local_file)
        (tmp_path / "data").mkdir()
        pd.DataFrame(rows).to_parquet(tmp_path / "data/metadata.parquet", index=False)

        run_stage("dedupe", tmp_path)
        dedupe = json.loads((tmp_path / "metrics/dedupe.json").read_text())
        assert dedupe["rows_in"] == 21 and dedupe["images_in"] == 13
        assert dedupe["removed"] == {
            "missing_url": 0, "disallowed_scheme": 1, "empty_caption": 4, "short_caption": 1,
            "exact_duplicate": 2, "duplicate_caption": 1, "not_first_caption": 0,
        }
        assert dedupe["images_out"] == 11 and dedupe["captions_kept"] == 12

        # An images.parquet from elsewhere is untrusted: slip a file:// row past dedupe.
        images = read_parquet(tmp_path / "data/images.parquet")
        smuggled = images.iloc[[0]].assign(url=local_file.as_uri(), key="f" * 16)
        pd.concat([images, smuggled]).to_parquet(tmp_path / "data/images.parquet", index=False)

        started = time.perf_counter()
        run_stage("download", tmp_path)
        elapsed = time.perf_counter() - started
        run_stage("shard", tmp_path)
        requests = list(site.requests)

    download = json.loads((tmp_path / "metrics/download.json").read_text())
    assert download["rows_in"] == 12 and download["disallowed_scheme"] == 1
    assert download["attempted"] == 11 and download["successes"] == 6
    assert download["failed_to_download"] == 3 and download["failed_to_resize"] == 2
    reasons = download["failure_reasons"]
    assert sum(reasons.values()) == 5
    assert reasons.get("HTTP Error 404: Not Found") == 1
    # urllib refuses to follow a redirect to file:, so a web server cannot make us read it either
    assert any("Redirection to url 'file:" in reason for reason in reasons), reasons
    assert reasons.get("Image decoding error") == 2
    # the slow image is cut by its total deadline (download.timeout), not by a read timeout
    assert any("download deadline of" in reason for reason in reasons), reasons
    assert download["shards_done"] == download["shards_expected"] == 3
    assert elapsed < 120  # bounded: the slow URL costs ~timeout, not SLOW_SECONDS per retry

    # Only our http URLs were requested, each once (retries: 0); the local file was never read.
    assert sorted(requests) == sorted(u.removeprefix(site.base) for u in images["url"])
    attempted = pd.concat(read_parquet(p) for p in part_folder(tmp_path / "data/download").glob(
        "*.parquet"))
    assert not attempted["url"].str.startswith("file:").any()

    shard = json.loads((tmp_path / "metrics/shard.json").read_text())
    assert shard["samples_in"] == 6 and shard["samples_out"] == 6
    assert sum(shard["dropped"].values()) == 0 and shard["input_shards_corrupt"] == 0
    assert shard["train"]["samples"] + shard["val"]["samples"] == 6

    samples = read_shards(tmp_path / "data/shards")
    by_url = {s["json"]["url"]: s for s in samples.values()}
    assert set(by_url) == set(expected)
    for url, captions in expected.items():
        sample = by_url[url]
        assert sample["json"]["captions"] == captions
        assert sample["txt"].decode() == captions[0]
        assert sample["json"]["split"] == sample["split_dir"]
        assert sample["json"]["key"] == images.set_index("url").loc[url, "key"]
        pixels = np.asarray(Image.open(io.BytesIO(sample["jpg"])).convert("RGB"), dtype=float)
        assert pixels.shape == (64, 64, 3)
        colour = COLOURS[int(url.split("/")[-1].split(".")[0])]
        assert np.abs(pixels.mean(axis=(0, 1)) - colour).max() < 12  # the image of that URL
    manifest = json.loads((tmp_path / "data/shards/manifest.json").read_text())
    assert sum(s["samples"] for s in manifest["splits"].values()) == 6


def test_download_refuses_file_urls_before_img2dataset(tmp_path):
    """Only file:// rows: nothing may reach img2dataset, and the refusals are counted."""
    local_file = tmp_path / "secret.jpg"
    local_file.write_bytes(jpeg(LOCAL_COLOUR))
    write_params(tmp_path, min_success_rate=0.5)
    (tmp_path / "data").mkdir()
    pd.DataFrame({"url": [local_file.as_uri(), "FILE://" + str(local_file), " " +
                          local_file.as_uri()],
                  "key": ["a" * 16, "b" * 16, "c" * 16], "caption": "a local file",
                  "captions": [["a local file"]] * 3, "split": "train", "labels": None,
                  }).to_parquet(tmp_path / "data/images.parquet", index=False)
    proc = run_stage("download", tmp_path, check=False)
    metrics = json.loads((tmp_path / "metrics/download.json").read_text())
    assert metrics["disallowed_scheme"] == 3 and metrics["attempted"] == 0
    assert not list((tmp_path / "data/download").glob("*.tar"))
    # Nothing arrived: the stage fails (success rate 0 < min_success_rate) and says why.
    assert proc.returncode == 1
    assert "only 0 of 3 images arrived" in proc.stderr and "3 x refused: disallowed_scheme" in \
        proc.stderr


@pytest.mark.slow
def test_killed_download_resumes_only_unfinished_shards(tmp_path):
    """SIGKILL the stage (and img2dataset's workers) while shard 1 is fetching; a rerun keeps shard
    0 untouched and fetches only shards 1 and 2."""
    write_params(tmp_path, samples_per_shard=2, timeout=10)
    (tmp_path / "data").mkdir()
    root = tmp_path / "data/download"
    with Site() as site:
        urls = [f"{site.base}/good/{i}.jpg" for i in range(6)]
        urls[2:4] = [f"{site.base}/stall/{i}.jpg" for i in (2, 3)]  # shard 1 stalls
        images = pd.DataFrame({"url": urls, "key": [f"{i:016x}" for i in range(6)],
                               "caption": "a caption", "captions": [["a caption"]] * 6,
                               "split": "train", "labels": None})
        images.to_parquet(tmp_path / "data/images.parquet", index=False)
        kill_download_in_shard_1(
            tmp_path, site, stage_env(),
            lambda: any(root.glob("s-*/parts/00000/00000_stats.json")), interval=0.1)
        site.stall.set()  # from now on the stalled URLs answer at once
        out = part_folder(root)
        assert not (out / "00001_stats.json").exists()
        finished = (out / "00000.tar").stat().st_mtime_ns
        site.requests.clear()
        proc = run_stage("download", tmp_path)
        assert "resuming part 00000 (1 of 3 img2dataset shard(s) finished are kept)" in \
            proc.stdout
        # which URLs, not how often: a fetch that times out on a loaded machine is retried
        # (`download.retries`), and CI saw /stall/3.jpg asked twice at load 11
        assert sorted(set(site.requests)) == ["/good/4.jpg", "/good/5.jpg", "/stall/2.jpg",
                                              "/stall/3.jpg"]
    assert (out / "00000.tar").stat().st_mtime_ns == finished
    metrics = json.loads((tmp_path / "metrics/download.json").read_text())
    assert metrics["successes"] == 6 and metrics["shards_done"] == 3


def test_download_reports_bad_params(tmp_path):
    write_params(tmp_path, allowed_schemes=["http", "file"])
    proc = run_stage("download", tmp_path, check=False)
    assert proc.returncode == 1
    assert "download.allowed_schemes" in proc.stderr and "'file' is not allowed" in proc.stderr


def test_resize_mode_no_may_be_written_unquoted():
    """`resize_mode: no` (img2dataset's word) is read by YAML 1.1 as false; it means "no"."""
    from pipeline.params import ParamsError, validate_section
    from stages.download import DownloadParams

    section = yaml.safe_load("resize_mode: no")
    assert section == {"resize_mode": False}
    assert validate_section("download", DownloadParams, section).resize_mode == "no"
    with pytest.raises(ParamsError, match="download.resize_mode"):
        validate_section("download", DownloadParams, {"resize_mode": True})
