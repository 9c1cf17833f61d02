"""What names an image - for its key and its train/val split - wherever it is served from.

`Identity`: "path" (default) is the URL without scheme, user-info, host, port, query and
fragment, so a mirror or another port gives the same image the same key and split; "url" is the
whole URL (for lists whose images differ only by host or query string); "id" is the metadata's
ID column (`metadata.id_col`).
"""

# tested by: tests/prep/test_captions.py

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from typing import Literal

import pyarrow as pa
import pyarrow.compute as pc

Identity = Literal["path", "url", "id"]
_URL_PATH = r"^[A-Za-z][A-Za-z0-9+.\-]*:(?://[^/?#]*)?(?P<path>[^?#]*)"


class IdentityError(ValueError):
    """The identity asked for cannot be computed (e.g. "id" without an ID for every image)."""


def image_identities(urls: pa.Array, identity: Identity, ids: pa.Array | None = None) -> pa.Array:
    """Each image's identity (see `Identity`): `http://a:81/x/1.jpg?s=2#f` -> `/x/1.jpg` and
    `file:data/synthetic/1.png` -> `data/synthetic/1.png` by path; `ids` is needed for "id"."""
    if identity == "url":
        return urls
    if identity == "id":
        if ids is None or ids.null_count:
            raise IdentityError("dedupe.identity: id needs an 'ID' column with a value for "
                                "every image (set metadata.id_col to the source's image id "
                                "column), or use identity path or url")
        return ids
    if identity != "path":
        raise ValueError(f"identity {identity!r} is not one of path, url, id")
    return pc.fill_null(pc.struct_field(pc.extract_regex(urls, _URL_PATH), [0]), "")


def stable_keys(identities: Iterable[str]) -> list[str]:
    """16 hex chars of blake2b(identity): the same image gets the same key on every run, machine
    and mirror."""
    return [hashlib.blake2b(u.encode(), digest_size=8).hexdigest() for u in identities]


def assign_splits(identities: Iterable[str], val_fraction: float, salt: str) -> list[str]:
    """'val' when a salted hash of the identity falls in the lowest `val_fraction` of its range.

    Splitting by a hash of the image's identity (not by row order or an RNG) keeps every image in
    the same split whatever else is added to or removed from the metadata, and wherever it is
    served from.
    """
    threshold = int(val_fraction * 2**64)
    salt_bytes = salt.encode() + b"\0"
    return [
        "val" if int.from_bytes(
            hashlib.blake2b(salt_bytes + u.encode(), digest_size=8).digest(), "big") < threshold
        else "train"
        for u in identities
    ]
