"""Tokenizer: open_clip's ids bit-exact for the OpenAI vocabulary; the trained BPE contract."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import numpy as np
import pytest

from clipms.prep.synthetic import image_rng, sample_scene, write_captions
from clipms.tokenizer import Tokenizer, TokenizerError, clean_text

GOLDEN = json.loads((Path(__file__).parent / "data/openclip_tokenizer/tokens.json").read_text())


@pytest.fixture(scope="module")
def openai() -> Tokenizer:
    return Tokenizer.openai(context_length=GOLDEN["context_length"])


def synthetic_captions(n_images: int = 150, seed: int = 0) -> list[str]:
    """The captions of the project's synthetic dataset (5 per image, with near/exact duplicates)."""
    captions = []
    for index in range(n_images):
        rng = image_rng(seed, index)
        captions.extend(write_captions(sample_scene(rng), rng))
    return captions


# Plain ids: `make mutation` hands node ids back to pytest, and repr'd texts (quotes, escapes,
# non-ASCII) do not select their test again.
@pytest.mark.parametrize("case", GOLDEN["cases"],
                         ids=[f"golden{i}" for i in range(len(GOLDEN["cases"]))])
def test_openai_ids_match_open_clip(openai: Tokenizer, case: dict) -> None:
    ids = openai.encode([case["text"]])
    assert ids.dtype == np.int32 and ids.shape == (1, GOLDEN["context_length"])
    assert ids[0].tolist() == case["ids"]


def test_openai_batch_equals_single_and_special_ids(openai: Tokenizer) -> None:
    texts = [c["text"] for c in GOLDEN["cases"]]
    batch = openai.encode(texts)
    assert batch.tolist() == [c["ids"] for c in GOLDEN["cases"]]
    assert openai.encode(texts[1]).tolist() == [GOLDEN["cases"][1]["ids"]]  # a bare str works too
    assert np.array_equal(openai(texts), batch)  # callable, as open_clip's tokenizer
    assert (openai.vocab_size, openai.sot_id, openai.eot_id) == (
        GOLDEN["vocab_size"], GOLDEN["sot"], GOLDEN["eot"])


def test_openai_save_load_round_trip(openai: Tokenizer, tmp_path: Path) -> None:
    openai.save(tmp_path / "tokenizer.json")
    loaded = Tokenizer.load(tmp_path / "tokenizer.json")
    assert (loaded.kind, loaded.context_length, loaded.vocab_size) == ("openai", 77, 49408)
    texts = [c["text"] for c in GOLDEN["cases"]]
    assert np.array_equal(loaded.encode(texts), openai.encode(texts))


def test_cleaning_is_open_clips() -> None:
    assert clean_text("  Caf&amp;amp;é\tTWO\n\nlines ") == "caf&é two lines"
    assert clean_text("") == ""


def test_trained_tokenizer_contract_and_round_trip(tmp_path: Path) -> None:
    captions = synthetic_captions()
    tok = Tokenizer.train(captions, vocab_size=700, context_length=16)
    assert tok.kind == "bpe" and 516 <= tok.vocab_size <= 700
    assert (tok.sot_id, tok.eot_id) == (tok.vocab_size - 2, tok.vocab_size - 1)
    ids = tok.encode(captions)
    assert ids.dtype == np.int32 and ids.shape == (len(captions), 16)
    assert (ids[:, 0] == tok.sot_id).all()
    eot_pos = ids.argmax(axis=1)  # EOT pooling: the highest id is the EOT
    assert (ids[np.arange(len(ids)), eot_pos] == tok.eot_id).all()
    after_eot = np.arange(16)[None, :] > eot_pos[:, None]
    assert (ids[after_eot] == 0).all() and not (ids[~after_eot] == 0).any()  # 0 is padding only
    # decode gives the cleaned text back (words are separated at punctuation, as open_clip's),
    # for every caption that fits the context untruncated (EOT before the last position).
    untruncated = np.flatnonzero(eot_pos < 15)
    assert len(untruncated) > len(captions) // 4
    for row in untruncated[:50]:
        decoded = tok.decode(ids[row]).replace(" ", "")
        assert decoded == clean_text(captions[row]).replace(" ", "")

    tok.save(tmp_path / "tokenizer.json")
    loaded = Tokenizer.load(tmp_path / "tokenizer.json")
    assert (loaded.kind, loaded.vocab_size, loaded.eot_id) == ("bpe", tok.vocab_size, tok.eot_id)
    assert np.array_equal(loaded.encode(captions), ids)
    # Training is deterministic: the same corpus gives the same ids.
    again = Tokenizer.train(captions, vocab_size=700, context_length=16)
    assert np.array_equal(again.encode(captions), ids)


def test_trained_tokenizer_truncates_keeping_eot_and_handles_unseen_text() -> None:
    tok = Tokenizer.train(synthetic_captions(40), vocab_size=600, context_length=6)
    ids = tok.encode(["a big red circle on the left of a blue square", "東京 😀 ÿ", ""])
    assert ids[0, -1] == tok.eot_id and ids[0, 0] == tok.sot_id and (ids[0, 1:-1] > 0).all()
    assert (ids[1] > 0).sum() >= 3  # unseen characters fall back to byte symbols, never dropped
    assert ids[2].tolist() == [tok.sot_id, tok.eot_id, 0, 0, 0, 0]


def test_clear_errors(tmp_path: Path) -> None:
    with pytest.raises(TokenizerError, match="vocab_size must be >= 516"):
        Tokenizer.train(["a cat"], vocab_size=400, context_length=8)
    with pytest.raises(TokenizerError, match="text 1 is int"):
        Tokenizer.openai(8).encode(["ok", 3])  # type: ignore[list-item]
    with pytest.raises(TokenizerError, match="not found"):
        Tokenizer.load(tmp_path / "missing.json")
    with pytest.raises(TokenizerError, match="vocabulary not found"):
        Tokenizer.openai(8, bpe_path=tmp_path / "missing.txt.gz")
    (tmp_path / "short.txt.gz").write_bytes(gzip.compress(b"#version: 0.2\na b\n"))
    with pytest.raises(TokenizerError, match="not an OpenAI CLIP BPE merges file"):
        Tokenizer.openai(8, bpe_path=tmp_path / "short.txt.gz")
    (tmp_path / "bad.json").write_text('{"format": "something else"}')
    with pytest.raises(TokenizerError, match="not a clipms tokenizer"):
        Tokenizer.load(tmp_path / "bad.json")


@pytest.mark.slow
def test_tokenizer_stage_with_dvc(tmp_path: Path) -> None:
    from tests.test_data import CAPTIONS, write_shards
    from tests.workspace import make_workspace, run, set_params

    ws = make_workspace(tmp_path / "ws", {"tokenizer.min_frequency": 1})
    write_shards(ws / "data/shards", {"train": [6, 5], "val": [3]})
    out = run(["dvc", "repro", "--single-item", "tokenizer"], cwd=ws)
    assert "training a BPE on 33 train captions" in out.stdout  # 11 images x 3 captions
    tok = Tokenizer.load(ws / "models/tokenizer.json")
    assert tok.kind == "bpe" and tok.context_length == 16 and tok.vocab_size <= 600
    ids = tok.encode(["sample 3 caption 1"])[0]
    assert tok.decode(ids) == "sample 3 caption 1" and CAPTIONS == 3
    assert "didn't change" in run(["dvc", "repro", "--single-item", "tokenizer"], cwd=ws).stdout

    # A param change reruns the stage (set in params.yaml: `dvc exp run` would check out the
    # shard stage's outputs, which this test wrote by hand instead of running that stage).
    set_params(ws / "params.yaml", {"tokenizer.kind": "openai"})
    run(["dvc", "repro", "--single-item", "tokenizer"], cwd=ws)
    assert Tokenizer.load(ws / "models/tokenizer.json").vocab_size == 49408

    set_params(ws / "params.yaml", {"tokenizer.kind": "wordpiece"})
    bad = run(["dvc", "repro", "--single-item", "tokenizer"], cwd=ws, check=False)
    assert bad.returncode != 0 and "tokenizer.kind = 'wordpiece'" in bad.stdout + bad.stderr


def test_edges_make_mutation_found(openai: Tokenizer, tmp_path: Path) -> None:
    """Mutants `make mutation` found alive (issue 14.10; mutmut names): the saved file's fields
    (xǁTokenizerǁto_dict 3/4/9-20, __init__ 15/16), openai's defaults (openai 1/12/23/24), the
    shortest context (__init__ 1-3), the trained size and the frequency threshold (train 1/2/11/16/
    32), padding and broken bytes in decode (decode 12-14/39/42/43), the error messages of a
    missing key, bad JSON and a bad merges file (from_dict 10/18, load 6/8/10/11,
    _read_openai_merges 39/45)."""
    from clipms.tokenizer import MIN_TRAINED_VOCAB, OPENAI_NUM_MERGES, byte_to_unicode

    default = Tokenizer.openai()
    assert (default.context_length, default.kind, default.pad_id) == (77, "openai", 0)
    saved = {k: v for k, v in default.to_dict().items() if k != "tokenizers"}
    assert saved == {"format": "clipms.tokenizer", "version": 1, "kind": "openai",
                     "context_length": 77, "vocab_size": 49408, "sot_id": 49406,
                     "eot_id": 49407, "pad_id": 0, "cleaning": "ftfy.fix_text; html.unescape "
                     "x2; whitespace collapsed; lower case"}
    assert Tokenizer.openai(2).encode(["a cat"]).tolist() == [[49406, 49407]]
    with pytest.raises(TokenizerError, match=r"^context_length must be >= 2 \(SOT \+ EOT\), "
                                             r"got 1$"):
        Tokenizer.openai(1)

    words = synthetic_captions(40)
    rich = Tokenizer.train(words, vocab_size=600, context_length=8)
    assert rich.vocab_size == 600  # a corpus with enough pairs gives exactly the size asked
    assert Tokenizer.train(words, vocab_size=MIN_TRAINED_VOCAB, context_length=8).vocab_size == \
        MIN_TRAINED_VOCAB
    once, twice = (Tokenizer.train(["qz"] * n, vocab_size=600, context_length=8)
                   for n in (1, 2))
    assert (once.vocab_size, twice.vocab_size) == (515, 516)  # min_frequency 2: no merge of one

    ids = rich.encode(["a red"])[0].tolist()
    assert rich.decode([ids[0], rich.pad_id, *ids[1:]]) == "a red"  # a stray pad is dropped
    assert openai.decode(openai.encode(["wow!"])[0]) == "wow !"  # openai's id 0 is "!", kept
    lone = openai._tok.token_to_id(byte_to_unicode()[0xC3])  # half of a two-byte character
    assert openai.decode([openai.sot_id, lone, openai.eot_id]) == "\ufffd"

    with pytest.raises(TokenizerError) as err:
        Tokenizer.from_dict({"format": "clipms.tokenizer", "kind": "bpe"})
    assert str(err.value) == "tokenizer dict: missing keys ['context_length', 'tokenizers']"
    (tmp_path / "half.json").write_text('{"format": "clipms.tokenizer"}')
    with pytest.raises(TokenizerError, match=f"^{tmp_path / 'half.json'}: missing keys"):
        Tokenizer.load(tmp_path / "half.json")
    (tmp_path / "broken.json").write_text("{")
    with pytest.raises(TokenizerError, match=f"^{tmp_path / 'broken.json'}: not valid JSON: "):
        Tokenizer.load(tmp_path / "broken.json")
    lines = ["#version: 0.2"] + ["a b"] * (OPENAI_NUM_MERGES - 1) + ["a b c"]
    (tmp_path / "odd.txt.gz").write_bytes(gzip.compress("\n".join(lines).encode()))
    with pytest.raises(TokenizerError, match=f"^{tmp_path / 'odd.txt.gz'}: not an OpenAI CLIP"):
        Tokenizer.openai(8, bpe_path=tmp_path / "odd.txt.gz")


TRICKY = ["&amp;", "&amp;amp;amp; triple", "Caf&amp;amp;é", "&lt;b&gt; bold", "<b>&amp;</b>",
          "&#39;quoted&#39;", "AT&T", "tom & jerry", "a&b;c", "\x1b[31mred\x1b[0m", "bell\x07",
          "nul\x00byte", "del\x7f",
          "tab\there", "line\nbreak", "crlf\r\nline", "cr\ronly", "form\x0cfeed", "  spaced  ",
          "", " ", "Ã©tÃ©", "don’t “quote”", "ﬁne ligature", "ＷＩＤＥ", "e\u0301", "\x85nel",
          "\u2028sep", "naïve café", "mixed &amp; naïve", "a photo of thing number 7", "~!@#$%^*()"]


def test_fix_text_is_ftfy_and_skips_it_only_where_ftfy_changes_nothing() -> None:
    """The ASCII fast path: fix_text == ftfy.fix_text on every text (tricky ones: entities,
    escapes, control characters, mojibake; random printable ASCII rich in `&`, `#`, `;`), and
    ftfy is really skipped (the text itself comes back) on plain printable ASCII."""
    import ftfy

    from clipms.tokenizer import fix_text

    rng = np.random.default_rng(0)
    alphabet = list("abcdefghijklmnopqrstuvwxyzABCZ0123456789 .,;:!?'\"-()&#;&ltgampquot") + [
        "\t", "\n", "\r", "\x1b", "é", "’", "Ã", "\u00a0"]
    randoms = ["".join(rng.choice(alphabet, size=int(rng.integers(0, 40)))) for _ in range(3000)]
    for text in [*TRICKY, *synthetic_captions(40), *randoms]:
        assert fix_text(text) == ftfy.fix_text(text), repr(text)
    for text in ["a photo of thing number 12", "A Red  Cube, left of 2 balls!", "x" * 300]:
        copy = "".join(list(text))  # a new object: ftfy would return another one
        assert fix_text(copy) is copy
    for text in ["&amp;", "a\x1b[0m", "tab\there", "café"]:  # not the fast path: ftfy's answer
        assert fix_text(text) is not text


def test_tokenizer_ids_are_those_of_the_ftfy_path(openai: Tokenizer) -> None:
    """Tokenizer.encode (the fast path inside) gives the ids of cleaning with ftfy on every text."""
    import html

    import ftfy

    def cleaned_by_ftfy(text: str) -> str:
        text = html.unescape(html.unescape(ftfy.fix_text(text))).strip()
        return " ".join(text.split()).lower()

    texts = [*TRICKY, *synthetic_captions(20)]
    expected = np.zeros((len(texts), openai.context_length), np.int32)
    for row, encoding in zip(expected, openai._tok.encode_batch(
            [cleaned_by_ftfy(t) for t in texts]), strict=True):
        row[:len(encoding.ids)] = encoding.ids
    np.testing.assert_array_equal(openai.encode(texts), expected)
