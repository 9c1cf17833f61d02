"""The `evaluate` params section as a schema (the evaluate stage's; `register` reads it too, to
re-score a champion exactly as `evaluate` scored the new version), and the zero-shot spec it
means for `clipms.eval.scoring`.
"""

# tested by: tests/ops/test_preflight.py

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Literal

from pydantic import Field, field_validator

from clipms.schema import Section

if TYPE_CHECKING:
    from clipms.eval.scoring import ZeroShotSpec

_FIELD = re.compile(r"[A-Za-z0-9_]+")
PINNED_SET_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")  # a folder name, never a path


def _checked_templates(templates: list[str]) -> list[str]:
    missing = [t for t in templates if "{}" not in t]
    if missing:
        raise ValueError(f"templates need a '{{}}' placeholder for the class name: {missing}")
    return templates


class ZeroShotParams(Section):
    source: Literal["labels", "folder", "webdataset", "none"] = "labels"
    label_fields: list[str] = Field(default_factory=lambda: ["colour", "shape"], min_length=1)
    templates: list[str] = Field(default_factory=lambda: ["a picture of a {}."], min_length=1)
    path: str | None = None
    class_names: list[str] | None = None
    # label field -> its prompt templates: one zero-shot classification per field
    attributes: dict[str, list[str]] = Field(default_factory=dict)

    _templates = field_validator("templates")(_checked_templates)

    @field_validator("attributes")
    @classmethod
    def _attribute_fields(cls, value: dict[str, list[str]]) -> dict[str, list[str]]:
        for name, templates in value.items():
            if not _FIELD.fullmatch(name):
                raise ValueError(f"{name!r}: a label field name is letters, digits and _")
            if not templates:
                raise ValueError(f"{name}: needs at least one prompt template")
            _checked_templates(templates)
        return value


class GalleryParams(Section):
    text_queries: int = Field(6, ge=0, le=24)  # captions whose top-K images are shown
    image_queries: int = Field(3, ge=0, le=12)  # images whose top-K captions are shown
    top_k: int = Field(5, ge=1, le=10)


class ClipBenchmarkParams(Section):
    dataset: str | None = None  # null: <metadata.source>_<split>
    zeroshot_dataset: str | None = None  # null: <dataset>/<label fields> (source: labels)
    model: str | None = None  # null: clipms-<train.preset>


class EvaluateParams(Section):
    """The `evaluate` section of params.yaml (params.yaml documents each key)."""

    batch_size: int = Field(128, ge=1)
    split: str = "val"
    # A frozen evaluation set (its name under the pipeline's pinned-sets folder) scored instead
    # of `split`: the same yardstick for every night (docs/mlflow.md, "A pinned evaluation set").
    pinned_set: str | None = Field(None, pattern=PINNED_SET_NAME.pattern)
    zeroshot: ZeroShotParams = ZeroShotParams()
    gallery: GalleryParams = GalleryParams()
    clip_benchmark: ClipBenchmarkParams = ClipBenchmarkParams()

    def zeroshot_spec(self) -> ZeroShotSpec:
        from clipms.eval.scoring import ZeroShotSpec

        zs = self.zeroshot
        return ZeroShotSpec(source=zs.source, templates=tuple(zs.templates),
                            label_fields=tuple(zs.label_fields), path=zs.path,
                            class_names=tuple(zs.class_names) if zs.class_names else None,
                            attributes=tuple((f, tuple(t)) for f, t in zs.attributes.items()))
