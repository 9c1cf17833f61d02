"""clipms.utils.redact: URLs without credentials, query strings or fragments, in text too."""

from __future__ import annotations

import pytest

from clipms.utils.redact import has_userinfo, host_only, redact_text, redact_url

PRESIGNED = ("https://bucket.s3.eu-west-1.amazonaws.com/data/meta.parquet?X-Amz-Algorithm="
             "AWS4-HMAC-SHA256&X-Amz-Credential=AKIAFAKE%2F20261201%2Fs3%2Faws4_request&"
             "X-Amz-Expires=3600&X-Amz-Signature=f00dSIGNATURE")


@pytest.mark.parametrize(("url", "shown"), [
    (PRESIGNED, "https://bucket.s3.eu-west-1.amazonaws.com/data/meta.parquet?<redacted>"),
    ("http://127.0.0.1:8000/x.parquet?token=T0KEN", "http://127.0.0.1:8000/x.parquet?<redacted>"),
    ("https://user:PASSWORD@example.org/a", "https://<redacted>@example.org/a"),
    ("https://TOKENONLY@example.org/a", "https://<redacted>@example.org/a"),
    ("https://user:@example.org/a", "https://<redacted>@example.org/a"),
    ("https://:PASSWORD@example.org/a", "https://<redacted>@example.org/a"),
    ("https://@example.org/a", "https://<redacted>@example.org/a"),
    ("http://[::1@TOKEN/a", "http://<redacted>"),
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
    # a token as the user name, as http.client quotes it in its errors: no password, no colon
    ("refused (unresolvable_host): ghp_SECRET123@127.0.0.1: [Errno -2] not known",
     "refused (unresolvable_host): <redacted>@127.0.0.1: [Errno -2] not known"),
    ("<urlopen error ghp_SECRET123@mirror.example: not known>",
     "<urlopen error <redacted>@mirror.example: not known>"),
    ("'ghp_SECRET123@mirror:/data/x.parquet'", "'<redacted>@mirror:/data/x.parquet'"),
    ("at ghp_SECRET123@[::1]:80", "at <redacted>@[::1]:80"),
    ("host user:@10.0.0.1 and :ghp_SECRET123@10.0.0.2", "host <redacted>@10.0.0.1 and "
                                                         "<redacted>@10.0.0.2"),
    # an e-mail address cannot be told from a token before a host: redacted too
    ("mail alice@example.com about it", "mail <redacted>@example.com about it"),
    ("ratio 1:2 @ 3", "ratio 1:2 @ 3"),
    # not a host after the `@`: metric names and registry aliases stay readable
    ("i2t_R@5: 0.61, mAP@10:0.5", "i2t_R@5: 0.61, mAP@10:0.5"),
    ("init_from models:/clip@champion or clip@challenger",
     "init_from models:/clip@champion or clip@challenger"),
])
def test_redact_text_drops_the_user_info_of_host_strings_without_a_scheme(text, shown) -> None:
    """urllib and http.client quote a request's host as `user:password@host` in their errors,
    and an scp-style path has one: no `://` for a URL rule to find."""
    assert redact_text(text) == shown
    assert redact_text(shown) == shown


@pytest.mark.parametrize("url", [
    "https://ghp_SECRET123@host.example/x.jpg", "https://user:@host.example/x.jpg",
    "https://:ghp_SECRET123@host.example/x.jpg", "https://user:ghp_SECRET123@host.example/x",
    "https://@host.example/x.jpg", "http://a@b@127.0.0.1:80/x", "http://[::1@TOKEN/x"])
def test_has_userinfo_knows_every_form(url: str) -> None:
    assert has_userinfo(url)


@pytest.mark.parametrize("url", [
    "https://host.example/x.jpg", "https://host.example/a@b.jpg", "https://h.example/x?u=a@b",
    "https://h.example/x#a@b", "/local/a@b.parquet", "file:data/a@b.png"])
def test_has_userinfo_ignores_an_at_sign_outside_the_authority(url: str) -> None:
    assert not has_userinfo(url)
