"""The sha256 of a file, read in 1 MiB blocks: the one digest loop of the project (shards,
catalogs, checksums, the index's files, carried-over checkpoints)."""

from __future__ import annotations

import hashlib
from pathlib import Path

BLOCK = 1 << 20


def size_and_sha256(path: Path | str, prefix: bytes = b"") -> tuple[int, str]:
    """(bytes, sha256 hex) of a file; `prefix` is hashed first (a domain or version tag), and
    not counted in the size."""
    digest, size = hashlib.sha256(prefix), 0
    with open(path, "rb") as handle:
        while block := handle.read(BLOCK):
            digest.update(block)
            size += len(block)
    return size, digest.hexdigest()


def file_sha256(path: Path | str, prefix: bytes = b"") -> str:
    """sha256 hex of a file's bytes (after `prefix`, if any)."""
    return size_and_sha256(path, prefix)[1]
