from __future__ import annotations

from typing import Literal

import pytest

from clipms.schema import Section
from pipeline.params import ParamsError, load_section


class Inner(Section):
    depth: int = 1


class Demo(Section):
    precision: Literal["fp32", "amp"] = "fp32"
    lr: float = 1e-3
    inner: Inner = Inner()


def write(tmp_path, text):
    path = tmp_path / "params.yaml"
    path.write_text(text)
    return path


def test_valid_section_and_defaults(tmp_path):
    p = load_section("demo", Demo, write(tmp_path, "demo:\n  lr: 0.5\n"))
    assert p.lr == 0.5 and p.precision == "fp32" and p.inner.depth == 1


def test_bad_literal_names_key_value_and_allowed(tmp_path):
    with pytest.raises(ParamsError) as err:
        load_section("demo", Demo, write(tmp_path, "demo:\n  precision: fp64\n"))
    msg = str(err.value)
    assert "demo.precision" in msg and "'fp64'" in msg and "'fp32'" in msg and "'amp'" in msg


def test_unknown_key_lists_allowed_keys(tmp_path):
    with pytest.raises(ParamsError) as err:
        load_section("demo", Demo, write(tmp_path, "demo:\n  inner:\n    dept: 2\n"))
    msg = str(err.value)
    assert "demo.inner.dept: unknown key" in msg and "depth" in msg


def test_wrong_type_names_key(tmp_path):
    with pytest.raises(ParamsError, match=r"demo\.lr = 'fast'"):
        load_section("demo", Demo, write(tmp_path, "demo:\n  lr: fast\n"))


def test_missing_file_is_clear(tmp_path):
    with pytest.raises(ParamsError, match="not found"):
        load_section("demo", Demo, tmp_path / "nope.yaml")
