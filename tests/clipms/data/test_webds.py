"""clipms.data.webds, the one owner of the shard format: the key rule, the key format, reading and
writing samples, the manifest."""

from __future__ import annotations

import hashlib
import io
import tarfile

import pytest
import webdataset as wds

from clipms.data import webds


@pytest.mark.parametrize(("name", "parts"), [
    ("000001.jpg", ("000001", "jpg")), ("a/b.c.JPG", ("a/b", "c.jpg")),
    ("x.seg.png", ("x", "seg.png")), ("dir.d/k.txt", ("dir.d/k", "txt")),
    ("noext", None), (".hidden", None), ("a/", None),
])
def test_the_key_rule_is_webdatasets(name, parts):
    assert webds.split_name(name) == parts


def test_the_key_rule_matches_webdataset_itself(tmp_path):
    """webdataset's own reader groups these members under the same keys as ours."""
    path = tmp_path / "x.tar"
    with tarfile.open(path, "w") as tar:
        for name in ("k1.jpg", "k1.json", "k2.seg.png", "k2.txt"):
            info = tarfile.TarInfo(name)
            info.size = 1
            tar.addfile(info, io.BytesIO(b"x"))
    theirs = [sorted(k for k in s if not k.startswith("__")) for s in
              wds.WebDataset(str(path), shardshuffle=False)]
    ours = [sorted(s.files) for s in webds.read_tar(path)]
    assert ours == theirs == [["jpg", "json"], ["seg.png", "txt"]]


@pytest.mark.parametrize(("key", "valid"), [
    ("0123abcdef012345", True), ("a_b-C9", True), ("x" * 128, True),
    ("", False), ("x" * 129, False), ("a/b", False), ("../etc", False), ("a.b", False),
    ("a b", False), ("k\\x", False), (None, False), (7, False),
])
def test_the_key_format(key, valid):
    assert webds.is_valid_key(key) is valid


@pytest.mark.parametrize("key", ["../../evil", "a/b", "a.b", ""])
def test_the_writer_never_names_a_path(tmp_path, key):
    with pytest.raises(webds.DataError, match="not in the shard key format"):
        webds.write_tar(tmp_path / "x.tar", [(key, {"jpg": b"x"})])
    with pytest.raises(webds.DataError, match="extension"):
        webds.write_tar(tmp_path / "x.tar", [("ok", {"../jpg": b"x"})])
    assert not (tmp_path / "x.tar").exists()  # nothing half-written (atomic)


def test_split_manifest_round_trip(tmp_path):
    samples = [(f"{i:04d}", {"jpg": bytes([i]) * 10, "json": b"{}", "txt": b"c"}) for i in range(5)]
    entry = webds.write_split(tmp_path, "val", iter(samples), samples_per_shard=2)
    assert [s["name"] for s in entry["shards"]] == ["val/000000.tar", "val/000001.tar",
                                                   "val/000002.tar"]
    assert [s["samples"] for s in entry["shards"]] == [2, 2, 1] and entry["samples"] == 5
    for shard in entry["shards"]:
        data = (tmp_path / shard["name"]).read_bytes()
        assert shard["sha256"] == hashlib.sha256(data).hexdigest() and shard["bytes"] == len(data)
    webds.write_manifest(tmp_path, 2, {"val": entry})
    manifest = webds.read_manifest(tmp_path)
    assert webds.split_entry(manifest, "val", "m") == entry
    read = [(s.key, s.files) for shard in entry["shards"]
            for s in webds.read_tar(tmp_path / shard["name"])]
    assert read == samples
    index = webds.index_tar(tmp_path / "val/000001.tar")
    with open(tmp_path / "val/000001.tar", "rb") as handle:
        assert webds.read_span(handle, index["0003"]["jpg"]) == bytes([3]) * 10
    again = webds.write_split(tmp_path / "again", "val", samples, samples_per_shard=2)
    assert [s["sha256"] for s in again["shards"]] == [s["sha256"] for s in entry["shards"]]


def test_truncated_tars_and_bad_manifests_are_named(tmp_path):
    webds.write_tar(tmp_path / "a.tar", [("k", {"jpg": b"x" * 3000})])
    data = (tmp_path / "a.tar").read_bytes()
    (tmp_path / "cut.tar").write_bytes(data[:1024])          # inside the member
    (tmp_path / "short.tar").write_bytes(data[:512 + 3072])  # cut between members: no end blocks
    with pytest.raises(webds.DataError, match="cut short|truncated"):
        webds.read_tar(tmp_path / "cut.tar")
    with pytest.raises(webds.DataError, match="no end-of-archive marker"):
        webds.check_complete(tmp_path / "short.tar")
    webds.check_complete(tmp_path / "a.tar")
    with pytest.raises(webds.DataError, match="manifest not found"):
        webds.read_manifest(tmp_path)
    (tmp_path / "manifest.json").write_text("{")
    with pytest.raises(webds.DataError, match="not valid JSON"):
        webds.read_manifest(tmp_path)
    (tmp_path / "manifest.json").write_text('{"splits": {"train": {"shards": []}}}')
    with pytest.raises(webds.DataError, match="no split 'val'"):
        webds.split_entry(webds.read_manifest(tmp_path), "val", "manifest")


def _tarfile_writes(path, samples) -> None:
    """What `write_tar` wrote with tarfile itself (GNU format, fixed times and owners)."""
    with tarfile.open(path, "w", format=tarfile.GNU_FORMAT) as tar:
        for key, files in samples:
            for ext, data in files.items():
                info = tarfile.TarInfo(f"{key}.{ext}")
                info.size, info.mtime, info.mode, info.uid, info.gid = len(data), 0, 0o644, 0, 0
                info.uname = info.gname = ""
                tar.addfile(info, io.BytesIO(data))


@pytest.mark.parametrize("key_length", [1, 16, 96, 97, 128])  # 96 + ".jpg": tarfile's 100 limit
def test_the_writer_s_bytes_are_tarfile_s(tmp_path, key_length):
    """write_tar makes member headers from a template (tarfile's own header building was most of
    a night's shard rewrite): the bytes must stay exactly those tarfile writes, long names (a GNU
    long-name record) and the end-of-archive padding included."""
    for size in (0, 1, 511, 512, 513, 10240, 100_001):
        samples = [(f"{i}" + "k" * (key_length - 1), {"jpg": bytes([i]) * size, "json": b"{}",
                                                      "txt": b"x" * (size % 700)})
                   for i in range(3)]
        _tarfile_writes(tmp_path / "tarfile.tar", samples)
        entry = webds.write_tar(tmp_path / "ours.tar", samples)
        expected = (tmp_path / "tarfile.tar").read_bytes()
        assert (tmp_path / "ours.tar").read_bytes() == expected, (key_length, size)
        assert entry == {"samples": 3, "bytes": len(expected),
                         "sha256": hashlib.sha256(expected).hexdigest()}


def gnu_sparse_tar(folder, declared: int, tar_format: str) -> object:
    """A tar made by GNU tar (`--sparse`) of a sample whose image is a hole of `declared` bytes:
    10 KB whatever it declares."""
    import shutil
    import subprocess

    if shutil.which("tar") is None:
        pytest.skip("GNU tar is not installed")
    folder.mkdir()
    (folder / "k1.txt").write_text("a caption")
    with open(folder / "k1.jpg", "wb") as hole:
        hole.truncate(declared)  # no data block on disk
    subprocess.run(["tar", "--sparse", f"--format={tar_format}", "-cf", "shard.tar", "k1.txt",
                    "k1.jpg"], cwd=folder, check=True)
    (folder / "k1.jpg").unlink()
    return folder / "shard.tar"


@pytest.mark.parametrize("tar_format", ["gnu", "pax"])
@pytest.mark.parametrize("declared", [1 << 20, 1536 << 20])
def test_a_sparse_member_is_refused_not_read_as_zeros(tmp_path, declared, tar_format):
    """A 10 KB tar with a GNU sparse member declaring 1.5 GB was read whole, as 1.5 GB of zeros,
    by every reader of shards: shard, evaluate, index, `infer search`."""
    path = gnu_sparse_tar(tmp_path / "sparse", declared, tar_format)
    assert path.stat().st_size <= 16 << 10
    for read in (webds.read_tar, webds.index_tar):
        with pytest.raises(webds.DataError, match=r"member 'k1.jpg' is a GNU sparse file, not a "
                                                  r"regular file"):
            read(path)


def test_members_that_are_links_or_too_large_are_refused_and_directories_skipped(tmp_path):
    def tar_of(name: str, *members: tarfile.TarInfo) -> object:
        path = tmp_path / name
        with tarfile.open(path, "w", format=tarfile.GNU_FORMAT) as tar:
            tar.addfile(tarfile.TarInfo("k0.txt"), io.BytesIO(b""))
            for member in members:
                tar.addfile(member, io.BytesIO(b"\0" * member.size) if member.isreg() else None)
        return path

    folder = tarfile.TarInfo("k1")
    folder.type = tarfile.DIRTYPE
    assert [s.key for s in webds.read_tar(tar_of("dir.tar", folder))] == ["k0"]
    for kind, name in ((tarfile.SYMTYPE, "a symbolic link"), (tarfile.LNKTYPE, "a hard link"),
                       (tarfile.FIFOTYPE, "a FIFO")):
        member = tarfile.TarInfo("k1.jpg")
        member.type, member.linkname = kind, "/etc/passwd"
        for read in (webds.read_tar, webds.index_tar):
            with pytest.raises(webds.DataError, match=rf"member 'k1.jpg' is {name}, not a "
                                                      rf"regular file; shards hold regular files"):
                read(tar_of(f"{name.split()[-1]}.tar", member))
    # a header declaring more than the limit: refused from the header, its data never read
    huge = tarfile.TarInfo("k1.jpg")
    huge.size = webds.MAX_MEMBER_BYTES + 1
    header = tmp_path / "declared.tar"
    header.write_bytes(tarfile.TarInfo("k0.txt").tobuf() + huge.tobuf() + b"\0" * 4096)
    for read in (webds.read_tar, webds.index_tar):
        with pytest.raises(webds.DataError, match=r"declares 67,108,865 bytes, over the limit "
                                                  r"of 67,108,864 bytes per member"):
            read(header)
    at_limit = tarfile.TarInfo("k1.bin")
    at_limit.size = 1 << 10
    assert [sorted(s.files) for s in webds.read_tar(tar_of("ok.tar", at_limit))] == [
        ["txt"], ["bin"]]
