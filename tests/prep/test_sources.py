"""The `metadata` stage: its three sources, the download (against a loopback HTTP server started
here: checksum, retry after HTTP 500, unreachable port) and the params contract."""

from __future__ import annotations

import hashlib
import http.server
import json
import os
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from harness.dvc_workspace import PROJECT_ROOT, make_workspace, run, tool_env
from pipeline.params import ParamsError, validate_section
from prep import synthetic
from prep.captions import dedupe
from prep.sources import MetadataError, MetadataSpec, build_metadata, download
from prep.urlguard import FetchPolicy
from stages.metadata import MetadataParams

FAST = {"retries": 2, "timeout": 5.0}  # with backoff_seconds=0.01 below: no real waiting
# The test server is on 127.0.0.1: these tests allow private addresses explicitly (the default
# policy refuses them; test_loopback_metadata_url_is_refused_by_default checks that).
LOOPBACK = FetchPolicy(allow_private_addresses=True)


def _parquet_bytes(tmp_path: Path, columns: dict[str, list]) -> bytes:
    path = tmp_path / "src.parquet"
    pq.write_table(pa.table(columns), path)
    return path.read_bytes()


class _Server:
    """Loopback HTTP server: `routes` maps a path to a list of responses, served in turn (the last
    one repeats). A response is (status, body) or (status, body, declared Content-Length)."""

    def __init__(self) -> None:
        self.routes: dict[str, list[tuple]] = {}
        self.hits: dict[str, int] = {}
        server = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (http.server's name)
                responses = server.routes.get(self.path, [(404, b"not found")])
                hit = server.hits.get(self.path, 0)
                server.hits[self.path] = hit + 1
                status, body, *declared = responses[min(hit, len(responses) - 1)]
                self.send_response(status)
                # a declared length above len(body) simulates a connection cut mid-download
                self.send_header("Content-Length", str(declared[0] if declared else len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.httpd.serve_forever, args=(0.05,), daemon=True)

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.httpd.server_address[1]}{path}"


@pytest.fixture()
def server() -> Iterator[_Server]:
    srv = _Server()
    srv.thread.start()
    try:
        yield srv
    finally:
        srv.httpd.shutdown()
        srv.httpd.server_close()
        srv.thread.join(timeout=5)


def _build(tmp_path: Path, policy: FetchPolicy = LOOPBACK,
           **spec: object) -> tuple[pa.Table, object]:
    out = tmp_path / "data" / "metadata.parquet"
    summary = build_metadata(MetadataSpec(**spec), out, tmp_path / "data" / "synthetic", policy,
                             backoff_seconds=0.01)
    return pq.read_table(out), summary


# --- synthetic -------------------------------------------------------------------------------


def test_synthetic_rows_urls_labels_and_bytes_are_deterministic(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # relative paths, as the stage runs them from the project root
    spec = MetadataSpec(num_images=12, synthetic_image_size=32, seed=3)
    summary = build_metadata(spec, "data/metadata.parquet", "data/synthetic", LOOPBACK)
    first = Path("data/metadata.parquet").read_bytes()
    build_metadata(spec, "data/metadata.parquet", "data/synthetic", LOOPBACK)
    assert Path("data/metadata.parquet").read_bytes() == first

    table = pq.read_table("data/metadata.parquet")
    assert table.schema.names == ["URL", "TEXT", "LABELS", "ID", "SPLIT"]
    assert table.num_rows == 12 * synthetic.CAPTIONS_PER_IMAGE == summary.rows
    rows = table.to_pylist()
    assert rows[0]["URL"] == "file:data/synthetic/000001.png"  # no checkout path inside
    assert len({r["URL"] for r in rows}) == 12 == summary.images
    assert sorted(os.listdir("data/synthetic")) == [f"{i:06d}.png" for i in range(1, 13)]
    for row in rows:
        labels = json.loads(row["LABELS"])
        assert labels["colour"] in row["TEXT"].lower() and labels["shape"] in row["TEXT"].lower()
    assert summary.labelled_rows == table.num_rows


def test_synthetic_urls_open_with_urllib_from_the_project_root(tmp_path, monkeypatch):
    import urllib.request

    monkeypatch.chdir(tmp_path)
    build_metadata(MetadataSpec(num_images=2, synthetic_image_size=32),
                   "data/metadata.parquet", "data/synthetic", LOOPBACK)
    url = pq.read_table("data/metadata.parquet")["URL"][0].as_py()
    with urllib.request.urlopen(url, timeout=5) as response:
        assert response.read() == Path("data/synthetic/000001.png").read_bytes()


def test_synthetic_summary_counts_duplicates(tmp_path):
    table, summary = _build(tmp_path, num_images=60, synthetic_image_size=32)
    frame = table.to_pandas()
    assert summary.exact_duplicates == frame.duplicated(["URL", "TEXT"]).sum() > 0
    assert summary.near_duplicates > 0
    assert "exact duplicates" in summary.paragraph()


def test_a_rerun_clears_stale_images_and_a_failed_run_keeps_the_outputs(tmp_path):
    _build(tmp_path, num_images=5, synthetic_image_size=32)
    _build(tmp_path, num_images=3, synthetic_image_size=32)
    assert len(list((tmp_path / "data" / "synthetic").iterdir())) == 3
    before = (tmp_path / "data" / "metadata.parquet").read_bytes()
    with pytest.raises(MetadataError):
        _build(tmp_path, source="local", path=str(tmp_path / "absent.parquet"))
    assert (tmp_path / "data" / "metadata.parquet").read_bytes() == before
    assert len(list((tmp_path / "data" / "synthetic").iterdir())) == 3


# --- mscoco (download) -----------------------------------------------------------------------


def _coco_like(tmp_path: Path) -> bytes:
    return _parquet_bytes(tmp_path, {"URL": ["http://img/1.jpg", "http://img/1.jpg"],
                                     "TEXT": ["A cat.", "A cat on a mat."], "WIDTH": [640, 640]})


def test_mscoco_downloads_and_verifies_the_checksum(tmp_path, server):
    body = _coco_like(tmp_path)
    server.routes["/mscoco.parquet"] = [(200, body)]
    table, summary = _build(tmp_path, source="mscoco", url=server.url("/mscoco.parquet"),
                            sha256=hashlib.sha256(body).hexdigest(), **FAST)
    assert table.to_pydict() == {"URL": ["http://img/1.jpg"] * 2,
                                 "TEXT": ["A cat.", "A cat on a mat."], "LABELS": [None, None],
                                 "ID": [None, None], "SPLIT": [None, None]}
    assert (summary.rows, summary.images, summary.labelled_rows) == (2, 1, 0)
    leftovers = [p.name for p in (tmp_path / "data").iterdir()]
    assert sorted(leftovers) == ["metadata.parquet", "synthetic"]  # no temp/partial files


def test_mscoco_checksum_mismatch_fails_clearly_and_writes_nothing(tmp_path, server):
    server.routes["/mscoco.parquet"] = [(200, _coco_like(tmp_path))]
    with pytest.raises(MetadataError, match="checksum mismatch.*metadata.sha256 expects 0{64}"):
        _build(tmp_path, source="mscoco", url=server.url("/mscoco.parquet"), sha256="0" * 64,
               **FAST)
    assert list((tmp_path / "data").iterdir()) == []  # no output, no partial download
    assert server.hits["/mscoco.parquet"] == 1  # a wrong file is not fetched again


def test_http_500_is_retried_then_succeeds(tmp_path, server):
    body = _coco_like(tmp_path)
    server.routes["/flaky"] = [(500, b"busy"), (503, b"busy"), (200, body)]
    table, _ = _build(tmp_path, source="mscoco", url=server.url("/flaky"), **FAST)
    assert server.hits["/flaky"] == 3 and table.num_rows == 2


def test_a_download_cut_short_is_retried(tmp_path, server):
    body = _coco_like(tmp_path)
    server.routes["/cut"] = [(200, body[:100], len(body)), (200, body)]
    table, _ = _build(tmp_path, source="mscoco", url=server.url("/cut"), **FAST)
    assert server.hits["/cut"] == 2 and table.num_rows == 2


def test_retries_are_bounded(tmp_path, server):
    server.routes["/down"] = [(500, b"busy")]
    with pytest.raises(MetadataError, match=r"after 3 attempts \(last error: HTTP 500"):
        download(server.url("/down"), tmp_path / "x", policy=LOOPBACK, timeout=5, retries=2,
                 backoff_seconds=0.01)
    assert server.hits["/down"] == 3
    assert list(tmp_path.iterdir()) == []


def test_http_404_fails_at_once(tmp_path, server):
    with pytest.raises(MetadataError, match="HTTP 404"):
        download(server.url("/missing"), tmp_path / "x", policy=LOOPBACK, timeout=5, retries=3)
    assert server.hits["/missing"] == 1


def test_unreachable_server_gives_a_clear_offline_error(tmp_path):
    with socket.socket() as sock:  # a port that was free a moment ago: nothing listens there
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with pytest.raises(MetadataError, match="Offline or unreachable.*metadata.source: local"):
        _build(tmp_path, source="mscoco", url=f"http://127.0.0.1:{port}/mscoco.parquet", **FAST)


def test_loopback_metadata_url_is_refused_by_default(tmp_path, server):
    server.routes["/mscoco.parquet"] = [(200, _coco_like(tmp_path))]
    for source, key in (("mscoco", "url"), ("local", "path")):
        with pytest.raises(MetadataError, match=r"refused \(loopback_address\).*127\.0\.0\.1"):
            _build(tmp_path, FetchPolicy(), source=source, **{key: server.url("/mscoco.parquet")},
                   **FAST)
    assert server.hits == {}  # refused before any connection, and not retried


def test_a_non_parquet_download_is_reported(tmp_path, server):
    server.routes["/page.html"] = [(200, b"<html>captive portal</html>")]
    with pytest.raises(MetadataError, match="not a readable parquet file"):
        _build(tmp_path, source="mscoco", url=server.url("/page.html"), **FAST)


# --- local -----------------------------------------------------------------------------------


def _local_file(tmp_path: Path) -> Path:
    path = tmp_path / "mine.parquet"
    pq.write_table(pa.table({"image_url": ["http://a/1.jpg", "http://a/2.jpg"],
                             "caption": ["one", "two"], "extra": [1, 2]}), path)
    return path


def test_local_path_with_custom_columns(tmp_path):
    table, _ = _build(tmp_path, source="local", path=str(_local_file(tmp_path)),
                      url_col="image_url", caption_col="caption")
    assert table.to_pydict() == {"URL": ["http://a/1.jpg", "http://a/2.jpg"],
                                 "TEXT": ["one", "two"], "LABELS": [None, None],
                                 "ID": [None, None], "SPLIT": [None, None]}
    with_ids, _ = _build(tmp_path, source="local", path=str(_local_file(tmp_path)),
                         url_col="image_url", caption_col="caption", id_col="extra")
    assert with_ids["ID"].to_pylist() == ["1", "2"]  # any type, as text (dedupe.identity: id)


def test_local_url_is_downloaded(tmp_path, server):
    server.routes["/mine.parquet"] = [(200, _local_file(tmp_path).read_bytes())]
    table, _ = _build(tmp_path, source="local", path=server.url("/mine.parquet"),
                      url_col="image_url", caption_col="caption", **FAST)
    assert table["TEXT"].to_pylist() == ["one", "two"]


def test_local_missing_column_names_the_columns_found(tmp_path):
    with pytest.raises(MetadataError, match=r"missing column\(s\) \['URL'\].*"
                                            r"\['image_url', 'caption', 'extra'\]"):
        _build(tmp_path, source="local", path=str(_local_file(tmp_path)), caption_col="caption")


def test_local_unreadable_or_absent_file(tmp_path):
    bad = tmp_path / "bad.parquet"
    bad.write_text("URL,TEXT\nhttp://a,b\n")
    with pytest.raises(MetadataError, match="not a readable parquet file"):
        _build(tmp_path, source="local", path=str(bad))
    with pytest.raises(MetadataError, match="no such file"):
        _build(tmp_path, source="local", path=str(tmp_path / "absent.parquet"))


def test_local_checksum_is_checked_when_set(tmp_path):
    path = _local_file(tmp_path)
    with pytest.raises(MetadataError, match="checksum mismatch"):
        _build(tmp_path, source="local", path=str(path), url_col="image_url",
               caption_col="caption", sha256="f" * 64)


# --- the Karpathy split ----------------------------------------------------------------------

KARPATHY = {"test": [139, 285], "val": [632], "train": [724], "restval": [776]}


def _karpathy_json() -> bytes:
    images = [{"cocoid": cocoid, "split": split, "filepath": "val2014",
               "filename": f"COCO_val2014_{cocoid:012d}.jpg", "sentences": []}
              for split, ids in KARPATHY.items() for cocoid in ids]
    return json.dumps({"dataset": "coco", "images": images}).encode()


def _coco_urls(tmp_path: Path) -> Path:
    """A local COCO-like parquet: the five images of the split file and one it does not list."""
    ids = [139, 285, 632, 724, 776, 9999]
    urls = [f"http://images.cocodataset.org/{'val' if i % 2 else 'train'}2017/{i:012d}.jpg"
            for i in ids for _ in range(2)]
    path = tmp_path / "coco.parquet"
    pq.write_table(pa.table({"URL": urls, "TEXT": [f"caption {n} of an image" for n in
                                                   range(len(urls))]}), path)
    return path


def test_karpathy_split_file_from_a_loopback_server_picks_exactly_its_test_images(tmp_path,
                                                                                    server):
    from prep.captions import check_usable, dedupe

    server.routes["/dataset_coco.json"] = [(200, _karpathy_json())]
    table, summary = _build(tmp_path, source="local", path=str(_coco_urls(tmp_path)),
                            karpathy_split=server.url("/dataset_coco.json"), **FAST)
    by_id = {int(u.rsplit("/", 1)[1][:-4]): s for u, s in zip(table["URL"].to_pylist(),
                                                              table["SPLIT"].to_pylist(),
                                                              strict=True)}
    assert by_id == {139: "val", 285: "val", 632: "train", 724: "train", 776: "train",
                     9999: "train"}
    assert "2 of its 2 test images" in summary.paragraph()
    result = dedupe(table, frozenset({"http"}), val_fraction=0.5, log=lambda _m: None)
    val = result.images[result.images["split"] == "val"]["url"].str[-16:-4].astype(int)
    assert sorted(val) == KARPATHY["test"]  # exactly the listed images, whatever val_fraction
    check_usable(result.stats)


def test_karpathy_split_file_follows_the_url_policy_and_is_checked(tmp_path, server):
    server.routes["/dataset_coco.json"] = [(200, _karpathy_json())]
    with pytest.raises(MetadataError, match=r"refused \(loopback_address\)"):
        _build(tmp_path, FetchPolicy(), source="local", path=str(_coco_urls(tmp_path)),
               karpathy_split=server.url("/dataset_coco.json"), **FAST)
    assert server.hits == {}
    bad = tmp_path / "bad.json"
    for body, message in ((b"{not json", "not a readable JSON"), (b'{"images": 3}', "'images'"),
                          (b'{"images": [{"cocoid": 1, "split": "train"}]}', "no image has")):
        bad.write_bytes(body)
        with pytest.raises(MetadataError, match=f"metadata.karpathy_split: .*{message}"):
            _build(tmp_path, source="local", path=str(_coco_urls(tmp_path)),
                   karpathy_split=str(bad))
    with pytest.raises(ParamsError, match="metadata.karpathy_split.*mscoco or local"):
        validate_section("metadata", MetadataParams, {"karpathy_split": "dataset_coco.json"})


# --- params and the stage --------------------------------------------------------------------


def test_bad_source_names_the_key_and_the_allowed_values():
    with pytest.raises(ParamsError, match=r"metadata\.source = 'coco'.*'synthetic', 'mscoco' or "
                                          r"'local'"):
        validate_section("metadata", MetadataParams, {"source": "coco"})


def test_synthetic_val_images_are_the_last_ones_and_urls_follow_the_base(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    spec = MetadataSpec(num_images=6, synthetic_image_size=32, synthetic_val_images=2,
                        synthetic_url="http://127.0.0.1:8765/images/",
                        synthetic_captions="mscoco")
    build_metadata(spec, "data/metadata.parquet", "data/synthetic", LOOPBACK)
    rows = pq.read_table("data/metadata.parquet").to_pylist()
    split = {r["URL"]: r["SPLIT"] for r in rows}
    assert split == {f"http://127.0.0.1:8765/images/{i:06d}.png": "train" if i <= 4 else "val"
                     for i in range(1, 7)}
    assert {r["TEXT"] for r in rows} >= {c for i in range(1, 7) for c in synthetic.mscoco_captions(
        synthetic.sample_scene(synthetic.image_rng(0, i)), synthetic.caption_rng(0, i))}
    images = dedupe(pq.read_table("data/metadata.parquet"), ["http"]).images
    assert sorted(images.loc[images["split"] == "val", "url"]) == sorted(
        u for u, s in split.items() if s == "val")  # dedupe keeps the given split


def repeated_caption_parquet(path: Path, rows: int, caption_bytes: int,
                             dictionary: bool = True) -> None:
    """`rows` rows of one caption of `caption_bytes` bytes: dictionary-encoded, it is stored once
    (a few KB in all); plain-encoded, zstd hides it just as well."""
    caption = "a" * caption_bytes
    url = pa.DictionaryArray.from_arrays(pa.array([0] * rows, pa.int32()),
                                         pa.array(["http://images.example/a.jpg"]))
    text = pa.DictionaryArray.from_arrays(pa.array([0] * rows, pa.int32()), pa.array([caption]))
    table = pa.table({"URL": url, "TEXT": text})
    pq.write_table(table if dictionary else table.cast(pa.schema(
        [("URL", pa.string()), ("TEXT", pa.string())])), path, compression="zstd",
        use_dictionary=dictionary)


@pytest.mark.parametrize(("rows", "caption_bytes", "dictionary", "limits", "message"), [
    # 1000 rows of one 1 MiB caption: under 1 KB on disk, 1 GiB of text, read whole before
    (1000, 1 << 20, True, {}, r"column 'TEXT' holds a value of 1,048,576 bytes, over "
                              r"metadata.max_text_bytes \(65,536\)"),
    (300, 60_000, True, {"max_total_text_bytes": 1 << 24},
     r"hold 18,\d{3},\d{3} bytes of text, over metadata.max_total_text_bytes \(16,777,216\)"),
    (300, 60_000, False, {"max_total_text_bytes": 1 << 24},
     r"hold 18,\d{3},\d{3} bytes uncompressed, over metadata.max_total_text_bytes"),
])
def test_a_small_parquet_of_much_text_is_refused_before_its_text_is_decoded(
        tmp_path, rows, caption_bytes, dictionary, limits, message):
    path = tmp_path / "bomb.parquet"
    repeated_caption_parquet(path, rows, caption_bytes, dictionary)
    assert path.stat().st_size < 64 * 1024
    spec = MetadataSpec(source="local", path=str(path), **limits)
    with pytest.raises(MetadataError, match=message):
        build_metadata(spec, tmp_path / "metadata.parquet", tmp_path / "synthetic", LOOPBACK)
    assert not (tmp_path / "metadata.parquet").exists()
    roomy = MetadataSpec(source="local", path=str(path), max_text_bytes=caption_bytes,
                         max_total_text_bytes=1 << 30)
    if rows * caption_bytes < 1 << 26:  # within limits that allow it, the same file is read
        build_metadata(roomy, tmp_path / "metadata.parquet", tmp_path / "synthetic", LOOPBACK)
        assert pq.read_metadata(tmp_path / "metadata.parquet").num_rows == rows


def test_the_refusal_of_a_gigabyte_of_caption_text_stays_small_in_memory(tmp_path):
    """1000 rows of one 1 MiB caption decode to 1 GiB of text, which the stage as it was read
    whole; the refusal, in a process of its own, peaks far below one copy of that text."""
    path = tmp_path / "bomb.parquet"
    repeated_caption_parquet(path, 1000, 1 << 20)
    script = ("import re, sys\n"
              "from pathlib import Path\n"
              "from prep.sources import MetadataError, MetadataSpec, build_metadata\n"
              "from prep.urlguard import FetchPolicy\n"
              "out = Path(sys.argv[2])\n"
              "try:\n"
              "    build_metadata(MetadataSpec(source='local', path=sys.argv[1]), "
              "out / 'm.parquet', out / 'synthetic', FetchPolicy())\n"
              "except MetadataError as err:\n"
              "    print('REFUSED', err)\n"
              # VmHWM: this process's own peak (ru_maxrss would count the pytest process
              # it was forked from, whose peak survives the exec)
              "status = open('/proc/self/status').read()\n"
              "print('PEAK_KB', re.search(r'VmHWM:\\s*(\\d+)', status).group(1))\n")
    proc = subprocess.run([sys.executable, "-c", script, str(path), str(tmp_path)],
                          capture_output=True, text=True, env=tool_env(), cwd=PROJECT_ROOT,
                          check=True)
    assert "REFUSED" in proc.stdout and "metadata.max_text_bytes" in proc.stdout, proc.stdout
    peak_kb = int(proc.stdout.rsplit("PEAK_KB", 1)[1].split()[0])
    assert peak_kb < 512 * 1024, f"{peak_kb / 1024:.0f} MB"  # 1 GiB of text was never decoded


@pytest.mark.parametrize(("raw", "message"), [
    ({"num_images": 10, "synthetic_val_images": 10},
     r"metadata\.synthetic_val_images = 10: .*below metadata.num_images \(10\)"),
    ({"synthetic_url": "ftp://mirror/images"}, r"metadata\.synthetic_url = 'ftp://mirror/images'"),
    ({"synthetic_captions": "long"}, r"metadata\.synthetic_captions = 'long'.*'templates'"),
    ({"source": "local"}, r"metadata\.path = None: .*required when source is 'local'"),
    ({"sha256": "abc"}, r"metadata\.sha256 = 'abc': .*64 hex"),
    ({"num_images": 0}, r"metadata\.num_images = 0"),
    ({"colour": "red"}, r"metadata\.colour: unknown key"),
    ({"max_text_bytes": 0}, r"metadata\.max_text_bytes = 0: .*greater than or equal to 256"),
    ({"max_total_text_bytes": 1000},
     r"metadata\.max_total_text_bytes = 1000: .*greater than or equal to 1048576"),
])
def test_other_params_errors(raw, message):
    with pytest.raises(ParamsError, match=message):
        validate_section("metadata", MetadataParams, raw)


def test_defaults_match_params_yaml():
    section = yaml.safe_load((PROJECT_ROOT / "params.yaml").read_text())["metadata"]
    assert validate_section("metadata", MetadataParams, section) == MetadataParams()


def test_stage_runs_from_a_project_root_and_prints_a_summary(tmp_path):
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(
        {"metadata": {"num_images": 4, "synthetic_image_size": 32}}))
    env = {**tool_env(), "PYTHONPATH": str(PROJECT_ROOT)}
    proc = subprocess.run([sys.executable, "-m", "stages.metadata"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "metadata: 20 caption rows for 4 images from source 'synthetic'" in proc.stdout
    assert pq.read_table(tmp_path / "data" / "metadata.parquet").num_rows == 20

    (tmp_path / "params.yaml").write_text(yaml.safe_dump({"metadata": {"source": "coco"}}))
    proc = subprocess.run([sys.executable, "-m", "stages.metadata"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and "metadata.source = 'coco'" in proc.stderr

    # The stage applies download.allow_private_addresses (false by default) to metadata.url.
    (tmp_path / "params.yaml").write_text(yaml.safe_dump({"metadata": {
        "source": "mscoco", "url": "http://127.0.0.1:9/mscoco.parquet", "retries": 0}}))
    proc = subprocess.run([sys.executable, "-m", "stages.metadata"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and "refused (loopback_address)" in proc.stderr


@pytest.mark.slow
def test_dvc_repro_metadata_then_switch_to_a_local_source(tmp_path):
    """The dvc.yaml block: outs are both data/metadata.parquet and data/synthetic, a rerun is a
    no-op, and a params change reruns the stage (data/synthetic then stays, empty)."""
    ws = make_workspace(tmp_path)
    run(["dvc", "repro", "metadata"], ws)
    rows = pq.read_table(ws / "data" / "metadata.parquet").num_rows
    assert rows == 48 * synthetic.CAPTIONS_PER_IMAGE  # TINY_PARAMS: 48 images
    lock = yaml.safe_load((ws / "dvc.lock").read_text())["stages"]["metadata"]
    assert {o["path"] for o in lock["outs"]} == {"data/metadata.parquet", "data/synthetic"}
    assert "didn't change, skipping" in run(["dvc", "repro", "metadata"], ws).stdout

    _local_file(ws)
    params = yaml.safe_load((ws / "params.yaml").read_text())
    params["metadata"].update(source="local", path="mine.parquet", url_col="image_url",
                              caption_col="caption")
    (ws / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    run(["dvc", "repro", "metadata"], ws)
    assert pq.read_table(ws / "data" / "metadata.parquet").num_rows == 2
    assert list((ws / "data" / "synthetic").iterdir()) == []
