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
# `user:password@` before a host, outside a URL: a token that starts the text or follows a space,
# quote, bracket, comma, semicolon or `=`, holds a colon, and ends at the last `@` before the host
# (a password may hold `@`). `user@host` without a password (an e-mail address) is left alone.
_USERINFO_IN_TEXT = re.compile(
    r"(?<![^\s'\"(<\[{,;=])[^\s'\"<>()\[\]{}`/@:=,;]+:[^\s'\"<>()\[\]{}`/]*@(?=[A-Za-z0-9\[])")


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
    if parts.username is not None or parts.password is not None:
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
    string (`user:password@host`) replaced by the marker."""
    if "://" in text:
        text = _URL_IN_TEXT.sub(lambda match: redact_url(match.group(0)), text)
    if "@" in text:
        text = _USERINFO_IN_TEXT.sub(f"{MARK}@", text)
    return text


def _netloc(host: str | None, port: int | None) -> str:
    host = host or ""
    if ":" in host:  # IPv6
        host = f"[{host}]"
    return f"{host}:{port}" if port is not None else host
