"""Stage `changes`: what the new data brought since the last accepted run -> metrics/changes.json,
and a stop before training when it looks broken.

`python -m stages.changes`; reads the `changes` section. Compares data/metadata.parquet,
data/images.parquet and the download catalog (data/download) with the snapshot of the last run
whose report passed (data/changes, a `persist: true` out: DVC keeps and versions it), and counts
new caption words the tokenizer of models/tokenizer.json has no token for. Writes the report
first, then exits 1 naming every failed check (the snapshot is left as it was), or accepts today
as the new snapshot. `train` depends on the report, so a failed check stops the run before any
training; train logs the report into the pipeline's MLflow run.
"""

from __future__ import annotations

import sys
from typing import Literal

from pydantic import Field

from clipms.schema import Section
from clipms.text.clip_tokenizer import Tokenizer, TokenizerError
from pipeline import paths
from pipeline.params import ParamsError, load_section
from prep.catalog import CatalogError, read_catalog
from prep.delta import ChangesError, Thresholds, run

READS = (paths.METADATA, paths.IMAGES, paths.DOWNLOAD, paths.TOKENIZER)
WRITES = (paths.CHANGES_STATE, paths.CHANGES_METRICS)


class ChangesParams(Section):
    """The `changes` section: the checks that stop a run before training (prep.delta)."""

    # most new images failing to download (or refused by the URL policy)
    max_new_failure_rate: float = Field(0.5, ge=0.0, le=1.0)
    # new caption rows (metadata rows) that are empty or blank
    max_empty_caption_share: float = Field(0.1, ge=0.0, le=1.0)
    # a schema change of the metadata: the source's columns, populated columns, label fields
    on_schema_change: Literal["fail", "warn"] = "fail"
    # new captions' words without a token of their own (null: reported, not checked)
    max_unknown_word_share: float | None = Field(None, ge=0.0, le=1.0)
    min_new: int = Field(20, ge=1)  # the share checks apply from this many new images/rows


def main() -> int:
    try:
        params = load_section("changes", ChangesParams)
        run(paths.METADATA, paths.IMAGES, read_catalog(paths.DOWNLOAD),
            Tokenizer.load(paths.TOKENIZER), paths.CHANGES_STATE, paths.CHANGES_METRICS,
            Thresholds(**params.model_dump()))
    except (ParamsError, CatalogError, TokenizerError, FileNotFoundError, ChangesError) as err:
        print(f"changes: error: {err}", file=sys.stderr)  # a failed check: metrics are written
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
