"""Tokenizer: open_clip's ids bit-exact for the OpenAI vocabulary; the trained BPE contract."""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from clipms.text.bpe import BpeError
from clipms.text.clip_tokenizer import Tokenizer, TokenizerError, clean_text
from prep.synthetic import image_rng, sample_scene, write_captions

GOLDEN = json.loads((Path(__file__).parents[2] / "data/openclip_tokenizer/tokens.json").read_text())


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
    from harness.dvc_workspace import make_workspace, run, set_params
    from harness.numbered_shards import CAPTIONS, write_shards

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
    """Mutants `make mutation` found alive (mutmut names): the saved file's fields
    (xǁTokenizerǁto_dict 3/4/9-20, __init__ 15/16), openai's defaults (openai 1/12/23/24), the
    shortest context (__init__ 1-3), the trained size and the frequency threshold (train 1/2/11/16/
    32), padding and broken bytes in decode (decode 12-14/39/42/43), the error messages of a
    missing key, bad JSON and a bad merges file (from_dict 10/18, load 6/8/10/11,
    _read_openai_merges 39/45)."""
    from clipms.text.clip_tokenizer import MIN_TRAINED_VOCAB, OPENAI_NUM_MERGES, byte_to_unicode

    default = Tokenizer.openai()
    assert (default.context_length, default.kind, default.pad_id) == (77, "openai", 0)
    saved = {k: v for k, v in default.to_dict().items() if k != "tokenizers"}
    assert saved == {"format": "clipms.text.clip_tokenizer", "version": 1, "kind": "openai",
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
        Tokenizer.from_dict({"format": "clipms.text.clip_tokenizer", "kind": "bpe"})
    assert str(err.value) == "tokenizer dict: missing keys ['context_length', 'tokenizers']"
    (tmp_path / "half.json").write_text('{"format": "clipms.text.clip_tokenizer"}')
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

    from clipms.text.clip_tokenizer import fix_text

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


# --- the BPE trainer (clipms.text.bpe)
# --------------------------------------------------------------- A tiny corpus with a known answer:
# ("x", "y") and ("y", "z</w>") are seen 3 times, ("a", "b"), ("b", "c</w>") and ("b", "d</w>")
# twice, ("p", "q</w>") once.
HAND_MADE = {"xyz": 3, "abc": 2, "bd": 2, "pq": 1}
# Count first, then the smallest (left id, right id): x < y; a < b; then ("b", "d</w>") before
# ("ab", "c</w>") because "ab", a new token, has a higher id than every base symbol (in string
# order "ab" < "b" would go first).
HAND_MADE_MERGES = [("x", "y"), ("xy", "z</w>"), ("a", "b"), ("b", "d</w>"), ("ab", "c</w>")]


def _learn(word_counts: dict[str, int], max_new_tokens: int = 50,
           min_frequency: int = 2) -> list[tuple[str, str]]:
    from clipms.text.bpe import learn_merges
    from clipms.text.clip_tokenizer import EOW, _byte_symbols

    return learn_merges(word_counts, _byte_symbols(), max_new_tokens, min_frequency, EOW)


def test_bpe_tie_rule_on_a_hand_made_corpus() -> None:
    assert _learn(HAND_MADE) == HAND_MADE_MERGES
    assert _learn(dict(reversed(HAND_MADE.items()))) == HAND_MADE_MERGES  # not by word order
    # End-of-word symbols are in the vocabulary's byte order (BpeTrainer's: hash-map order).
    assert _learn({"ac": 1, "ab": 1}, min_frequency=1) == [("a", "b</w>"), ("a", "c</w>")]
    # The trained tokenizer's ids are the trainer's: pad, 512 byte symbols, merges, SOT, EOT.
    tok = Tokenizer.train([w for w, n in HAND_MADE.items() for _ in range(n)], vocab_size=600,
                          context_length=8)
    vocab = tok._tok.get_vocab()
    assert [vocab["".join(m)] for m in HAND_MADE_MERGES] == [513, 514, 515, 516, 517]
    assert (tok.sot_id, tok.eot_id, tok.vocab_size) == (518, 519, 520)
    assert tok.encode(["abc bd XYZ pq"])[0].tolist() == [518, 517, 516, 514, vocab["p"],
                                                        vocab["q</w>"], 519, 0]


def test_bpe_counts_cap_and_min_frequency() -> None:
    assert _learn(HAND_MADE, min_frequency=1) == [*HAND_MADE_MERGES, ("p", "q</w>")]
    assert _learn(HAND_MADE, min_frequency=3) == HAND_MADE_MERGES[:2]
    assert _learn(HAND_MADE, min_frequency=4) == []
    for cap in range(6):
        assert _learn(HAND_MADE, max_new_tokens=cap) == HAND_MADE_MERGES[:cap]
    # BpeTrainer's counts: overlapping occurrences count ("aaab": ("a", "a") twice), the merge
    # goes left to right ("aa", "a", "b</w>": no pair left twice).
    assert _learn({"aaab": 1}) == [("a", "a")]
    assert _learn({"aaab": 1}, min_frequency=3) == []
    # A vocab_size cap keeps a prefix of the merges: pad + 512 + merges + SOT/EOT = vocab_size.
    texts = [w for w, n in HAND_MADE.items() for _ in range(n)]
    for vocab_size, merges in [(516, 1), (518, 3), (520, 5), (600, 5)]:
        tok = Tokenizer.train(texts, vocab_size=vocab_size, context_length=8)
        assert tok.vocab_size == 515 + merges
        assert [tok._tok.token_to_id("".join(m)) for m in HAND_MADE_MERGES[:merges]] == list(
            range(513, 513 + merges))
    with pytest.raises(BpeError, match="symbol '中</w>' is not a base symbol"):
        _learn({"a中": 1})  # words come byte-mapped: raw text here is a caller's mistake


def test_bpe_skips_empty_and_unused_words() -> None:
    """An empty word and words of count 0 are left out, wherever they are in the counts (even one
    with a symbol outside the base: it is not used, so it is no error)."""
    assert _learn({"": 3, "中中": 0, "xx": -1, **HAND_MADE}) == HAND_MADE_MERGES


def _naive_merges(word_counts: dict[str, int], base: list[str],
                  end_of_word: str) -> list[tuple[str, str]]:
    """The reference for learn_merges run to the end (min_frequency 1, no cap): every pair
    recounted after each merge, the highest count first, ties to the smallest (left, right) id."""
    tokens = list(base)
    ids = {t: i for i, t in enumerate(tokens)}
    words = [([ids[c] for c in w[:-1]] + [ids[w[-1] + end_of_word]], n)
             for w, n in word_counts.items()]
    merges = []
    while True:
        counts: dict[tuple[int, int], int] = {}
        for word, n in words:
            for pair in zip(word, word[1:], strict=False):
                counts[pair] = counts.get(pair, 0) + n
        if not counts:
            return merges
        left, right = min(counts, key=lambda p: (-counts[p], p))
        token = tokens[left] + tokens[right]
        if token not in ids:
            ids[token] = len(tokens)
            tokens.append(token)
        merges.append((tokens[left], tokens[right]))
        for k, (word, n) in enumerate(words):
            out, i = [], 0
            while i < len(word):
                if word[i:i + 2] == [left, right]:
                    out.append(ids[token])
                    i += 2
                else:
                    out.append(word[i])
                    i += 1
            words[k] = (out, n)


def test_bpe_to_the_end_matches_a_naive_recount() -> None:
    """Random corpora of a-d trained until no pair is left (min_frequency 1): counts that fall
    to 1 on the way are still merged, in the reference's order."""
    from clipms.text.bpe import learn_merges
    from clipms.text.clip_tokenizer import EOW, _byte_symbols

    rng = np.random.default_rng(7)
    base = _byte_symbols()
    for _ in range(200):
        words = {"".join(rng.choice(list("abcd"), size=rng.integers(1, 9))): int(rng.integers(1, 4))
                 for _ in range(rng.integers(1, 7))}
        assert learn_merges(words, base, 10_000, 1, EOW) == _naive_merges(words, base, EOW), words


def _tie_corpus() -> list[str]:
    """Captions made of ties: each two-letter word of a-l twice, so the 144 pairs (x, y</w>) all
    count 2 and which 25 of them a 540-id vocabulary takes is the tie rule alone (BpeTrainer took
    a different set nearly every run)."""
    words = [x + y for x in TIE_LETTERS for y in TIE_LETTERS]
    return [" ".join(words[i::7]) for i in range(7)] * 2


TIE_LETTERS = "abcdefghijkl"


def test_bpe_training_is_deterministic_in_process(tmp_path: Path) -> None:
    """Same captions -> a byte-identical tokenizer file: twice in this process and with the
    captions in another order; the tie rule's choice of the 25 pairs."""
    captions = _tie_corpus()
    tok = Tokenizer.train(captions, vocab_size=540, context_length=8)
    tok.save(tmp_path / "first.json")
    Tokenizer.train(captions, vocab_size=540, context_length=8).save(tmp_path / "again.json")
    Tokenizer.train(captions[::-1], vocab_size=540, context_length=8).save(
        tmp_path / "reversed.json")
    files = sorted(tmp_path.glob("*.json"))
    assert len(files) == 3 and len({f.read_bytes() for f in files}) == 1
    # The tie rule's choice: the 25 pairs of the smallest (left, right) ids, in that order.
    learned = sorted((i, t) for t, i in tok._tok.get_vocab().items() if 513 <= i < tok.sot_id)
    assert [t for _, t in learned] == [x + y + "</w>" for x in TIE_LETTERS
                                       for y in TIE_LETTERS][:25]


def test_bpe_training_is_deterministic_across_processes(tmp_path: Path) -> None:
    """The same file in processes with other PYTHONHASHSEEDs (str hashes, set orders) as here.
    (`make mutation` deselects it: a child process cannot run mutmut's mutated code.)"""
    captions = _tie_corpus()
    Tokenizer.train(captions, vocab_size=540, context_length=8).save(tmp_path / "here.json")
    root = Path(__file__).resolve().parents[3]
    script = ("import json, sys; from clipms.text.clip_tokenizer import Tokenizer; "
              "Tokenizer.train(json.load(sys.stdin), 540, 8).save(sys.argv[1])")
    for seed in ("1", "2"):
        subprocess.run([sys.executable, "-c", script, str(tmp_path / f"seed{seed}.json")],
                       input=json.dumps(captions), text=True, check=True, cwd=root,
                       env={**os.environ, "PYTHONHASHSEED": seed, "PYTHONPATH": str(root)})
    files = sorted(tmp_path.glob("*.json"))
    assert len(files) == 3 and len({f.read_bytes() for f in files}) == 1


def test_bpe_is_bpetrainers_but_for_the_tie_rule() -> None:
    """Given the ids of a BpeTrainer run (it numbers the end-of-word symbols in hash-map order),
    learn_merges makes that run's merges: the words, the counts (overlaps included), the merge
    order within a word, min_frequency and the vocabulary cap are BpeTrainer's; only the ids,
    which decide ties, differ. On synthetic captions and on random words of a, b, c."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import models, pre_tokenizers, trainers

    from clipms.text.bpe import learn_merges
    from clipms.text.clip_tokenizer import EOW, _byte_symbols, _pre_tokenizer, _word_counts

    rng = np.random.default_rng(0)
    cases = [(synthetic_captions(40), 600, 2), (synthetic_captions(150), 700, 2),
             (synthetic_captions(150), 2000, 1)]
    for _ in range(20):
        words = ["".join(rng.choice(list("abc"), size=rng.integers(1, 8)))
                 for _ in range(rng.integers(1, 9))]
        cases.append(([w for w in words for _ in range(rng.integers(1, 5))],
                      int(rng.integers(516, 541)), int(rng.integers(1, 4))))
    for captions, vocab_size, min_frequency in cases:
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size - 3, min_frequency=min_frequency, show_progress=False,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), end_of_word_suffix=EOW)
        hf = HFTokenizer(models.BPE(end_of_word_suffix=EOW))
        hf.pre_tokenizer = _pre_tokenizer()
        hf.train_from_iterator([clean_text(c) for c in captions], trainer=trainer)
        model = json.loads(hf.to_str())["model"]
        expected = [tuple(m) if isinstance(m, list) else tuple(m.split(" ", 1))
                    for m in model["merges"]]
        seen = sorted((s for s in _byte_symbols() if s in model["vocab"]), key=model["vocab"].get)
        unseen = [s for s in _byte_symbols() if s not in model["vocab"]]
        merges = learn_merges(_word_counts(captions), seen + unseen,
                              vocab_size - 3 - len(seen), min_frequency, EOW)
        assert merges == expected, (captions[:8], vocab_size, min_frequency)


def test_word_counts_are_those_of_pre_tokenizing_each_text() -> None:
    """Counting distinct space-separated chunks gives the words of pre-tokenising every cleaned
    text whole (contractions, punctuation runs, digits, unicode spaces, control characters)."""
    from collections import Counter

    from clipms.text.clip_tokenizer import _pre_tokenizer, _word_counts

    texts = [*TRICKY, *synthetic_captions(20), "it's 'tis 'S don't x's  's", "a\u3000b\u00a0c",
             "a\u200bb\u180ec", "9 1/2 -- ok!!", "東京 😀 ÿ"]
    split = _pre_tokenizer().pre_tokenize_str
    expected = Counter(word for text in texts for word, _ in split(clean_text(text)))
    assert _word_counts(texts) == expected and len(expected) > 100
