"""Deterministic BPE training: the merges of a byte-level BPE learned from word counts.

The classic greedy algorithm (Sennrich et al.), with the semantics of Hugging Face `tokenizers`'
`BpeTrainer` (0.21): a word is its characters with `end_of_word` appended to the last one; a
pair's count is the number of times it occurs adjacent in the words (overlapping occurrences
included, so "aaa" counts ("a", "a") twice), weighted by word frequency; the merge replaces its
occurrences left to right; training stops when `max_new_tokens` new tokens exist or when the best
count is below `min_frequency`.

Tie rule (the one thing that differs): among the pairs of the highest count, the one with the
smallest (left id, right id) is merged, ids being the positions in `base` and then the new tokens
in the order they were created (in a trained `clipms.text.clip_tokenizer`, exactly its vocabulary
ids). `BpeTrainer` has the same rule, but its ids of the end-of-word symbols follow hash-map order,
so the same corpus could give different vocabularies from one run to the next. Here the result
depends on the word counts, `base` and the parameters only: all work is on int ids and
insertion-ordered dicts, never on the iteration order of a hashed str.
"""

# tested by: tests/clipms/text/test_clip_tokenizer.py

from __future__ import annotations

import heapq
from collections.abc import Mapping, Sequence

Pair = tuple[int, int]


class BpeError(ValueError):
    """A word has a character that is not in the base symbols."""


class _State:
    """Words as id lists, with the pair counts and the words each pair occurs in."""

    def __init__(self, words: list[list[int]], freqs: list[int]) -> None:
        self.words = words
        self.freqs = freqs
        self.counts: dict[Pair, int] = {}
        self.where: dict[Pair, set[int]] = {}
        for index in range(len(words)):
            self._add_pairs(index)

    def _add_pairs(self, index: int) -> None:
        word, freq = self.words[index], self.freqs[index]
        for pair in zip(word, word[1:], strict=False):
            self.counts[pair] = self.counts.get(pair, 0) + freq
            self.where.setdefault(pair, set()).add(index)

    def _remove_pairs(self, index: int) -> None:
        # `where` keeps the index: a stale entry only costs a look at the word later.
        word, freq = self.words[index], self.freqs[index]
        for pair in zip(word, word[1:], strict=False):
            self.counts[pair] -= freq

    def merge(self, pair: Pair, new_id: int) -> set[Pair]:
        """Replace `pair` by `new_id` in every word that has it (counts updated for those only);
        returns the pairs the merge created, the only ones whose count can have risen."""
        created: set[Pair] = set()
        for index in sorted(self.where.pop(pair, ())):
            merged = _merge_word(self.words[index], pair, new_id)
            if merged is None:
                continue
            self._remove_pairs(index)
            self.words[index] = merged
            self._add_pairs(index)
            created.update(p for p in zip(merged, merged[1:], strict=False) if new_id in p)
        self.counts.pop(pair, None)
        return created


def _merge_word(word: list[int], pair: Pair, new_id: int) -> list[int] | None:
    """`word` with the occurrences of `pair` merged left to right, or None if it has none."""
    left, right = pair
    out: list[int] = []
    i, n = 0, len(word)
    while i < n:
        if i + 1 < n and word[i] == left and word[i + 1] == right:
            out.append(new_id)
            i += 2
        else:
            out.append(word[i])
            i += 1
    return out if len(out) < n else None


def _split(word_counts: Mapping[str, int], ids: Mapping[str, int],
           end_of_word: str) -> tuple[list[list[int]], list[int]]:
    """Each word as base-symbol ids, its last character carrying the end-of-word suffix."""
    words, freqs = [], []
    for word, freq in word_counts.items():
        if not word or freq <= 0:
            continue
        symbols = [*word[:-1], word[-1] + end_of_word]
        try:
            words.append([ids[s] for s in symbols])
        except KeyError as err:
            raise BpeError(f"word {word!r}: symbol {err.args[0]!r} is not a base symbol") from None
        freqs.append(int(freq))
    return words, freqs


def learn_merges(word_counts: Mapping[str, int], base: Sequence[str], max_new_tokens: int,
                 min_frequency: int, end_of_word: str) -> list[tuple[str, str]]:
    """The merges, in learned order, until `max_new_tokens` distinct new tokens exist or no pair
    occurs `min_frequency` times (see the module docstring for the counts and the tie rule).

    `base` holds every character of the words and each with `end_of_word`. A merge whose token
    already exists (("a", "bc") after ("ab", "c")) is kept, as `BpeTrainer` keeps it, but adds no
    token, so there can be more merges than new tokens."""
    tokens = list(base)
    ids = {token: i for i, token in enumerate(tokens)}
    state = _State(*_split(word_counts, ids, end_of_word))
    # Max-heap by count, then smallest ids: entries (-count, left, right). An entry can be stale
    # (the count fell since): it is fixed when it reaches the top. A count only rises when a merge
    # creates the pair, and then an entry with the new count is pushed.
    heap = [(-count, *pair) for pair, count in state.counts.items()]
    heapq.heapify(heap)
    merges: list[tuple[str, str]] = []
    new_tokens = 0
    while heap and new_tokens < max_new_tokens:
        stored, left, right = heapq.heappop(heap)
        count = state.counts.get((left, right), 0)
        if count != -stored:
            if 0 < count < -stored:
                heapq.heappush(heap, (-count, left, right))
            continue  # a count above the stored one has its own, newer entry
        if count < max(min_frequency, 1):
            break
        token = tokens[left] + tokens[right]
        if token not in ids:
            ids[token] = len(tokens)
            tokens.append(token)
            new_tokens += 1
        merges.append((tokens[left], tokens[right]))
        for pair in state.merge((left, right), ids[token]):
            heapq.heappush(heap, (-state.counts[pair], *pair))
    return merges
