"""Hostile image inputs shared by the decoder, pyfunc-server and service tests.

Each is small on the wire; what it claims or contains is what a decoder must refuse.
"""

from __future__ import annotations

import io
import struct
import zlib

from PIL import Image


def png_chunk(kind: bytes, payload: bytes) -> bytes:
    return (struct.pack(">I", len(payload)) + kind + payload
            + struct.pack(">I", zlib.crc32(kind + payload) & 0xFFFFFFFF))


def png_bomb(width: int = 8000, height: int = 8000) -> bytes:
    """A valid 1-bit greyscale PNG of width x height black pixels: ~8 KB on disk for 64 MP (the
    default), 192 MB once converted to RGB. PIL's own limit (89 MP warning, 178 MP error) lets
    64 MP through, so only the decoder's own pixel limit stops it."""
    row = b"\x00" + bytes((width + 7) // 8)  # filter byte 0 + packed zero bits
    packer = zlib.compressobj(9)
    body = b"".join(packer.compress(row) for _ in range(height)) + packer.flush()
    header = struct.pack(">IIBBBBB", width, height, 1, 0, 0, 0, 0)  # 1 bit, greyscale
    return (b"\x89PNG\r\n\x1a\n" + png_chunk(b"IHDR", header) + png_chunk(b"IDAT", body)
            + png_chunk(b"IEND", b""))


def png_header_bomb(width: int = 100_000, height: int = 100_000) -> bytes:
    """A PNG whose header claims 10^10 pixels, with almost no data: decoding must never start."""
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)  # 8-bit RGB
    return (b"\x89PNG\r\n\x1a\n" + png_chunk(b"IHDR", header)
            + png_chunk(b"IDAT", zlib.compress(b"\x00" * 64)) + png_chunk(b"IEND", b""))


def png_sliver(width: int = 1, height: int = 100_000) -> bytes:
    """A valid 1-bit PNG of 1 x 100,000 black pixels (under 300 bytes): within any pixel limit,
    but a resize of its short side to a model's image size asks for that size squared x 100,000
    pixels (5 x 10^9 for 224)."""
    return png_bomb(width, height)


EPS = (b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 10 10\n"
       b"newpath 0 0 moveto 10 10 lineto stroke\nshowpage\n%%EOF\n")


def encoded(fmt: str, size: tuple[int, int] = (24, 20), colour=(200, 30, 30)) -> bytes:
    """A small solid image in any format PIL writes (JPEG, PNG, WEBP, GIF, BMP, TIFF, ...)."""
    buffer = io.BytesIO()
    Image.new("RGB", size, colour).save(buffer, format=fmt)
    return buffer.getvalue()


def jpeg_many_scans(scans: int = 10_000, size: tuple[int, int] = (64, 64)) -> bytes:
    """A valid progressive JPEG followed by `scans` empty DC refinement scans of every component
    (14 bytes each): it decodes to the same pixels, but libjpeg reads every coefficient of the
    image once per scan (at 2000 x 2000 pixels, 10,000 scans took 1.7 CPU-s)."""
    buffer = io.BytesIO()
    Image.new("RGB", size, (120, 60, 200)).save(buffer, "JPEG", progressive=True, quality=90)
    data = buffer.getvalue()
    # SOS: 3 components (ids 1, 2, 3 with their tables), Ss = Se = 0 (DC), Ah = 1, Al = 0
    empty_scan = b"\xff\xda" + struct.pack(">H", 12) + bytes.fromhex("03010002000300000010")
    return data[:-2] + empty_scan * scans + b"\xff\xd9"  # before EOI
