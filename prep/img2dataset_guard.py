"""The URL policy and the image-size limits, inside img2dataset's worker processes.

img2dataset 1.47 fetches with `urllib.request.urlopen` in whatever process its distributor runs a
shard in (spawned multiprocessing workers, Spark executors, Ray workers), and decodes with
`cv2.imdecode` before it compares the image area with `max_image_area`, so a 12,000 x 12,000 PNG
of a few hundred KB is decoded whole (432 MB, more with alpha) before being refused.

`download()` builds its `Downloader` from the name `img2dataset.main.Downloader`; `guarded()` puts
`GuardedDownloader` under that name for one call. The instance is built in the driver, carries the
policy and limits, and is pickled to every worker with the shard; in the worker it
- installs the policy's opener (`prep.urlguard.build_opener`) as urllib's global opener
  before the shard's downloads start, so every `urlopen` of img2dataset goes through it, with
  img2dataset's `timeout` as the deadline of each attempt: img2dataset gives urlopen its timeout,
  which bounds each read of the socket, not their sum, so a server sending a byte a second held
  an image (and its shard) for as long as it kept sending;
- wraps the resizer: the image size is read from the header (PIL reads no pixel data to open a
  file) and an image over `max_image_area` or `max_aspect_ratio` is refused before cv2 decodes it;
- only JPEG, PNG and WEBP reach cv2 (`DECODED_FORMATS`): cv2 also decodes JPEG 2000 and TIFF, whose
  decoders are more code for a hostile file to reach (a worker that crashes inside cv2 hangs the
  stage: img2dataset's pool waits for its task forever), and a TIFF may give its size twice, so
  that PIL's header check and cv2 read different sizes. Any other format is refused by name
  before cv2 sees it.
"""

# tested by: tests/prep/test_deferred_imports.py

from __future__ import annotations

import importlib
import io
import urllib.request
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Any

from PIL import Image

from prep import deferred_imports
from prep.urlguard import FetchPolicy, build_opener

# Before img2dataset's first import in this process (a Spark executor or Ray worker unpickling the
# downloader imports this module first): what it imports and the download never uses waits.
deferred_imports.defer()

from img2dataset.downloader import Downloader  # noqa: E402 - after defer()


@dataclass(frozen=True)
class ImageLimits:
    max_image_area: int
    max_aspect_ratio: float


_ACTIVE: tuple[FetchPolicy, ImageLimits] | None = None  # set by guarded(), driver side
# The module, not the package attribute: `img2dataset.main` is also the name of its CLI function.
_I2D_MAIN = importlib.import_module("img2dataset.main")
_NO_RESULT = (None, None, None, None, None)
# The formats handed to cv2: PIL identifies them by their own signature (as cv2 does), and their
# header's size is the size cv2 decodes.
DECODED_FORMATS = ("JPEG", "PNG", "WEBP")


class HeaderCheckedResizer:
    """img2dataset's resizer behind a size check made from the image header alone."""

    def __init__(self, resizer: Any, limits: ImageLimits) -> None:
        self.resizer, self.limits = resizer, limits

    def __call__(self, img_stream: io.BytesIO, blurring_bbox_list: Any = None) -> tuple:
        img_stream.seek(0)
        try:
            with warnings.catch_warnings():  # PIL warns above 89 MP: the limit below decides
                warnings.simplefilter("ignore", Image.DecompressionBombWarning)
                with Image.open(img_stream, formats=DECODED_FORMATS) as image:  # the header only
                    width, height = image.size
        except Image.DecompressionBombError:
            return (*_NO_RESULT, "image area too large")
        except Image.UnidentifiedImageError:
            return (*_NO_RESULT, _unidentified(img_stream))
        except Exception:  # noqa: BLE001 - PIL raises many types; img2dataset counts the string
            return (*_NO_RESULT, "Image decoding error")
        # The same messages as img2dataset's own checks, so one reason is counted once.
        if width * height > self.limits.max_image_area:
            return (*_NO_RESULT, "image area too large")
        if max(width, height) > self.limits.max_aspect_ratio * max(1, min(width, height)):
            return (*_NO_RESULT, "aspect ratio too large")
        img_stream.seek(0)
        return self.resizer(img_stream, blurring_bbox_list)


def _unidentified(img_stream: io.BytesIO) -> str:
    """The reason for data that is not JPEG, PNG or WEBP: the format it is (named from PIL's
    header parsers, which decode nothing), or img2dataset's own message for data that is none."""
    img_stream.seek(0)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with Image.open(img_stream) as image:
                found = str(image.format)
    except Exception:  # noqa: BLE001 - any failure here means "no image format at all"
        return "Image decoding error"
    return f"image format {found} not allowed (only {', '.join(DECODED_FORMATS)})"


class GuardedDownloader(Downloader):
    """img2dataset's Downloader with the URL policy and header size check (module docstring)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if _ACTIVE is None:
            raise RuntimeError("GuardedDownloader is built only inside clipms's guarded()")
        self.policy, limits = _ACTIVE
        self.resizer = HeaderCheckedResizer(self.resizer, limits)

    def opener(self) -> urllib.request.OpenerDirector:
        """The policy's opener, each fetch (one attempt) ending within img2dataset's timeout."""
        return build_opener(replace(self.policy, deadline_s=float(self.timeout)))

    def __call__(self, row: Any) -> Any:
        urllib.request.install_opener(self.opener())  # in this (worker) process
        return super().__call__(row)


@contextmanager
def guarded(policy: FetchPolicy, limits: ImageLimits) -> Iterator[None]:
    """Within the block, img2dataset's `download()` builds a GuardedDownloader."""
    global _ACTIVE
    original = _I2D_MAIN.Downloader
    _ACTIVE, _I2D_MAIN.Downloader = (policy, limits), GuardedDownloader
    try:
        yield
    finally:
        _ACTIVE, _I2D_MAIN.Downloader = None, original
