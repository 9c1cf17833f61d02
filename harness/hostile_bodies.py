"""Request bodies built to be slow to check: a JSON string of escaped quotes and commas that never
closes, the pattern a shape check that rescans from each quote reads to the end of the body."""

from __future__ import annotations


def unclosed_quotes(size: int, head: bytes = b'{"texts": ["a", "b", "') -> bytes:
    """A body of `size` bytes whose last string, of escaped quotes and commas, never closes: the
    string pattern the shape check used read to the end of the body from each of its quotes."""
    return head + b'\\",' * ((size - len(head)) // 3)
