"""Untrusted inputs of a served model: base64 images and per-request limits.

One definition for the MLflow pyfunc (`registry/pyfunc_model.py`) and the search service
(`serving/`). An image arrives only as base64-encoded bytes (a `data:image/...;base64,` prefix is
allowed, as a browser's FileReader writes it); nothing here ever opens a file, so a string that
names a path is refused like any other bad input and its existence on the host cannot be probed.
What the bytes may be (JPEG/PNG/WEBP, a pixel limit) is `clipms.data.preprocess`'s decoder's
business.

Every refusal is an `InputError` whose message names the offending field and what is allowed, and
never repeats the input itself.
"""

from __future__ import annotations

import base64
import binascii
import re
from collections.abc import Sequence
from dataclasses import dataclass

DATA_URL = re.compile(r"^data:image/[a-z.+-]+;base64,", re.IGNORECASE)
WHITESPACE = re.compile(r"\s+")


class InputError(ValueError):
    """A client's mistake: the message says what is wrong and what is allowed."""


@dataclass(frozen=True)
class RequestLimits:
    """Upper bounds of one request, checked before anything is decoded or computed.

    rows: texts + images (the pyfunc: DataFrame rows); bytes: the size of every text (UTF-8) and
    every image (as sent, base64) together; text_chars: one text (CLIP reads at most its context
    of tokens, so a longer text is a mistake, not a query)."""

    max_rows: int = 256
    max_bytes: int = 16 * 2**20
    max_text_chars: int = 4096

    def __post_init__(self) -> None:
        for name in ("max_rows", "max_bytes", "max_text_chars"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")

    def check(self, texts: Sequence[object] = (), images: Sequence[object] = (),
              rows: int | None = None) -> None:
        """InputError when the request is over a limit; `rows` defaults to texts + images."""
        rows = len(texts) + len(images) if rows is None else rows
        if rows > self.max_rows:
            raise InputError(f"{rows} rows in one request, over the limit of {self.max_rows}")
        size = 0
        for i, text in enumerate(texts):
            if not isinstance(text, str):
                raise InputError(f"texts[{i}]: expected a string, got {type(text).__name__}")
            if len(text) > self.max_text_chars:
                raise InputError(f"texts[{i}]: {len(text)} characters, over the limit of "
                                 f"{self.max_text_chars}")
            size += len(text.encode("utf-8", "surrogatepass"))
        size += sum(len(image) for image in images if isinstance(image, str | bytes | bytearray))
        if size > self.max_bytes:
            raise InputError(f"{size} bytes of texts and images in one request, over the limit "
                             f"of {self.max_bytes}")


def image_bytes(value: object, name: str = "image") -> bytes:
    """The encoded image in one base64 field (raw bytes pass as they are); InputError otherwise."""
    if isinstance(value, bytes | bytearray):
        return bytes(value)
    if not isinstance(value, str):
        raise InputError(f"{name}: expected a base64-encoded JPEG, PNG or WEBP image, got "
                         f"{type(value).__name__}")
    text = WHITESPACE.sub("", DATA_URL.sub("", value, count=1))
    try:
        data = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        data = b""
    if not data:
        raise InputError(f"{name}: not valid base64; images are accepted only as "
                         f"base64-encoded JPEG, PNG or WEBP bytes")
    return data
