"""clipms.utils.filehash: the one file-digest loop, across its block boundary."""

import hashlib

from clipms.utils.filehash import BLOCK, file_sha256, size_and_sha256


def test_a_file_longer_than_a_block_hashes_as_its_whole_bytes(tmp_path):
    data = bytes(range(256)) * (BLOCK // 256 * 2 + 3)  # two blocks and a part
    path = tmp_path / "f.bin"
    path.write_bytes(data)
    assert size_and_sha256(path) == (len(data), hashlib.sha256(data).hexdigest())
    assert file_sha256(path, prefix=b"v1\0") == hashlib.sha256(b"v1\0" + data).hexdigest()


def test_an_empty_file_has_the_empty_digest(tmp_path):
    (tmp_path / "e").write_bytes(b"")
    assert size_and_sha256(tmp_path / "e") == (0, hashlib.sha256(b"").hexdigest())
