"""serving.routes.embeddings_body, the /v1/embeddings parser that skips pydantic when it can:
for every body, valid or not, it gives what EmbeddingsBody gives, or the same 400 (the real
server's answers of the direct path: tests/serving/test_app.py)."""

from __future__ import annotations

import json

import pytest

from clipms.deploy.inputs import RequestLimits
from serving.errors import InvalidBody
from serving.routes import EmbeddingsBody, embeddings_body, validated

LIMITS = RequestLimits()

BODIES = [
    {"texts": ["a", "b"]}, {"images": ["aGVsbG8="]}, {"texts": ["x"], "images": ["eA=="]},
    {"texts": ["x"], "encoding_format": "base64"}, {"texts": None, "images": ["eA=="]},
    {"texts": []}, {}, {"texts": ["é\u2028 ☃"], "encoding_format": "float"},
    {"texts": "a single string"}, {"texts": [1]}, {"texts": [None]}, {"texts": ["a", ["b"]]},
    {"images": [{"b64": "eA=="}]}, {"textz": ["a"]}, {"texts": ["a"], "k": 3},
    {"texts": ["a"], "encoding_format": None}, {"texts": ["a"], "encoding_format": "hex"},
    {"texts": ["a"], "encoding_format": 1}, {"texts": {"0": "a"}}, ["a"], "a", 3, None,
]
RAW = [b"{not json", b"", b'{"texts": ["a"]} trailing', b'{"texts": ["\\ud800"]}',
       b'{"texts": ["a"], "texts": ["b", "c"]}', b'\xff\xfe', b'{"texts": ["a\x00b"]}']


def pydantic(body: bytes) -> tuple[list[str], list[str], str] | str:
    try:
        parsed = validated(EmbeddingsBody, body, LIMITS)
    except InvalidBody as err:
        return str(err)
    return parsed.texts or [], parsed.images or [], parsed.encoding_format


def ours(body: bytes) -> tuple[list[str], list[str], str] | str:
    try:
        return embeddings_body(body, LIMITS)
    except InvalidBody as err:
        return str(err)


@pytest.mark.parametrize("body", [json.dumps(b).encode() for b in BODIES] + RAW)
def test_the_fast_parser_accepts_and_refuses_exactly_as_pydantic(body: bytes) -> None:
    assert ours(body) == pydantic(body)


def test_the_bodies_cover_acceptance_and_refusal() -> None:
    answers = [pydantic(json.dumps(b).encode()) for b in BODIES] + [pydantic(b) for b in RAW]
    assert sum(isinstance(a, tuple) for a in answers) >= 8
    assert sum(isinstance(a, str) for a in answers) >= 15
