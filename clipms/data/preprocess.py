"""CLIP image preprocessing, one definition for training data, evaluation, export and inference.

The transform is open_clip's evaluation transform (torchvision on PIL images), with PIL only:
  1. decode (bytes; JPEG, PNG or WEBP only, at most `max_pixels` pixels and a long side at most
     `max_aspect_ratio` times the short one, both checked from the header before any pixel is
     decoded, and a JPEG of at most MAX_JPEG_SCANS scans) and convert to RGB (before resizing,
     so palette/alpha images resize as RGB; 16-bit greyscale scaled to 8 bits, not clipped);
  2. resize so that the SHORTER side equals `image_size` (the longer side becomes
     int(image_size * long / short), as torchvision computes it), PIL resampling `interpolation`
     (default bicubic, open_clip's choice; PIL filters antialias when shrinking, as torchvision does
     on PIL images);
  3. centre crop `image_size` x `image_size` (offset int(round((size - crop) / 2)), torchvision's);
  4. float32 in [0, 1] (x / 255), then (x - mean) / std per channel, channels first: (3, H, W).

The config travels with every model (`models/clip.json`, the export bundle's `preprocess.json`), so
an exported model sees exactly the pixels the trained one saw.
"""

from __future__ import annotations

import io
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
from PIL import Image, UnidentifiedImageError

OPENAI_MEAN = (0.48145466, 0.4578275, 0.40821073)  # OpenAI CLIP's pixel statistics (open_clip too)
OPENAI_STD = (0.26862954, 0.26130258, 0.27577711)
WIDE_GREY = ("I;16", "I;16L", "I;16B")  # 16-bit greyscale (PNG), as PIL opens it
INTERPOLATIONS = {"bicubic": Image.Resampling.BICUBIC, "bilinear": Image.Resampling.BILINEAR}
# The only decoders ever run on image bytes: everything else PIL can open (EPS runs Ghostscript,
# others are rarely fuzzed) is refused before a plugin sees more than the first bytes.
ALLOWED_FORMATS = ("JPEG", "PNG", "WEBP")
# 50 megapixels: a 48 MP phone photo passes; its RGB copy is at most 150 MB. A decompression
# bomb (a few KB claiming 10^10 pixels) is refused from its header, before any allocation.
DEFAULT_MAX_PIXELS = 50_000_000
# The resize makes the short side image_size, so its output holds image_size^2 x ratio pixels
# whatever the input's pixel count: a 274-byte 1 x 100,000 PNG passes any pixel limit and asks
# for a 224 x 22,400,000 image (5 x 10^9 pixels). At 10 (the download stage's own default,
# download.max_aspect_ratio) the resize of a 224 model holds at most 224 x 2,240 pixels.
DEFAULT_MAX_ASPECT_RATIO = 10.0
# Scans of one JPEG. libjpeg re-reads every coefficient of the image at each scan of a progressive
# JPEG, however little the scan holds: 10,000 empty scans (a 160 KB file) of a 2000 x 2000 image
# took 1.7 CPU-s (0.014 s without them), growing with the pixels, and a thread cannot stop a
# decode once it has started. libjpeg's own progressive
# script writes 10 scans (6 for greyscale); at 100, a 50 MP image's scans cost a fraction of a
# second.
MAX_JPEG_SCANS = 100
JPEG_HEADER_SEGMENTS = 1024  # segments walked before the first scan; past it, every FF DA counts


class PreprocessError(ValueError):
    """An image that cannot be decoded, or an invalid preprocessing config."""


class PixelLimitError(PreprocessError):
    """An image over the pixel limit (so callers can count it apart from broken data)."""


class AspectRatioError(PreprocessError):
    """An image whose long side is over `max_aspect_ratio` times its short side."""


class ScanLimitError(PreprocessError):
    """A JPEG of more than MAX_JPEG_SCANS scans."""


@dataclass(frozen=True)
class PreprocessConfig:
    """What turns an image into model input; see the module docstring for the exact steps."""

    image_size: int
    mean: tuple[float, float, float] = field(default=OPENAI_MEAN)
    std: tuple[float, float, float] = field(default=OPENAI_STD)
    interpolation: str = "bicubic"
    max_pixels: int = DEFAULT_MAX_PIXELS  # width x height limit of a decoded image
    max_aspect_ratio: float = DEFAULT_MAX_ASPECT_RATIO  # long side / short side limit

    def __post_init__(self) -> None:
        if not isinstance(self.image_size, int) or self.image_size < 1:
            raise PreprocessError(f"image_size must be a positive int, got {self.image_size!r}")
        if not isinstance(self.max_pixels, int) or self.max_pixels < self.image_size ** 2:
            raise PreprocessError(f"max_pixels must be an int >= image_size^2 "
                                  f"({self.image_size ** 2}), got {self.max_pixels!r}")
        ratio = self.max_aspect_ratio
        if isinstance(ratio, bool) or not isinstance(ratio, int | float) or not ratio >= 1:
            raise PreprocessError(f"max_aspect_ratio must be a number >= 1, got {ratio!r}")
        object.__setattr__(self, "max_aspect_ratio", float(ratio))
        if self.interpolation not in INTERPOLATIONS:
            raise PreprocessError(f"interpolation {self.interpolation!r} not one of "
                                  f"{sorted(INTERPOLATIONS)}")
        for name in ("mean", "std"):
            value = tuple(float(v) for v in getattr(self, name))
            if len(value) != 3 or (name == "std" and min(value) <= 0):
                raise PreprocessError(f"{name} must be 3 floats (std > 0), got {value}")
            object.__setattr__(self, name, value)

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "mean": list(self.mean), "std": list(self.std),
                "resize": "shorter_side", "crop": "center"}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> PreprocessConfig:
        fields = ("image_size", "mean", "std", "interpolation", "max_pixels", "max_aspect_ratio")
        extra = set(data) - {*fields, "resize", "crop"}
        if extra:
            raise PreprocessError(f"unknown preprocessing keys {sorted(extra)}")
        resize, crop = data.get("resize", "shorter_side"), data.get("crop", "center")
        if (resize, crop) != ("shorter_side", "center"):
            raise PreprocessError(f"unsupported resize/crop {resize}/{crop}")
        # A spec written before max_pixels or max_aspect_ratio existed gets the default limit,
        # never none.
        kwargs = {k: data[k] for k in fields if k in data}
        return cls(**kwargs)


def decode_image(image: Image.Image | bytes, name: str = "image",
                 max_pixels: int = DEFAULT_MAX_PIXELS,
                 max_aspect_ratio: float | None = None) -> Image.Image:
    """A PIL RGB image from encoded bytes (see `open_image`) or a PIL image; a PreprocessError
    naming `name` for anything else."""
    if isinstance(image, Image.Image):
        check_pixels(image.size, max_pixels, name, max_aspect_ratio)
    else:
        image = open_image(image, name, max_pixels, max_aspect_ratio)
    return to_rgb(image)


def to_rgb(image: Image.Image) -> Image.Image:
    """`image` in RGB. A 16-bit greyscale is scaled to 8 bits first (x / 257,
    rounded: 8-bit v is 16-bit 257 v): PIL's convert("RGB") clips it at 255, so a 16-bit PNG of
    mid grey (32896) became pure white."""
    if image.mode in WIDE_GREY:
        pixels = np.asarray(image).astype(np.int64)
        image = Image.fromarray(((pixels.clip(0, 65535) + 128) // 257).astype(np.uint8), "L")
    return image if image.mode == "RGB" else image.convert("RGB")


def open_image(data: bytes, name: str = "image", max_pixels: int = DEFAULT_MAX_PIXELS,
               max_aspect_ratio: float | None = None) -> Image.Image:
    """The fully decoded PIL image of encoded bytes, in its own mode, with its `format`.

    Only JPEG, PNG and WEBP, at most `max_pixels` pixels (and `max_aspect_ratio`, when given): the
    size is read from the header, so a decompression bomb (a few KB claiming billions of pixels)
    never allocates. Broken data, another format or a size over a limit is a PreprocessError
    naming `name`; never another exception type."""
    if not isinstance(data, bytes | bytearray | memoryview):
        raise PreprocessError(f"{name}: expected PIL.Image or bytes, got {type(data).__name__}")
    try:
        image = Image.open(io.BytesIO(data), formats=ALLOWED_FORMATS)
        check_pixels(image.size, max_pixels, name, max_aspect_ratio)  # header only: no decode
        if image.format == "JPEG":
            check_scans(bytes(data) if isinstance(data, memoryview) else data, name)
        image.load()  # the full decode, inside the try (truncated data fails here)
        return image
    except UnidentifiedImageError:
        raise PreprocessError(f"{name}: not a JPEG, PNG or WEBP image (the formats "
                              f"allowed)") from None
    except Image.DecompressionBombError as err:  # PIL's own, looser limit, checked inside open()
        raise PixelLimitError(f"{name}: over the pixel limit of {max_pixels} ({err})") from None
    except PreprocessError:
        raise
    except Exception as err:  # PIL's plugins raise OSError, SyntaxError, struct.error, ...
        raise PreprocessError(f"{name}: cannot decode image ({type(err).__name__}: "
                              f"{err})") from err


def check_pixels(size: tuple[int, int], max_pixels: int, name: str = "image",
                 max_aspect_ratio: float | None = None) -> None:
    """PixelLimitError when width x height exceeds `max_pixels`; AspectRatioError when the long
    side exceeds `max_aspect_ratio` (None: not checked) times the short side."""
    width, height = size
    if width * height > max_pixels:
        raise PixelLimitError(f"{name}: {width}x{height} = {width * height} pixels, over the "
                              f"pixel limit of {max_pixels}")
    if max_aspect_ratio is not None and max(size) > max_aspect_ratio * max(1, min(size)):
        raise AspectRatioError(f"{name}: {width}x{height} has an aspect ratio over the limit "
                               f"of {max_aspect_ratio:g} (long side / short side)")


def jpeg_scans(data: bytes | bytearray) -> int:
    """At least the number of scans (SOS markers) of JPEG bytes, read without decoding: the
    header segments walked up to the first scan (an FF DA inside an EXIF thumbnail or an ICC
    profile is not a scan of this image), then every FF DA after it (entropy-coded data stuffs
    each FF byte with 00, so FF DA there is a marker). Linear in the bytes, in C but for at most
    JPEG_HEADER_SEGMENTS steps."""
    pos = 2  # after SOI
    for _ in range(JPEG_HEADER_SEGMENTS):
        if pos + 4 > len(data) or data[pos] != 0xFF or data[pos + 1] in (0xDA, 0xD9):
            break
        marker = data[pos + 1]
        if marker == 0xFF:  # a fill byte before the marker
            pos += 1
        elif 0xD0 <= marker <= 0xD7 or marker in (0x01, 0xD8):  # markers without a length
            pos += 2
        else:
            pos += 2 + int.from_bytes(data[pos + 2:pos + 4], "big")
    return data.count(b"\xff\xda", pos)


def check_scans(data: bytes | bytearray, name: str = "image") -> None:
    """ScanLimitError when JPEG bytes hold more than MAX_JPEG_SCANS scans."""
    scans = jpeg_scans(data)
    if scans > MAX_JPEG_SCANS:
        raise ScanLimitError(f"{name}: a JPEG of {scans} scans, over the limit of "
                             f"{MAX_JPEG_SCANS} (a progressive JPEG has about 10)")


def resize_shorter_side(image: Image.Image, size: int, interpolation: str) -> Image.Image:
    """Shorter side to `size`, aspect ratio kept, as torchvision's Resize(int) computes it."""
    width, height = image.size
    short, long = sorted((width, height))
    new_short, new_long = size, int(size * long / short)
    new_size = (new_short, new_long) if width <= height else (new_long, new_short)
    return image.resize(new_size, INTERPOLATIONS[interpolation])


def center_crop(image: Image.Image, size: int) -> Image.Image:
    """The central size x size square (the image is at least that large after the resize)."""
    width, height = image.size
    top = int(round((height - size) / 2.0))
    left = int(round((width - size) / 2.0))
    return image.crop((left, top, left + size, top + size))


def to_normalized_array(image: Image.Image, cfg: PreprocessConfig) -> np.ndarray:
    """(3, H, W) float32: x / 255, then (x - mean) / std per channel (torchvision's order)."""
    pixels = np.asarray(image, dtype=np.float32) / np.float32(255.0)
    mean = np.asarray(cfg.mean, dtype=np.float32)
    std = np.asarray(cfg.std, dtype=np.float32)
    return np.ascontiguousarray(((pixels - mean) / std).transpose(2, 0, 1))


def preprocess_image(image: Image.Image | bytes, cfg: PreprocessConfig,
                     name: str = "image") -> np.ndarray:
    """Decode + resize shorter side + centre crop + CLIP mean/std -> (3, size, size) float32."""
    rgb = decode_image(image, name, cfg.max_pixels, cfg.max_aspect_ratio)
    resized = resize_shorter_side(rgb, cfg.image_size, cfg.interpolation)
    return to_normalized_array(center_crop(resized, cfg.image_size), cfg)
