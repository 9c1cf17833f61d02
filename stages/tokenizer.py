"""Stage `tokenizer`: train captions of data/shards -> models/tokenizer.json (+ where it came from,
metrics/tokenizer.json).

`python -m stages.tokenizer`; reads the `tokenizer` section. `kind: bpe` trains a CLIP-style BPE on
every caption of the train split; `kind: openai` writes OpenAI CLIP's vocabulary (shipped with
clipms, or `openai_vocab`: another merges file of that format) and ignores the train captions.
`pin: models:/clip@champion` copies that registered version's tokenizer instead (byte for byte:
the same ids, so training can start from its weights), unless no version of the model was ever
registered (the first night: it is built as above); any other registry miss stops the stage.
metrics/tokenizer.json says where the file came from.
"""

# tested by: tests/benchmarks/test_rehearsal.py

from __future__ import annotations

import sys
import time
from typing import Literal

from pydantic import Field

from clipms.data.dataset import DataError, iter_captions
from clipms.schema import Section
from clipms.text.clip_tokenizer import MIN_TRAINED_VOCAB, Tokenizer, TokenizerError
from clipms.utils.jsonio import write_json
from pipeline import paths
from pipeline.params import ParamsError, load_section
from registry.versions import MODEL_URI

READS = (paths.SHARDS_TRAIN, paths.MANIFEST)
WRITES = (paths.TOKENIZER, paths.TOKENIZER_METRICS)


class TokenizerParams(Section):
    kind: Literal["bpe", "openai"] = "bpe"
    vocab_size: int = Field(4096, ge=MIN_TRAINED_VOCAB, le=1_000_000)  # bpe: an upper bound
    context_length: int = Field(32, ge=2, le=4096)
    min_frequency: int = Field(2, ge=1)  # bpe: a merge needs a pair seen this often
    openai_vocab: str | None = None  # openai: a .txt.gz merges file; null = the packaged copy
    pin: str | None = Field(None, pattern=MODEL_URI.pattern)  # models:/NAME@ALIAS | /VERSION


def build(params: TokenizerParams) -> Tokenizer:
    if params.kind == "openai":
        return Tokenizer.openai(params.context_length, params.openai_vocab)
    captions = list(iter_captions(paths.SHARDS, "train"))
    if not captions:
        raise DataError(f"{paths.SHARDS}: the train split has no captions to train on")
    print(f"tokenizer: training a BPE on {len(captions)} train captions")
    return Tokenizer.train(captions, params.vocab_size, params.context_length,
                           min_frequency=params.min_frequency)


def pinned(params: TokenizerParams) -> tuple[Tokenizer | None, dict[str, str | None]]:
    """The pinned version's tokenizer, copied to models/tokenizer.json, and where it came from;
    (None, ...) on the first night (nothing registered yet)."""
    from registry.carryover import pin_tokenizer

    carried = pin_tokenizer(str(params.pin), paths.TOKENIZER)
    source = {"pin": params.pin, **carried.lineage("tokenizer")}
    if carried.version is None:
        print(f"tokenizer: {source['lineage.tokenizer_from']}: building one")
        return None, source
    return Tokenizer.load(paths.TOKENIZER), source


def main() -> int:
    from registry.carryover import CarryOverError

    started = time.perf_counter()
    try:
        params = load_section("tokenizer", TokenizerParams)
        tokenizer, source = pinned(params) if params.pin else (None, {"pin": None})
        if tokenizer is None:
            tokenizer = build(params)
            tokenizer.save(paths.TOKENIZER)
            source["lineage.tokenizer_from"] = "trained on this run's train captions"
    except (ParamsError, DataError, TokenizerError, CarryOverError) as err:
        print(f"tokenizer: error: {err}", file=sys.stderr)
        return 1
    write_json(paths.TOKENIZER_METRICS, {"kind": tokenizer.kind,
                                         "vocab_size": tokenizer.vocab_size,
                                         "context_length": tokenizer.context_length, **source})
    print(f"tokenizer: wrote {paths.TOKENIZER} ({source['lineage.tokenizer_from']}): kind "
          f"{tokenizer.kind}, {tokenizer.vocab_size} ids (SOT {tokenizer.sot_id}, EOT "
          f"{tokenizer.eot_id}, pad 0), context {tokenizer.context_length}, in "
          f"{time.perf_counter() - started:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
