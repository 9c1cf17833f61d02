"""Where img2dataset's shards live when they are not in the project: an fsspec URL and its pointer.

The download stage may write to any fsspec URL (`s3://bucket/prefix`, `gs://...`,
`file:///mnt/shared/...`): img2dataset writes through fsspec itself, into the download store
(`prep.store`). The project then keeps a small pointer instead of the tars (`POINTER_FILE`
in the stage's DVC out, beside the catalog): the URL with any credentials, query or fragment
removed (`clipms.utils.redact`), the store, and the tars today's images are in (path relative to
the URL and size). DVC versions the pointer; the shard stage reads those tars from the URL and
refuses them when they are no longer what the pointer records.

`check_output_url` is the one check of such a URL (the params of both stages use it): a scheme
fsspec knows, with its implementation installed, that every worker of every distributor can write
to and read back; no query or fragment (img2dataset appends shard names to the URL's path).
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import fsspec

from clipms.utils.redact import redact_url

POINTER_FILE = "remote.json"  # not a shard's name: img2dataset's are NNNNN.{tar,parquet,json}
# Schemes fsspec knows that cannot hold img2dataset's output: process-local (each worker would see
# its own), read-only, or wrappers/caches whose writes other machines do not see.
NOT_WRITABLE = frozenset({
    "memory", "http", "https", "zip", "tar", "libarchive", "reference", "github", "git", "gist",
    "data", "dir", "generic", "cached", "blockcache", "filecache", "simplecache",
    "async_wrapper", "asyncwrapper", "asynclocal", "dvc", "wandb", "jlab", "jupyter", "pyscript",
})


ALLOWED = ("allowed: a URL of a shared store fsspec writes to, e.g. s3://bucket/prefix, "
           "gs://bucket/prefix, file:///mnt/shared/folder (null: the project's data/download)")


class RemoteError(ValueError):
    """An output URL that cannot be used, or tars that are not what the pointer records."""


def is_url(target: str | Path) -> bool:
    return "://" in str(target)


def check_output_url(url: str, protected: Iterable[Path] = ()) -> str:
    """`url` when img2dataset can write shards there on any distributor, and, for a `file://`
    URL, the folder neither is, contains nor lies in a `protected` one (a rerun with another input
    clears it); ValueError saying what is allowed otherwise (never with the URL's credentials)."""
    allowed = ALLOWED
    if "::" in url:
        raise ValueError(f"chained fsspec URLs (caches, archives) are not allowed: {allowed}")
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    if not scheme or not url.lower().startswith(f"{scheme}://"):
        raise ValueError(f"not a URL (no scheme://): {allowed}")
    if scheme not in fsspec.available_protocols():
        raise ValueError(f"{scheme!r} is not a protocol fsspec knows: {allowed}")
    if scheme in NOT_WRITABLE:
        raise ValueError(f"{scheme}:// cannot hold shards that every download worker writes and "
                         f"the shard stage reads back: {allowed}")
    if parts.query or parts.fragment:
        raise ValueError("a query or fragment is not allowed (img2dataset appends each shard's "
                         f"name to the URL's path): {allowed}")
    if scheme in ("file", "local") and (parts.netloc or not parts.path.startswith("/")):
        raise ValueError(f"a file URL must be absolute, file:///path (no host): {allowed}")
    if not (parts.netloc or parts.path.strip("/")):
        raise ValueError(f"no bucket or folder: {allowed}")
    try:
        fsspec.get_filesystem_class(scheme)
    except ImportError as err:  # e.g. "Install s3fs to access S3"
        raise ValueError(f"{scheme}:// needs a package that is not installed: {err}") from None
    check_not_inside(url, protected)
    return url


def local_path(url: str) -> Path | None:
    """The folder of a `file://` URL as fsspec reads it (no percent-decoding: `file:///a%20b` is
    the folder `a%20b`), resolved; None for any other scheme."""
    if urlsplit(url).scheme.lower() not in ("file", "local"):
        return None
    return Path(fsspec.core.url_to_fs(url)[1]).resolve()


def check_not_inside(url: str, protected: Iterable[Path]) -> None:
    """A `file://` target that is, contains or lies in a `protected` folder: ValueError."""
    target = local_path(url)
    if target is None:
        return
    for folder in protected:
        folder = Path(folder).resolve()
        if target == folder or folder.is_relative_to(target) or target.is_relative_to(folder):
            raise ValueError(f"{redact_url(url)} overlaps {folder} (a rerun with another input "
                             f"empties the target): {ALLOWED}, outside it")


def write_pointer(folder: Path, url: str, store: str, tars: list[str],
                  samples: int) -> dict[str, Any]:
    """`folder/POINTER_FILE` for `tars` (paths relative to `url`) as they are now at `url`,
    holding `samples` of today's images."""
    fs, root = fsspec.core.url_to_fs(url, use_listings_cache=False)
    found = fs.glob(f"{root.rstrip('/')}/{store}/parts/*/*.tar", detail=True) if tars else {}
    sizes = {path.removeprefix(f"{root.rstrip('/')}/"): int(info["size"])
             for path, info in found.items()}
    missing = [tar for tar in tars if tar not in sizes]
    if missing:
        raise RemoteError(f"{redact_url(url)}: tars the catalog names are missing: "
                          f"{', '.join(missing[:5])}")
    pointer = {"url": redact_url(url), "store": store, "samples": samples,
               "shards": [{"name": tar, "bytes": sizes[tar]} for tar in tars]}
    folder.mkdir(parents=True, exist_ok=True)
    (folder / POINTER_FILE).write_text(json.dumps(pointer, indent=2, sort_keys=True) + "\n")
    return pointer


def read_pointer(folder: Path) -> dict[str, Any] | None:
    """The pointer in `folder`, None when the shards are in the folder itself."""
    path = Path(folder) / POINTER_FILE
    if not path.is_file():
        return None
    try:
        pointer = json.loads(path.read_text())
        if not (isinstance(pointer, dict) and isinstance(pointer.get("url"), str)
                and isinstance(pointer.get("shards"), list)):
            raise ValueError("no url or shards")
        return pointer
    except ValueError as err:
        raise RemoteError(f"{path}: not a pointer the download stage wrote ({err})") from None


def check_shards(url: str, recorded: list[dict[str, Any]]) -> list[str]:
    """The fsspec paths of the recorded tars (names relative to `url`) when each is at `url` with
    its recorded size; RemoteError naming the differences otherwise. Other files at `url` (the
    store's other parts and stores) are no concern here."""
    fs, root = fsspec.core.url_to_fs(url, use_listings_cache=False)
    root = root.rstrip("/")
    expected = {str(s.get("name")): int(s.get("bytes", -1)) for s in recorded}
    folders = sorted({name.rsplit("/", 1)[0] if "/" in name else "" for name in expected})
    found: dict[str, int] = {}
    for folder in folders:
        pattern = f"{root}/{folder}/*.tar" if folder else f"{root}/*.tar"
        for path, info in fs.glob(pattern, detail=True).items():
            found[path.removeprefix(f"{root}/")] = int(info["size"])
    missing = sorted(set(expected) - set(found))
    changed = sorted(n for n in set(found) & set(expected) if found[n] != expected[n])
    if missing or changed:
        details = "; ".join(f"{what}: {', '.join(names[:5])}" + (" ..." if len(names) > 5 else "")
                            for what, names in (("missing", missing), ("size changed", changed))
                            if names)
        raise RemoteError(f"the tars at {redact_url(url)} are not the ones the download stage "
                          f"recorded ({details}); rerun the download stage")
    return [f"{root}/{name}" for name in sorted(expected)]
