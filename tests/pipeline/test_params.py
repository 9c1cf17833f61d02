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


# ---------------------------------------------------------------- params
# Edges `make mutation` (benchmarks/mutation.py) found untested; each docstring names the
# mutants (mutmut's names) the test kills.


def _params_models():
    from clipms.schema import Section

    class Leaf(Section):
        depth: int = 1
        width: int = 2

    class Middle(Section):
        leaf: Leaf = Leaf()
        name: str = "m"

    class Top(Section):
        middle: Middle = Middle()
        leaves: list[Leaf] = []
        rate: float = 0.5

    return Top


def test_unknown_keys_list_the_keys_of_the_model_that_holds_them(tmp_path):
    """pipeline.params.x__describe__mutmut_14 (the separator), _21 (which parent: three levels
    deep), x__allowed_keys__mutmut_13 (a list of models is not a model: no TypeError)."""
    from pipeline.params import ParamsError, load_section

    top, path = _params_models(), tmp_path / "params.yaml"
    path.write_text("top:\n  middle:\n    leaf:\n      dept: 3\n")
    with pytest.raises(ParamsError) as err:
        load_section("top", top, path)
    assert str(err.value) == (f"{path}: invalid 'top' params:\n  top.middle.leaf.dept: unknown "
                              "key (allowed keys here: depth, width)")
    path.write_text("top:\n  leaves:\n    - dept: 3\n")
    with pytest.raises(ParamsError, match=r"top\.leaves\.0\.dept: unknown key \(allowed keys "
                                          r"here: \)"):
        load_section("top", top, path)


def test_a_missing_section_is_all_defaults_and_a_non_mapping_is_named(tmp_path):
    """x_load_section__mutmut_5 (a missing section), _7 (its message), _11/_15/_16 (the file is
    the source the error names)."""
    from pipeline.params import ParamsError, load_section

    top, path = _params_models(), tmp_path / "params.yaml"
    path.write_text("other: {}\n")
    assert load_section("top", top, path) == top()
    path.write_text("top: [1, 2]\n")
    with pytest.raises(ParamsError) as err:
        load_section("top", top, path)
    assert str(err.value) == f"{path}: section 'top' must be a mapping, got [1, 2]"
    path.write_text("top:\n  rate: fast\n")
    with pytest.raises(ParamsError) as err:
        load_section("top", top, path)
    assert str(err.value).startswith(f"{path}: invalid 'top' params:\n  top.rate = 'fast': ")


def test_each_params_file_problem_has_its_own_message(tmp_path):
    """x_read_params__mutmut_7/9 (bad YAML, not a mapping), x__describe__mutmut_26/27 (a missing
    required key), x_validate_section__mutmut_1/2/13 (the default source, one line a problem)."""
    from clipms.schema import Section
    from pipeline.params import ParamsError, read_params, validate_section

    path = tmp_path / "params.yaml"
    path.write_text("top: [unclosed\n")
    with pytest.raises(ParamsError, match=f"^{path}: not valid YAML: "):
        read_params(path)
    path.write_text("- a\n- b\n")
    with pytest.raises(ParamsError) as err:
        read_params(path)
    assert str(err.value) == f"{path}: the top level must be a mapping of sections"

    class Needs(Section):
        size: int
        name: str

    with pytest.raises(ParamsError) as err:
        validate_section("needs", Needs, {"name": 3})
    assert str(err.value) == ("params: invalid 'needs' params:\n  needs.size: required but "
                              "missing\n  needs.name = 3: Input should be a valid string")
