"""Request bodies built to make the service's shape check slow, checked on the check itself
(docs/security.md, "Service and model inputs"; tests/integration/test_hostile_inputs.py sends them
to a running service)."""

from __future__ import annotations

import pytest

from clipms.deploy.inputs import InputError, RequestLimits
from harness.hostile_bodies import unclosed_quotes
from serving.routes import SHAPE_MARGIN, check_shape, scan_shape

MAX_ROWS = 16


# ------------------------------------------------------------------ bodies that slow the check


@pytest.mark.parametrize("head", [b'{"texts": ["a", "b", "', b'{"text": "', b'{"image": "x", '
                                  b'"texts": ["'], ids=["embeddings", "search", "rank"])
def test_the_shape_check_reads_a_hostile_body_once(head: bytes) -> None:
    """Twice the body is twice the work, each byte given to one linear primitive, in as many
    steps whatever the size (it was quadratic: 8 KB took 0.10 s, 16 KB 0.43 s)."""
    allowed = MAX_ROWS + SHAPE_MARGIN
    small, large = (scan_shape(unclosed_quotes(size, head), 2 * allowed + 1)
                    for size in (64 * 1024, 128 * 1024))
    assert small.calls == large.calls <= 3 * (2 * allowed + 2), (small, large)
    assert small.examined <= 64 * 1024 and large.examined <= 128 * 1024, (small, large)
    assert large.separators == small.separators < allowed  # the commas in the string are not
    check_shape(unclosed_quotes(128 * 1024, head), RequestLimits(max_rows=MAX_ROWS))


@pytest.mark.parametrize(("body", "refused"), [
    (b'{"texts": [' + b'"a",' * 40 + b'"a"]}', True),  # 41 strings, 40 values too many
    (b'{"texts": ["' + b'\\",' * 4000 + b'"]}', False),  # one text of 4000 `",`
    (b'{"texts": [' + b'"\\\\",' * 40 + b'"a"]}', True),  # `\\"` closes each string
    (b'{"texts": ["a,b,' * 8 + b'"]}', False),
], ids=["many values", "escaped quotes", "escaped backslashes", "commas in strings"])
def test_the_shape_check_counts_values_outside_strings(body: bytes, refused: bool) -> None:
    limits = RequestLimits(max_rows=MAX_ROWS)
    if refused:
        with pytest.raises(InputError, match="more JSON values than a request of at most 16"):
            check_shape(body, limits)
    else:
        check_shape(body, limits)
