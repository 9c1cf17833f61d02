"""The base of every settings schema, and which settings change the trained weights, declared on
the schema itself.

A field made with `cadence(...)` cannot change what a training run computes (how often to log or
checkpoint, how many loader processes, which device of a host); `weights_view` is a config as JSON
data without those fields, nested sections included: the resume fingerprint hashes it
(`clipms.train.recipe.TrainConfig.fingerprint`), so no list of keys is kept by hand.
"""

# tested by: tests/pipeline/test_params.py

from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel, ConfigDict, Field


class Section(BaseModel):
    """Base of every settings section (a `params.yaml` section in the pipeline): unknown keys are
    errors, values are validated on assignment."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, frozen=False)


_CADENCE = {"weights": False}  # the json_schema_extra that marks a cadence field


def cadence(default: Any, **constraints: Any) -> Any:
    """A pydantic Field that does not change the trained weights."""
    return Field(default, json_schema_extra=_CADENCE, **constraints)


def is_cadence(model: type[BaseModel], name: str) -> bool:
    return model.model_fields[name].json_schema_extra == _CADENCE


def weights_view(model: BaseModel) -> dict[str, Any]:
    """`model` as JSON data without its cadence fields (recursively into nested models)."""
    out = {}
    for name in type(model).model_fields:
        if is_cadence(type(model), name):
            continue
        value = getattr(model, name)
        out[name] = weights_view(value) if isinstance(value, BaseModel) else value
    return json.loads(json.dumps(out, default=_plain))


def _plain(value: Any) -> Any:
    if hasattr(value, "to_dict"):
        return value.to_dict()  # dataclass configs (CLIPConfig)
    raise TypeError(f"{type(value).__name__} is not JSON data")
