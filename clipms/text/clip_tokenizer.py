"""CLIP-style byte-level BPE tokenizer: OpenAI's vocabulary (bit-exact with open_clip) or one
trained on a caption corpus, saved as one JSON file.

Pipeline for both kinds (it is open_clip's `SimpleTokenizer`):
  1. clean (Python): `ftfy.fix_text`, `html.unescape` twice, whitespace collapsed to single spaces,
     stripped, lower-cased;
  2. pre-tokenise (Rust, `tokenizers`): open_clip's regex (contractions, letter runs, single digits,
     runs of other symbols), then bytes -> GPT-2 byte-level characters;
  3. BPE with `</w>` marking the end of each word;
  4. `[SOT] + ids + [EOT]`, cut to `context_length` with EOT kept last, padded with 0.

Ids:
  - `openai`: 49,408 tokens, id 0 is the byte `!` (open_clip pads with it too: the text tower pools
    at EOT under a causal mask, so what follows EOT never matters), SOT 49406, EOT 49407.
  - trained (`bpe`): id 0 is a dedicated `<|pad|>` token that no text ever produces, then the 512
    byte-level base symbols (each byte, and each byte + `</w>`), then the learned merges, then SOT
    and EOT as the two highest ids (EOT = vocab_size - 1, so EOT pooling = argmax over the ids).
    The merges are learned by `clipms.text.bpe` (deterministic: the same captions give the same file
    in every process; `tokenizers`' BpeTrainer breaks ties between equal counts in hash-map order).
"""

from __future__ import annotations

import gzip
import html
import json
from collections import Counter
from collections.abc import Iterable, Sequence
from functools import lru_cache
from importlib import resources
from pathlib import Path
from typing import Any

import ftfy
import numpy as np
from tokenizers import Regex, decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as HFTokenizer

from clipms.text.bpe import learn_merges
from clipms.utils.jsonio import write_json

SOT = "<|startoftext|>"
EOT = "<|endoftext|>"
PAD = "<|pad|>"
EOW = "</w>"
# open_clip's pre-tokenisation pattern (the special tokens are matched earlier, as added tokens).
SPLIT_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d|[\p{L}]+|[\p{N}]|[^\s\p{L}\p{N}]+"""
OPENAI_VOCAB_ASSET = "bpe_simple_vocab_16e6.txt.gz"
OPENAI_NUM_MERGES = 49152 - 256 - 2  # open_clip reads exactly this many merge lines
FORMAT = "clipms.text.clip_tokenizer"
FORMAT_VERSION = 1
MIN_TRAINED_VOCAB = 1 + 512 + 1 + 2  # pad + byte symbols + at least one merge + SOT/EOT


class TokenizerError(ValueError):
    """Bad tokenizer input, parameters or file."""


@lru_cache(maxsize=1)
def byte_to_unicode() -> dict[int, str]:
    """GPT-2/CLIP's reversible map of the 256 bytes to printable characters, in CLIP's order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    chars = list(printable)
    extra = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            chars.append(256 + extra)
            extra += 1
    return {byte: chr(char) for byte, char in zip(printable, chars, strict=True)}


def fix_text(text: str) -> str:
    """`ftfy.fix_text(text)`, without ftfy when it could change nothing: on printable ASCII with
    no `&` (most captions and queries). Each of ftfy's fixes needs a character outside that set:
    an HTML entity starts with `&`; mojibake, curly quotes, ligatures, wide characters and C1
    controls are not ASCII; terminal escapes, other control characters and `\r` line breaks are
    not printable; ASCII is already NFC. ftfy costs about as much per short text as the whole BPE
    (profiled in the service), and the service tokenizes every query."""
    if text.isascii() and text.isprintable() and "&" not in text:
        return text
    return ftfy.fix_text(text)


def clean_text(text: str) -> str:
    """open_clip's default cleaning: ftfy, html unescape twice, whitespace collapse, lower case."""
    text = fix_text(text)
    text = html.unescape(html.unescape(text)).strip()
    return " ".join(text.split()).lower()


def _byte_symbols() -> list[str]:
    """The 512 base symbols of a CLIP vocabulary: every byte character, then each with `</w>`."""
    chars = list(byte_to_unicode().values())
    return chars + [c + EOW for c in chars]


def _pre_tokenizer() -> pre_tokenizers.PreTokenizer:
    """open_clip's regex split (the matches are the words), then bytes -> byte-level characters."""
    return pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(SPLIT_PATTERN), behavior="removed", invert=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])


def _build(vocab: dict[str, int], merges: list[tuple[str, str]],
           context_length: int) -> HFTokenizer:
    """A `tokenizers` pipeline behaving as open_clip's SimpleTokenizer (cleaning is in Python)."""
    tok = HFTokenizer(models.BPE(vocab=vocab, merges=merges, end_of_word_suffix=EOW))
    tok.pre_tokenizer = _pre_tokenizer()
    tok.add_special_tokens([SOT, EOT])  # a literal "<|endoftext|>" maps to EOT, as in open_clip
    tok.post_processor = processors.TemplateProcessing(
        single=f"{SOT} $A {EOT}", special_tokens=[(SOT, vocab[SOT]), (EOT, vocab[EOT])])
    # Truncation counts the two special tokens, so a long text keeps SOT + the first ctx-2 + EOT.
    tok.enable_truncation(max_length=context_length)
    tok.decoder = decoders.ByteLevel()
    return tok


def _word_counts(texts: Iterable[str]) -> Counter[str]:
    """How often each word (byte-level characters, as the BPE sees it) occurs in the cleaned
    texts. Only the distinct space-separated chunks go through the pre-tokeniser: no word of it
    holds a space (every alternative of SPLIT_PATTERN excludes whitespace), so a chunk splits
    alone as it does inside its text, and pre-tokenising every caption of a large corpus costs
    ten times more than counting them (Python objects per word)."""
    chunks: Counter[str] = Counter()
    for text in _checked(texts):
        chunks.update(clean_text(text).split(" "))
    split = _pre_tokenizer().pre_tokenize_str
    counts: Counter[str] = Counter()
    for chunk, n in chunks.items():
        for word, _ in split(chunk):
            counts[word] += n
    return counts


def _read_openai_merges(path: Path | str | None) -> list[tuple[str, str]]:
    if path is None:
        handle = resources.files("clipms").joinpath("assets", OPENAI_VOCAB_ASSET).open("rb")
    else:
        path = Path(path)
        if not path.is_file():
            raise TokenizerError(f"OpenAI BPE vocabulary not found: {path}")
        handle = path.open("rb")
    with handle, gzip.open(handle, "rt", encoding="utf-8") as text:
        lines = text.read().split("\n")[1:OPENAI_NUM_MERGES + 1]
    if len(lines) != OPENAI_NUM_MERGES or any(len(line.split()) != 2 for line in lines):
        raise TokenizerError(f"{path or OPENAI_VOCAB_ASSET}: not an OpenAI CLIP BPE merges file "
                             f"(expected {OPENAI_NUM_MERGES} lines of 'a b' after the header)")
    return [tuple(line.split()) for line in lines]  # type: ignore[misc]


class Tokenizer:
    """Encode captions to fixed-length int32 id arrays (see the module docstring for the ids)."""

    def __init__(self, backend: HFTokenizer, kind: str, context_length: int) -> None:
        if context_length < 2:
            raise TokenizerError(f"context_length must be >= 2 (SOT + EOT), got {context_length}")
        self._tok = backend
        self.kind = kind
        self.context_length = int(context_length)
        self.sot_id = self._id_of(SOT)
        self.eot_id = self._id_of(EOT)
        self.vocab_size = backend.get_vocab_size(with_added_tokens=True)
        self.pad_id = 0
        if self.eot_id != self.vocab_size - 1 or self.sot_id != self.vocab_size - 2:
            raise TokenizerError(f"SOT/EOT must be the two highest ids, got {self.sot_id}/"
                                 f"{self.eot_id} for vocab size {self.vocab_size}")

    def _id_of(self, token: str) -> int:
        token_id = self._tok.token_to_id(token)
        if token_id is None:
            raise TokenizerError(f"tokenizer has no {token} token")
        return token_id

    # --- construction -------------------------------------------------------------------------
    @classmethod
    def openai(cls, context_length: int = 77, bpe_path: Path | str | None = None) -> Tokenizer:
        """OpenAI CLIP's vocabulary (packaged with clipms, MIT), bit-exact with open_clip's ids."""
        merges = _read_openai_merges(bpe_path)
        tokens = _byte_symbols() + ["".join(m) for m in merges] + [SOT, EOT]
        vocab = {token: i for i, token in enumerate(tokens)}
        return cls(_build(vocab, merges, context_length), "openai", context_length)

    @classmethod
    def train(cls, texts: Iterable[str], vocab_size: int, context_length: int,
              min_frequency: int = 2) -> Tokenizer:
        """Train a CLIP-style BPE of at most `vocab_size` ids on captions (fewer if the corpus runs
        out of pairs that occur `min_frequency` times; `.vocab_size` is the real size). The same
        captions always give the same tokenizer (`clipms.text.bpe`: ties go to the smallest ids)."""
        if vocab_size < MIN_TRAINED_VOCAB:
            raise TokenizerError(f"vocab_size must be >= {MIN_TRAINED_VOCAB} (pad + 512 byte "
                                 f"symbols + SOT/EOT + at least one merge), got {vocab_size}")
        base = _byte_symbols()
        merges = learn_merges(_word_counts(texts), base, max_new_tokens=vocab_size - 3 - len(base),
                              min_frequency=min_frequency, end_of_word=EOW)
        vocab = {PAD: 0}
        for token in [*base, *("".join(m) for m in merges)]:
            vocab.setdefault(token, len(vocab))  # a merge can make an existing token again
        vocab[SOT] = len(vocab)
        vocab[EOT] = len(vocab)
        return cls(_build(vocab, merges, context_length), "bpe", context_length)

    # --- persistence --------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {
            "format": FORMAT, "version": FORMAT_VERSION, "kind": self.kind,
            "context_length": self.context_length, "vocab_size": self.vocab_size,
            "sot_id": self.sot_id, "eot_id": self.eot_id, "pad_id": self.pad_id,
            "cleaning": "ftfy.fix_text; html.unescape x2; whitespace collapsed; lower case",
            "tokenizers": json.loads(self._tok.to_str()),
        }

    def save(self, path: Path | str) -> None:
        """Write kind, context length, ids and the `tokenizers` pipeline to one JSON file."""
        write_json(path, self.to_dict())

    @classmethod
    def from_dict(cls, data: dict[str, Any], source: str = "tokenizer dict") -> Tokenizer:
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise TokenizerError(f"{source}: not a clipms tokenizer file (format != {FORMAT!r})")
        missing = [k for k in ("kind", "context_length", "tokenizers") if k not in data]
        if missing:
            raise TokenizerError(f"{source}: missing keys {missing}")
        backend = HFTokenizer.from_str(json.dumps(data["tokenizers"]))
        return cls(backend, str(data["kind"]), int(data["context_length"]))

    @classmethod
    def load(cls, path: Path | str) -> Tokenizer:
        path = Path(path)
        try:
            data = json.loads(path.read_text())
        except FileNotFoundError as err:
            raise TokenizerError(f"tokenizer file not found: {path}") from err
        except json.JSONDecodeError as err:
            raise TokenizerError(f"{path}: not valid JSON: {err}") from err
        return cls.from_dict(data, source=str(path))

    # --- encoding -----------------------------------------------------------------------------
    def encode(self, texts: Sequence[str] | str) -> np.ndarray:
        """int32 (N, context_length): SOT, ids, EOT (kept last when cut), then 0s."""
        if isinstance(texts, str):
            texts = [texts]
        cleaned = [clean_text(t) for t in _checked(texts)]
        out = np.zeros((len(cleaned), self.context_length), dtype=np.int32)
        for row, encoding in zip(out, self._tok.encode_batch(cleaned), strict=True):
            ids = encoding.ids
            row[:len(ids)] = ids
        return out

    __call__ = encode  # open_clip style: tokenizer(texts)

    def unknown_words(self, texts: Iterable[str]) -> tuple[Counter[str], int]:
        """The words of `texts` (cleaned and split as `encode` does) that have no token of their
        own, with their counts, and how many words there are in all. A byte-level BPE encodes any
        text, so nothing is strictly unknown; a word without a whole-word token is one it did not
        learn as a word (a new name, a typo, another language) and spells from pieces."""
        vocab = self._tok.get_vocab(with_added_tokens=False)
        counts = _word_counts(texts)
        inverse = {c: b for b, c in byte_to_unicode().items()}
        unknown: Counter[str] = Counter()
        for word, n in counts.items():
            if word + EOW not in vocab:
                text = bytes(inverse.get(c, ord("?")) for c in word)
                unknown[text.decode("utf-8", errors="replace")] += n
        return unknown, sum(counts.values())

    def decode(self, ids: Sequence[int] | np.ndarray) -> str:
        """Text of one id row, without SOT/EOT/padding (lower-cased and cleaned, as encoded)."""
        ids = [int(i) for i in ids]
        if self.eot_id in ids:
            ids = ids[:ids.index(self.eot_id)]
        ids = [i for i in ids if i != self.sot_id and not (self.kind == "bpe" and i == self.pad_id)]
        tokens = [self._tok.id_to_token(i) or "" for i in ids]
        text = "".join(tokens).replace(EOW, " ")
        inverse = {c: b for b, c in byte_to_unicode().items()}
        raw = bytes(inverse[c] if c in inverse else ord(" ") for c in text)
        return raw.decode("utf-8", errors="replace").strip()

    def __repr__(self) -> str:
        return (f"Tokenizer(kind={self.kind!r}, vocab_size={self.vocab_size}, "
                f"context_length={self.context_length})")


def _checked(texts: Iterable[Any]) -> Iterable[str]:
    for i, text in enumerate(texts):
        if not isinstance(text, str):
            raise TokenizerError(f"text {i} is {type(text).__name__}, expected str: {text!r:.60}")
        yield text
