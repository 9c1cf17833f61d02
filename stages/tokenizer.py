"""Stage `tokenizer`: train captions of data/shards -> models/tokenizer.json.

`python -m stages.tokenizer`; reads the `tokenizer` section. `kind: bpe` trains a CLIP-style BPE on
every caption of the train split; `kind: openai` writes OpenAI CLIP's vocabulary (shipped with
clipms, or `openai_vocab`: another merges file of that format) and ignores the train captions.
"""

from __future__ import annotations

import sys
import time
from typing import Literal

from pydantic import Field

from clipms.data.dataset import DataError, iter_captions
from clipms.schema import Section
from clipms.text.tokenizer import MIN_TRAINED_VOCAB, Tokenizer, TokenizerError
from pipeline.params import ParamsError, load_section
from stages import paths

READS = (paths.SHARDS_TRAIN, paths.MANIFEST)
WRITES = (paths.TOKENIZER,)


class TokenizerParams(Section):
    kind: Literal["bpe", "openai"] = "bpe"
    vocab_size: int = Field(4096, ge=MIN_TRAINED_VOCAB, le=1_000_000)  # bpe: an upper bound
    context_length: int = Field(32, ge=2, le=4096)
    min_frequency: int = Field(2, ge=1)  # bpe: a merge needs a pair seen this often
    openai_vocab: str | None = None  # openai: a .txt.gz merges file; null = the packaged copy


def build(params: TokenizerParams) -> Tokenizer:
    if params.kind == "openai":
        return Tokenizer.openai(params.context_length, params.openai_vocab)
    captions = list(iter_captions(paths.SHARDS, "train"))
    if not captions:
        raise DataError(f"{paths.SHARDS}: the train split has no captions to train on")
    print(f"tokenizer: training a BPE on {len(captions)} train captions")
    return Tokenizer.train(captions, params.vocab_size, params.context_length,
                           min_frequency=params.min_frequency)


def main() -> int:
    started = time.perf_counter()
    try:
        params = load_section("tokenizer", TokenizerParams)
        tokenizer = build(params)
    except (ParamsError, DataError, TokenizerError) as err:
        print(f"tokenizer: error: {err}", file=sys.stderr)
        return 1
    tokenizer.save(paths.TOKENIZER)
    print(f"tokenizer: wrote {paths.TOKENIZER}: kind {tokenizer.kind}, {tokenizer.vocab_size} ids "
          f"(SOT {tokenizer.sot_id}, EOT {tokenizer.eot_id}, pad 0), context "
          f"{tokenizer.context_length}, in {time.perf_counter() - started:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
