"""URLs made safe to print, log, tag or notify: no credentials, no query string, no fragment.

Secrets ride in URLs in three places: user-info (`https://user:password@host/`), the query string
(presigned S3/GCS signatures, `?token=...`, `?sig=...`) and the fragment. `redact_url` drops all
three and says so with a marker, keeping scheme, host, port and path so a message still tells which
file was meant; `host_only` keeps just scheme, host and port, for URLs whose path is the secret
(incoming-webhook URLs such as `https://hooks.slack.com/services/T000/B000/XXXX`). `redact_text`
applies `redact_url` to every URL inside a longer text (an error message, a line of stage output),
and also drops the user-info of host strings without a scheme: urllib and http.client quote a
request's host as `user:password@host` in their errors, and an scp-style path
(`user:password@host:/data/x.parquet`) has one too.

User-info comes in more forms than `user:password@`: a token as the user name (`TOKEN@host`, as
GitHub and many object stores take it), an empty password (`user:@`), no user name (`:password@`)
or a bare `@`. This module is the one place that knows them all: `has_userinfo` tells whether a URL
carries any (the URL policy refuses such URLs with it), and the redactions drop every form. In free
text a token before a host cannot be told from an e-mail address (`alice@example.com`), so both are
redacted; `name@5` (a metric such as `i2t_R@5`) and `clip@champion` are not hosts and stay.

Used by everything that prints or logs a URL: the data stages (`prep`), the tracking layer
(`registry`: params, tags, dataset sources) and the flows (Prefect logs, failure notices).
"""

from __future__ import annotations

import re
from urllib.parse import urlsplit, urlunsplit

MARK = "<redacted>"
# A URL inside free text: a scheme, "://", then anything up to whitespace, a quote or a bracket
# (the marker included, so that redacting a redacted text changes nothing).
_URL_IN_TEXT = re.compile(r"\b[A-Za-z][A-Za-z0-9+.\-]*://(?:<redacted>|[^\s'\"<>()\[\]{}`])+")
# Where user-info may start in free text: at the start, or after a space, quote, bracket, comma,
# semicolon or `=`.
_START = r"(?<![^\s'\"(<\[{,;=])"
# `user:password@` before a host, outside a URL (the user name or the password may be empty): a
# token that holds a colon and ends at the last `@` before the host (a password may hold `@`).
_USERINFO_IN_TEXT = re.compile(
    _START + r"[^\s'\"<>()\[\]{}`/@:=,;]*:[^\s'\"<>()\[\]{}`/]*@(?=[A-Za-z0-9\[])")
# What follows `@` when a token without a colon is user-info: a host, i.e. an IP literal, a dotted
# name whose last label starts with a letter, `localhost`, or one label with a port or an
# scp-style path after it; not `i2t_R@5` (a metric) or `clip@champion` (a registry alias).
_HOST_AHEAD = (r"(?=\[[0-9A-Fa-f:.]+\]|\d{1,3}(?:\.\d{1,3}){3}|(?:[A-Za-z0-9-]+\.)+[A-Za-z]"
               r"|localhost\b|[A-Za-z][A-Za-z0-9-]*:[\d/])")
# `TOKEN@host`: a token as the user name, without a password.
_TOKEN_IN_TEXT = re.compile(_START + r"[^\s'\"<>()\[\]{}`/@:=,;]+@" + _HOST_AHEAD)


def has_userinfo(url: str) -> bool:
    """Whether `url` carries user-info in any form (`user:password@`, `TOKEN@`, `user:@`,
    `:password@`, `@`). A URL urllib cannot split counts when its authority (after `//`, up to the
    path, query or fragment) holds an `@`: fail closed."""
    try:
        return "@" in urlsplit(url).netloc
    except ValueError:
        authority = url.split("//", 1)[1] if "//" in url else ""
        return "@" in re.split(r"[/?#]", authority, maxsplit=1)[0]


def redact_url(url: str) -> str:
    """`url` without user-info, query and fragment (each replaced by a marker); text that is not
    a URL with a host (a local path, a bare word) is returned unchanged."""
    try:
        parts = urlsplit(url)
        host = parts.hostname
        port = parts.port
    except ValueError:  # e.g. a port that is not a number: keep nothing after the scheme,
        if not any(mark in url for mark in "@?#"):  # unless there is no place for a secret
            return url
        return f"{url.split('://', 1)[0]}://{MARK}" if "://" in url else url
    if not parts.scheme or not parts.netloc:
        return url
    netloc = _netloc(host, port)
    if has_userinfo(url):
        netloc = f"{MARK}@{netloc}"
    return urlunsplit((parts.scheme, netloc, parts.path, MARK if parts.query else "",
                       MARK if parts.fragment else ""))


def host_only(url: str) -> str:
    """Scheme, host and port of `url` (the path, query and credentials dropped)."""
    try:
        parts = urlsplit(url)
        host, port = parts.hostname, parts.port
    except ValueError:
        return MARK
    if not parts.scheme or not host:
        return MARK
    return f"{parts.scheme}://{_netloc(host, port)}"


def redact_text(text: str) -> str:
    """`text` with every URL in it redacted (`redact_url`), and the user-info of every host
    string (`user:password@host`, `TOKEN@host`, ...) replaced by the marker."""
    if "://" in text:
        text = _URL_IN_TEXT.sub(lambda match: redact_url(match.group(0)), text)
    if "@" in text:
        text = _USERINFO_IN_TEXT.sub(f"{MARK}@", text)
        text = _TOKEN_IN_TEXT.sub(f"{MARK}@", text)
    return text


def _netloc(host: str | None, port: int | None) -> str:
    host = host or ""
    if ":" in host:  # IPv6
        host = f"[{host}]"
    return f"{host}:{port}" if port is not None else host
