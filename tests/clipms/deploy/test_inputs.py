"""Untrusted inputs of the served model (clipms.deploy.inputs): base64 only, request limits."""

from __future__ import annotations

import base64

import pytest

from clipms.deploy.inputs import InputError, RequestLimits, image_bytes
from harness.hostile_images import encoded


def test_base64_and_data_urls_decode_to_the_same_bytes() -> None:
    png = encoded("PNG")
    text = base64.b64encode(png).decode()
    assert image_bytes(text) == png
    assert image_bytes("data:image/png;base64," + text) == png
    wrapped = "\n".join(text[i:i + 76] for i in range(0, len(text), 76))  # `base64` CLI output
    assert image_bytes(wrapped) == png
    assert image_bytes(png) == png  # raw bytes from a Python caller


@pytest.mark.parametrize("value", ["/etc/passwd", "./models/export/bundle.json", "", "   ",
                                   "file:///etc/hostname", "not base64!"])
def test_a_path_is_refused_like_any_other_bad_string(value, tmp_path) -> None:
    with pytest.raises(InputError, match=r"^images\[2\]: not valid base64; images are accepted "
                                         r"only as base64-encoded"):
        image_bytes(value, "images[2]")


def test_existing_and_missing_paths_get_the_same_answer(tmp_path) -> None:
    real = tmp_path / "real.png"
    real.write_bytes(encoded("PNG"))
    answers = set()
    for path in (real, tmp_path / "missing.png", tmp_path):
        with pytest.raises(InputError) as err:
            image_bytes(str(path), "image")
        answers.add(str(err.value))
    assert len(answers) == 1 and str(tmp_path) not in answers.pop()


def test_other_types_are_named() -> None:
    with pytest.raises(InputError, match="got int"):
        image_bytes(7, "image")


def test_limits() -> None:
    limits = RequestLimits(max_rows=3, max_bytes=100, max_text_chars=20)
    limits.check(["a", "b"], ["x" * 50])
    with pytest.raises(InputError, match="4 rows in one request, over the limit of 3"):
        limits.check(["a", "b"], ["x", "y"])
    with pytest.raises(InputError, match="101 bytes of texts and images in one request, over "
                                         "the limit of 100"):
        limits.check(["a"], ["x" * 100])
    with pytest.raises(InputError, match=r"texts\[1\]: 21 characters, over the limit of 20"):
        limits.check(["ok", "y" * 21])
    with pytest.raises(InputError, match="5 rows"):
        limits.check([], [], rows=5)  # the pyfunc counts DataFrame rows
    with pytest.raises(ValueError, match="max_rows must be a positive int"):
        RequestLimits(max_rows=0)
