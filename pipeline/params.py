"""One small typed loader for params.yaml: every stage reads its own section through `load_section`.

Each stage module (and `tracking.settings`, for the `register` section the registry reads too)
declares its section as a `clipms.schema.Section` subclass; the library's own configs (runtime,
train) are Sections too, so the pipeline validates them as they are. It lives outside `stages/` so
that `registry/` and `serving/` share it without importing the stages. Unknown keys and wrong types
fail with an error that names the key, the bad value and what is allowed, before any work starts.
"""

from __future__ import annotations

import reprlib
from pathlib import Path
from typing import Any, TypeVar

import yaml
from pydantic import BaseModel, ValidationError

from clipms.schema import Section
from clipms.utils.redact import redact_text

PARAMS_FILE = Path("params.yaml")
SHOWN_CHARS = 120  # of an offending value, in an error message
# A repr that stops early at every level: a YAML alias bomb (a few lines whose nested aliases
# stand for 10^8 strings) quoted in full made a 312 MB message.
_PREVIEW = reprlib.Repr()
_PREVIEW.maxlevel = 3
_PREVIEW.maxstring = _PREVIEW.maxother = 40


S = TypeVar("S", bound=Section)


class ParamsError(ValueError):
    """A params.yaml value is missing, unknown or of the wrong type/value."""


def read_params(path: Path | str = PARAMS_FILE) -> dict[str, Any]:
    """The whole params file as a dict (an empty file is an empty dict)."""
    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except FileNotFoundError as err:
        raise ParamsError(f"{path}: not found (run from the project root)") from err
    except yaml.YAMLError as err:
        raise ParamsError(f"{path}: not valid YAML: {err}") from err
    if not isinstance(data, dict):
        raise ParamsError(f"{path}: the top level must be a mapping of sections")
    return data


def load_section(name: str, model: type[S], path: Path | str = PARAMS_FILE) -> S:
    """Validate section `name` of the params file against `model` (ParamsError on bad input)."""
    raw = read_params(path).get(name)
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ParamsError(f"{path}: section '{name}' must be a mapping, got {preview(raw)}")
    return validate_section(name, model, raw, source=str(path))


def validate_section(name: str, model: type[S], raw: dict[str, Any], source: str = "params") -> S:
    """Validate a raw mapping as section `name`; pydantic's errors become one readable message."""
    try:
        return model.model_validate(raw)
    except ValidationError as err:
        problems = [_describe(name, model, e) for e in err.errors()]
        listing = "\n  ".join(problems)
        raise ParamsError(f"{source}: invalid '{name}' params:\n  {listing}") from None


def _describe(section: str, model: type[BaseModel], error: dict[str, Any]) -> str:
    key = ".".join([section, *(str(part) for part in error["loc"])])
    if error["type"] == "extra_forbidden":
        allowed = ", ".join(_allowed_keys(model, error["loc"][:-1]))
        return f"{key}: unknown key (allowed keys here: {allowed})"
    if error["type"] == "missing":
        return f"{key}: required but missing"
    return f"{key} = {preview(error.get('input'))}: {error['msg']}"


def preview(value: Any) -> str:
    """A short repr of a bad value for an error message: at most SHOWN_CHARS characters (a
    longer one is cut, and says so), computed in bounded time whatever the value holds, with
    URL secrets and user-info redacted."""
    if isinstance(value, str):  # its start, redacted before the cut (a secret cut in two
        head = value[:SHOWN_CHARS * 8]  # might no longer look like one)
        shown = redact_text(repr(head) + ("..." if len(value) > len(head) else ""))
    else:
        shown = redact_text(_PREVIEW.repr(value))
    if len(shown) > SHOWN_CHARS:
        shown = shown[:SHOWN_CHARS] + "...(cut)"
    return shown


def _allowed_keys(model: type[BaseModel], parent: tuple[Any, ...]) -> list[str]:
    """Field names of the (possibly nested) model that holds the unknown key."""
    for part in parent:
        field = model.model_fields.get(str(part))
        annotation = getattr(field, "annotation", None)
        if not (isinstance(annotation, type) and issubclass(annotation, BaseModel)):
            return []
        model = annotation
    return sorted(model.model_fields)
