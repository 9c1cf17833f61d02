"""clipms.utils.redact: URLs without credentials, query strings or fragments, in text too."""

from __future__ import annotations

import pytest

from clipms.utils.redact import host_only, redact_text, redact_url

PRESIGNED = ("https://bucket.s3.eu-west-1.amazonaws.com/data/meta.parquet?X-Amz-Algorithm="
             "AWS4-HMAC-SHA256&X-Amz-Credential=AKIAFAKE%2F20261201%2Fs3%2Faws4_request&"
             "X-Amz-Expires=3600&X-Amz-Signature=f00dSIGNATURE")


@pytest.mark.parametrize(("url", "shown"), [
    (PRESIGNED, "https://bucket.s3.eu-west-1.amazonaws.com/data/meta.parquet?<redacted>"),
    ("http://127.0.0.1:8000/x.parquet?token=T0KEN", "http://127.0.0.1:8000/x.parquet?<redacted>"),
    ("https://user:PASSWORD@example.org/a", "https://<redacted>@example.org/a"),
    ("https://TOKENONLY@example.org/a", "https://<redacted>@example.org/a"),
    ("https://example.org/a#access_token=FRAG", "https://example.org/a#<redacted>"),
    ("http://[::1]:9000/p?q=1", "http://[::1]:9000/p?<redacted>"),
    ("https://example.org/plain.parquet", "https://example.org/plain.parquet"),
    ("/home/user/data.parquet", "/home/user/data.parquet"),
    ("file:data/synthetic/0.png", "file:data/synthetic/0.png"),
    ("http://host:notaport/p?token=X", "http://<redacted>"),
])
def test_redact_url(url: str, shown: str) -> None:
    assert redact_url(url) == shown


def test_host_only_drops_a_webhook_path_secret() -> None:
    hook = "https://hooks.slack.com/services/T000/B000/XXXXSECRET"
    assert host_only(hook) == "https://hooks.slack.com"
    assert host_only("http://u:p@127.0.0.1:8080/hook/SECRET?x=1") == "http://127.0.0.1:8080"
    assert host_only("not a url") == "<redacted>"


def test_redact_text_finds_every_url_in_a_message() -> None:
    text = (f"metadata: downloading {PRESIGNED}\nerror: could not download "
            "'http://127.0.0.1:1/m.parquet?token=T0KEN' (HTTP 403); see https://docs.example/x")
    out = redact_text(text)
    assert "f00dSIGNATURE" not in out and "AKIAFAKE" not in out and "T0KEN" not in out
    assert "'http://127.0.0.1:1/m.parquet?<redacted>'" in out
    assert "https://docs.example/x" in out and out.startswith("metadata: downloading https://")
    assert redact_text("no urls here: a/b?c=d") == "no urls here: a/b?c=d"
    assert redact_text(out) == out  # redacting twice (a stage, then the flow's log) is harmless
    assert redact_url(redact_url(PRESIGNED)) == redact_url(PRESIGNED)
    assert redact_text("x https://u:p@h/a?b#c y") \
        == "x https://<redacted>@h/a?<redacted>#<redacted> y"


@pytest.mark.parametrize(("text", "shown"), [
    ("<urlopen error [Errno -2] user:S3cret@mirror.example: not known>",
     "<urlopen error [Errno -2] <redacted>@mirror.example: not known>"),
    ("metadata.path = 'user:S3cret@mirror:/data/x.parquet': no such file",
     "metadata.path = '<redacted>@mirror:/data/x.parquet': no such file"),
    ("user:p@ss@word@host.example:22/x", "<redacted>@host.example:22/x"),  # '@' in a password
    ("host (u:pw@10.0.0.1) refused", "host (<redacted>@10.0.0.1) refused"),
    ("key=u:pw@h.example", "key=<redacted>@h.example"),
    ("mail alice@example.com about it", "mail alice@example.com about it"),  # no password
    ("ratio 1:2 @ 3", "ratio 1:2 @ 3"),
])
def test_redact_text_drops_the_user_info_of_host_strings_without_a_scheme(text, shown) -> None:
    """urllib and http.client quote a request's host as `user:password@host` in their errors,
    and an scp-style path has one: no `://` for a URL rule to find."""
    assert redact_text(text) == shown
    assert redact_text(shown) == shown
