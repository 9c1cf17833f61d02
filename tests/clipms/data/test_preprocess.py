"""Preprocessing: torchvision's resize/crop geometry and the normalisation, by hand computation."""

from __future__ import annotations

import io

import numpy as np
import pytest
from PIL import Image

from clipms.data.preprocess import (
    DEFAULT_MAX_ASPECT_RATIO,
    DEFAULT_MAX_PIXELS,
    MAX_JPEG_SCANS,
    OPENAI_MEAN,
    OPENAI_STD,
    PreprocessConfig,
    PreprocessError,
    ScanLimitError,
    decode_image,
    jpeg_scans,
    open_image,
    preprocess_image,
)
from harness.hostile_images import (
    EPS,
    encoded,
    jpeg_many_scans,
    png_bomb,
    png_header_bomb,
    png_sliver,
)


def column_image(width: int, height: int) -> Image.Image:
    """Pixel (x, y) = (10 x, 3 y, 200 - 5 x): every column and row is distinguishable."""
    x, y = np.meshgrid(np.arange(width), np.arange(height))
    pixels = np.stack([10 * x, 3 * y, 200 - 5 * x], axis=-1).astype(np.uint8)
    return Image.fromarray(pixels, "RGB")


def by_hand(rgb: tuple[int, int, int]) -> list[float]:
    return [(v / 255.0 - m) / s for v, m, s in zip(rgb, OPENAI_MEAN, OPENAI_STD, strict=True)]


def png_bytes(image: Image.Image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


@pytest.mark.parametrize(("width", "height", "left", "top"), [(25, 20, 2, 0), (20, 25, 0, 2)])
def test_centre_crop_offsets_and_normalisation_by_hand(width, height, left, top) -> None:
    # Shorter side already equals image_size, so the resize is the identity and the crop offset is
    # round((25 - 20) / 2) = round(2.5) = 2 (Python's/torchvision's rounding).
    cfg = PreprocessConfig(image_size=20)
    out = preprocess_image(column_image(width, height), cfg)
    assert out.shape == (3, 20, 20) and out.dtype == np.float32
    for row, col in [(0, 0), (7, 13), (19, 19)]:
        x, y = col + left, row + top
        expected = by_hand((10 * x, 3 * y, 200 - 5 * x))
        assert out[:, row, col] == pytest.approx(expected, abs=1e-6)


def test_resize_keeps_aspect_and_bytes_equal_pil() -> None:
    # A 80x40 image, left half red, right half blue: resized to 40x20, then the central 20 columns
    # (10..29 of the resized image) hold red on the left and blue on the right.
    pixels = np.zeros((40, 80, 3), np.uint8)
    pixels[:, :40] = (255, 0, 0)
    pixels[:, 40:] = (0, 0, 255)
    image = Image.fromarray(pixels, "RGB")
    cfg = PreprocessConfig(image_size=20)
    out = preprocess_image(image, cfg)
    assert out[:, 10, 0] == pytest.approx(by_hand((255, 0, 0)), abs=1e-5)
    assert out[:, 10, 19] == pytest.approx(by_hand((0, 0, 255)), abs=1e-5)
    assert np.array_equal(preprocess_image(png_bytes(image), cfg), out)


def test_greyscale_and_rgba_become_rgb() -> None:
    grey = Image.new("L", (30, 30), 128)
    out = preprocess_image(grey, PreprocessConfig(image_size=16, interpolation="bilinear"))
    assert out[:, 5, 5] == pytest.approx(by_hand((128, 128, 128)), abs=1e-5)
    rgba = Image.new("RGBA", (16, 16), (10, 20, 30, 0))
    assert preprocess_image(png_bytes(rgba), PreprocessConfig(16))[:, 0, 0] == pytest.approx(
        by_hand((10, 20, 30)), abs=1e-5)


def test_config_round_trip_and_errors() -> None:
    cfg = PreprocessConfig(image_size=64, interpolation="bilinear")
    assert PreprocessConfig.from_dict(cfg.to_dict()) == cfg
    assert cfg.to_dict()["mean"] == list(OPENAI_MEAN)
    with pytest.raises(PreprocessError, match="interpolation 'nearest'"):
        PreprocessConfig(image_size=64, interpolation="nearest")
    with pytest.raises(PreprocessError, match="unknown preprocessing keys"):
        PreprocessConfig.from_dict({"image_size": 64, "antialias": True})
    with pytest.raises(PreprocessError, match="sample-7: not a JPEG, PNG or WEBP"):
        preprocess_image(b"not an image", cfg, name="sample-7")
    truncated = png_bytes(column_image(64, 64))[:100]
    with pytest.raises(PreprocessError, match="cannot decode"):
        preprocess_image(truncated, cfg)


@pytest.mark.parametrize("fmt", ["JPEG", "PNG", "WEBP"])
def test_allowed_formats_decode(fmt) -> None:
    image = open_image(encoded(fmt), "x")
    assert image.format == fmt and image.size == (24, 20)
    assert preprocess_image(encoded(fmt), PreprocessConfig(16)).shape == (3, 16, 16)


@pytest.mark.parametrize("fmt", ["GIF", "BMP", "TIFF", "ICO", "PPM"])
def test_other_formats_pil_reads_are_refused(fmt) -> None:
    # PIL decodes every one of these; the decoder must not even try.
    with pytest.raises(PreprocessError, match=r"^img-3: not a JPEG, PNG or WEBP image"):
        preprocess_image(encoded(fmt), PreprocessConfig(16), name="img-3")


def test_eps_is_refused_before_any_interpreter_runs() -> None:
    with pytest.raises(PreprocessError, match="not a JPEG, PNG or WEBP"):
        open_image(EPS, "upload")


def test_decompression_bomb_is_refused_from_its_header() -> None:
    bomb = png_bomb()  # 64 MP: under PIL's own limits, over the default one
    assert len(bomb) < 20_000
    with pytest.raises(PreprocessError, match=rf"8000x8000 = 64000000 pixels, over the pixel "
                                              rf"limit of {DEFAULT_MAX_PIXELS}"):
        preprocess_image(bomb, PreprocessConfig(16))
    with pytest.raises(PreprocessError, match="over the pixel limit of 50000000"):
        open_image(png_header_bomb())  # 10^10 pixels claimed, nothing behind it


def test_pixel_limit_is_a_field_of_the_spec() -> None:
    cfg = PreprocessConfig(image_size=16, max_pixels=24 * 20 - 1)
    with pytest.raises(PreprocessError, match="24x20 = 480 pixels, over the pixel limit of 479"):
        preprocess_image(encoded("PNG"), cfg)
    assert preprocess_image(encoded("PNG"), PreprocessConfig(16, max_pixels=480)).shape[0] == 3
    assert cfg.to_dict()["max_pixels"] == 479
    assert PreprocessConfig.from_dict(cfg.to_dict()) == cfg
    older = {k: v for k, v in cfg.to_dict().items() if k != "max_pixels"}  # a spec from before
    assert PreprocessConfig.from_dict(older).max_pixels == DEFAULT_MAX_PIXELS
    with pytest.raises(PreprocessError, match="max_pixels must be an int >= image_size"):
        PreprocessConfig(image_size=16, max_pixels=255)
    with pytest.raises(PreprocessError, match="over the pixel limit"):
        preprocess_image(Image.new("RGB", (30, 30)), PreprocessConfig(16, max_pixels=256))


def test_a_sliver_is_refused_from_its_header_by_the_spec_s_aspect_ratio_limit() -> None:
    """A 274-byte 1 x 100,000 PNG passes any pixel limit, and its resize (short side to
    image_size) asked for image_size^2 x 100,000 pixels: refused before a pixel is decoded, by
    the limit the spec (so the bundle's preprocess.json) carries."""
    sliver = png_sliver()
    with pytest.raises(PreprocessError, match="upload: 1x100000 has an aspect ratio over the "
                                              "limit of 10 "):
        preprocess_image(sliver, PreprocessConfig(16), name="upload")
    with pytest.raises(PreprocessError, match="aspect ratio over the limit"):
        preprocess_image(Image.new("RGB", (200, 16)), PreprocessConfig(16))  # decoded: the same
    wide = PreprocessConfig(16, max_aspect_ratio=12.5)
    assert preprocess_image(Image.new("RGB", (200, 16)), wide).shape == (3, 16, 16)
    assert PreprocessConfig.from_dict(wide.to_dict()) == wide
    older = {k: v for k, v in wide.to_dict().items() if k != "max_aspect_ratio"}
    assert PreprocessConfig.from_dict(older).max_aspect_ratio == DEFAULT_MAX_ASPECT_RATIO
    for bad in (0.5, True, "10"):
        with pytest.raises(PreprocessError, match="max_aspect_ratio must be a number >= 1"):
            PreprocessConfig(16, max_aspect_ratio=bad)


def test_data_cut_inside_the_pixels_is_an_error() -> None:
    noise = np.random.default_rng(0).integers(0, 256, (64, 64, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(noise).save(buffer, format="JPEG")  # noise: the data dwarfs the header
    data = buffer.getvalue()
    with pytest.raises(PreprocessError, match="cannot decode image"):
        open_image(data[: len(data) * 2 // 3])


def test_a_jpeg_of_thousands_of_empty_scans_is_refused_before_its_decode() -> None:
    """10,000 empty scans decode to the same pixels, once per scan over the whole image: 1.7
    CPU-s at 2000 x 2000 pixels, in a decode thread no request can stop. Counted from the bytes
    (SOS markers), refused before libjpeg starts."""
    hostile = jpeg_many_scans(10_000)
    assert len(hostile) < 150_000
    with pytest.raises(ScanLimitError, match=rf"^upload: a JPEG of 100\d\d scans, over the limit "
                                             rf"of {MAX_JPEG_SCANS}"):
        preprocess_image(hostile, PreprocessConfig(16), name="upload")
    just_in = jpeg_many_scans(MAX_JPEG_SCANS - jpeg_scans(jpeg_many_scans(0)))
    assert jpeg_scans(just_in) == MAX_JPEG_SCANS
    assert np.array_equal(np.asarray(open_image(just_in)), np.asarray(open_image(
        jpeg_many_scans(0))))  # the empty scans change no pixel: a valid file, refused for cost


def test_scans_are_counted_from_markers_not_from_header_payloads() -> None:
    """An FF DA inside an APP segment (an EXIF thumbnail, an ICC profile) is not a scan."""
    progressive = io.BytesIO()
    Image.new("RGB", (32, 32), (9, 99, 199)).save(progressive, "JPEG", progressive=True)
    data = progressive.getvalue()
    payload = b"\xff\xda" * 1000
    with_app = data[:2] + b"\xff\xe9" + (len(payload) + 2).to_bytes(2, "big") + payload + data[2:]
    assert jpeg_scans(with_app) == jpeg_scans(data) == 10  # libjpeg's progressive script
    assert open_image(with_app).size == (32, 32)
    assert jpeg_scans(encoded("JPEG")) == 1


def png16_grey(value: int, size: tuple[int, int] = (8, 8)) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(np.full(size[::-1], value, np.uint16)).save(buffer, format="PNG")
    return buffer.getvalue()


def test_a_16_bit_greyscale_png_is_scaled_to_8_bits_not_clipped() -> None:
    """PIL's convert("RGB") clips mode I;16 at 255: a 50% grey embedded as pure white."""
    cfg = PreprocessConfig(8)
    mid_grey = png_bytes(Image.new("L", (8, 8), 128))
    assert Image.open(io.BytesIO(png16_grey(128 * 257))).mode == "I;16"
    assert np.array_equal(preprocess_image(png16_grey(128 * 257), cfg),
                          preprocess_image(mid_grey, cfg))
    for wide, narrow in ((0, 0), (65535, 255), (257 * 200 + 100, 200), (257 * 200 + 129, 201)):
        rgb = np.asarray(decode_image(png16_grey(wide)))
        assert (rgb == narrow).all(), (wide, rgb[0, 0])
