"""Which URLs the pipeline may fetch, enforced twice: before any download and inside urllib.

Untrusted URL lists (metadata parquets, a redirecting web server, a DNS answer) must never make the
pipeline reach the machine itself or its network. The rule (`FetchPolicy`):
- only the allowed schemes (`download.allowed_schemes`; `file` only for the synthetic source, which
  bypasses this module entirely);
- unless `allow_private_addresses` (a user's internal mirror), every address a host resolves to
  must be public: loopback, private, link-local, multicast, reserved and unspecified addresses are
  refused, IPv4-mapped IPv6 included;
- a redirect may not change the scheme (one exception: the upgrade `http` -> `https`, which gains
  nothing) and is held to the same address rule;
- a response body is read up to `max_bytes`, no further;
- a URL with user-info in any form (`http://user:password@host/`, `http://TOKEN@host/`, ...; see
  `clipms.utils.redact.has_userinfo`) is refused, in a redirect target too: urllib sends no
  credentials from a URL, and its host string (`TOKEN@host`) would be quoted in every error;
- with `deadline_s`, a whole fetch (connection, redirects, headers and body) ends by then,
  however slowly the server sends (a socket timeout bounds each read, not their sum).

Every message here shows URLs redacted (`clipms.utils.redact`): no user-info, query or fragment.

`precheck` applies the scheme and address rules to a whole URL list (each host resolved once) and
gives the reason per URL, so refusals are counted before an engine sees a URL. `build_opener`
returns the urllib opener that applies them again where the connection is made: it resolves the host
itself, checks every address and connects to those addresses only, so a DNS answer that changes
between the pre-check and the fetch (rebinding) cannot slip through. It has no FTP, file or data
handler and ignores proxy settings while addresses are checked (a proxy would resolve the host
where this check cannot see it).
"""

from __future__ import annotations

import http.client
import io
import ipaddress
import re
import socket
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from typing import Any
from urllib.parse import urlsplit

from clipms.utils.redact import has_userinfo, redact_text, redact_url

ADDRESS_REASONS = ("loopback_address", "private_address", "link_local_address",
                   "multicast_address", "reserved_address")
PRECHECK_REASONS = ("disallowed_scheme", "bad_url", "unresolvable_host", *ADDRESS_REASONS)
DEFAULT_PORTS = {"http": 80, "https": 443}
# RFC 3986's scheme, at the very start: the one scheme rule (dedupe applies it too, in Arrow).
SCHEME_PATTERN = r"^(?P<scheme>[A-Za-z][A-Za-z0-9+.\-]*):"
_SCHEME = re.compile(SCHEME_PATTERN)

Resolver = Callable[..., list[tuple[Any, ...]]]


@dataclass(frozen=True)
class FetchPolicy:
    allowed_schemes: frozenset[str] = frozenset({"http", "https"})
    allow_private_addresses: bool = False
    # Networks exempt from the address rule (CIDR, e.g. one internal mirror "10.1.2.3/32"):
    # narrower than allow_private_addresses, which exempts every address.
    allowed_networks: tuple[str, ...] = ()
    max_bytes: int | None = 32 << 20  # a response body read past this is refused (None: no limit)
    deadline_s: float | None = None  # seconds a whole fetch may take (None: per-read timeouts only)

    def address_problem(self, address: str) -> str | None:
        """Why `address` may not be connected to under this policy (None: it may)."""
        if self.allow_private_addresses:
            return None
        ip = _ip(address)
        if any(ip in ipaddress.ip_network(net) for net in self.allowed_networks):
            return None
        return address_problem(address)


def allowed_schemes(configured: Iterable[str], source: str) -> frozenset[str]:
    """The schemes that may be fetched: the configured list, plus `file` only for synthetic data.

    The synthetic generator serves its images as file:// URLs; any other source is untrusted input
    and a file:// row in it must never make us read local files.
    """
    schemes = {s.lower() for s in configured}
    if source == "synthetic":
        schemes.add("file")
    else:
        schemes.discard("file")
    return frozenset(schemes)


class RefusedURL(OSError):
    """A URL, redirect or address the policy refuses; `reason` is one of PRECHECK_REASONS or
    `redirect_scheme` / `too_large`."""

    def __init__(self, reason: str, message: str) -> None:
        # redacted here too: a host string can quote user-info (`TOKEN@host` from http.client)
        super().__init__(f"refused ({reason}): {redact_text(message)}")
        self.reason = reason


class DeadlinePassed(TimeoutError):
    """A fetch ran past the policy's `deadline_s` (one message wherever it happened, so
    img2dataset counts one reason)."""

    def __init__(self, seconds: float) -> None:
        super().__init__(f"download deadline of {seconds:g} s passed")


# ---------------------------------------------------------------- the address rule


def _ip(address: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    ip = ipaddress.ip_address(address.split("%", 1)[0])  # drop an IPv6 zone index
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return ip.ipv4_mapped  # ::ffff:127.0.0.1 is 127.0.0.1
    return ip


def address_problem(address: str) -> str | None:
    """The ADDRESS_REASONS entry for an IP address that is not public, None for a public one."""
    ip = _ip(address)
    if ip.is_loopback:
        return "loopback_address"
    if ip.is_link_local:
        return "link_local_address"
    if ip.is_multicast:
        return "multicast_address"
    if ip.is_private:
        return "private_address"
    if ip.is_reserved or ip.is_unspecified or not ip.is_global:  # e.g. 100.64/10, 0.0.0.0
        return "reserved_address"
    return None


def resolve_checked(host: str, port: int, policy: FetchPolicy,
                    resolver: Resolver | None = None) -> list[tuple[Any, ...]]:
    """getaddrinfo results for host:port (`resolver`: socket.getaddrinfo, looked up at each
    call), every address checked against the policy."""
    try:
        infos = (resolver or socket.getaddrinfo)(host, port, 0, socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as err:
        raise RefusedURL("unresolvable_host", f"{host}: {err}") from err
    for *_, sockaddr in infos:
        problem = policy.address_problem(sockaddr[0])
        if problem:
            raise RefusedURL(problem, f"{host} resolves to {sockaddr[0]} "
                                      "(download.allow_private_addresses is false)")
    return infos


def url_scheme(url: str) -> str:
    """Lower-cased scheme of a URL ('' when it does not start with one: nothing is stripped, so
    ` file:///x` or `<URL:file:///x>`, which urllib would unwrap, have none and are refused)."""
    match = _SCHEME.match(url)
    return match.group("scheme").lower() if match else ""


def _shown(url: str) -> str:
    return repr(redact_url(url))


def _host_port(url: str) -> tuple[str, int]:
    try:  # urlsplit itself refuses some URLs (an unclosed IPv6 bracket): one bad row, not a crash
        parts = urlsplit(url)
        port = parts.port or DEFAULT_PORTS.get(parts.scheme.lower(), 80)
    except ValueError as err:
        raise RefusedURL("bad_url", f"{_shown(url)}: {redact_text(str(err))}") from err
    if not parts.hostname:
        raise RefusedURL("bad_url", f"{_shown(url)}: no host")
    return parts.hostname, port


def _check_userinfo(url: str) -> None:
    """Any user-info refused, whatever its form (`has_userinfo`): a token as the user name is as
    secret as a password."""
    if has_userinfo(url):
        raise RefusedURL("bad_url", f"{_shown(url)}: user-info (user:password@, TOKEN@) in a URL "
                                    "is not sent by the downloader; give the URL without it")


def check_url(url: str, policy: FetchPolicy, resolver: Resolver | None = None) -> None:
    """RefusedURL unless the URL's scheme is allowed, it has no user-info, and (for a URL with a
    host, when addresses are checked) its host resolves to allowed addresses only."""
    scheme = url_scheme(url)
    if scheme not in policy.allowed_schemes:
        raise RefusedURL("disallowed_scheme", f"{_shown(url)}: scheme {scheme!r} is not in "
                                              f"{sorted(policy.allowed_schemes)}")
    _check_userinfo(url)
    if scheme != "file" and not policy.allow_private_addresses:
        resolve_checked(*_host_port(url), policy, resolver)


def precheck(urls: Sequence[str], policy: FetchPolicy, resolver: Resolver | None = None,
             threads: int = 16) -> list[str | None]:
    """`check_url`'s refusal reason for each URL (None: allowed). Each distinct host:port is
    resolved once, `threads` at a time (resolution waits on the network, not on the CPU)."""
    def reason(task: Callable[[], Any]) -> str | None:
        try:
            task()
        except RefusedURL as err:
            return err.reason
        return None

    targets: dict[str, tuple[str, int] | str | None] = {}
    for url in urls:
        scheme = url_scheme(url)
        if scheme not in policy.allowed_schemes:
            targets[url] = "disallowed_scheme"
            continue
        try:
            _check_userinfo(url)
            checked = scheme != "file" and not policy.allow_private_addresses
            targets[url] = _host_port(url) if checked else None
        except RefusedURL as err:
            targets[url] = err.reason
    hosts = sorted({t for t in targets.values() if isinstance(t, tuple)})
    with ThreadPoolExecutor(max_workers=max(1, threads)) as pool:
        found = dict(zip(hosts, pool.map(lambda hp: reason(
            partial(resolve_checked, hp[0], hp[1], policy, resolver)), hosts), strict=True))
    return [found[t] if isinstance(t := targets[url], tuple) else t for url in urls]


# ---------------------------------------------------------------- inside urllib


def _checked_connection(policy: FetchPolicy, address: tuple[str, int], timeout: Any = None,
                        source_address: Any = None) -> socket.socket:
    """socket.create_connection, but only to addresses this process resolved and checked."""
    host, port = address
    last: OSError | None = None
    for family, socktype, proto, _, sockaddr in resolve_checked(host, port, policy):
        sock = socket.socket(family, socktype, proto)
        try:
            if timeout is not socket._GLOBAL_DEFAULT_TIMEOUT:  # type: ignore[attr-defined]
                sock.settimeout(timeout)
            if source_address:
                sock.bind(source_address)
            sock.connect(sockaddr)
            return sock
        except OSError as err:
            sock.close()
            last = err
    raise last or OSError(f"{host}: no address to connect to")


# The deadline of the fetch this thread is making, set by the opener for the whole of one
# `open()` (redirects included); each connection made meanwhile keeps it for its body's reads.
_FETCH = threading.local()


class _DeadlineSocket:
    """A connected socket (plain or TLS) whose reads all end by `deadline` (time.monotonic()):
    each read waits at most the time left, and at most the connection's own timeout."""

    def __init__(self, sock: socket.socket, deadline: float, seconds: float) -> None:
        self._sock, self._deadline, self._seconds = sock, deadline, seconds
        self._timeout = sock.gettimeout()
        self._readers = 0
        self._closing = False

    def recv_into(self, buffer: Any, nbytes: int = 0) -> int:
        left = self._deadline - time.monotonic()
        if left <= 0:
            raise DeadlinePassed(self._seconds)
        self._sock.settimeout(left if self._timeout is None else min(self._timeout, left))
        try:
            return self._sock.recv_into(buffer, nbytes)
        except TimeoutError:
            if time.monotonic() >= self._deadline:
                raise DeadlinePassed(self._seconds) from None
            raise

    def makefile(self, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
        if mode != "rb":
            return self._sock.makefile(mode, *args, **kwargs)
        self._readers += 1
        return io.BufferedReader(_DeadlineReader(self))

    def close(self) -> None:
        """Closes the socket once its readers are closed too (urllib closes the connection's
        socket before the response body is read; socket.makefile's own readers work alike)."""
        self._closing = True
        if not self._readers:
            self._sock.close()

    def reader_closed(self) -> None:
        self._readers -= 1
        if self._closing and not self._readers:
            self._sock.close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._sock, name)


class _DeadlineReader(io.RawIOBase):
    def __init__(self, sock: _DeadlineSocket) -> None:
        self._owner = sock

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        return self._owner.recv_into(buffer)

    def close(self) -> None:
        if not self.closed:
            self._owner.reader_closed()
        super().close()


def _with_deadline(connection: http.client.HTTPConnection, seconds: float | None) -> None:
    """Put the connection's socket under the deadline of the fetch in progress (or a new one)."""
    if seconds is None:
        return
    deadline = getattr(_FETCH, "deadline", None) or time.monotonic() + seconds
    if time.monotonic() >= deadline:  # a slow TLS handshake: each of its reads had a timeout
        connection.sock.close()
        raise DeadlinePassed(seconds)
    connection.sock = _DeadlineSocket(connection.sock, deadline, seconds)  # type: ignore


class _CheckedHTTPConnection(http.client.HTTPConnection):
    def __init__(self, *args: Any, policy: FetchPolicy, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._create_connection = partial(_checked_connection, policy)
        self._deadline_s = policy.deadline_s

    def connect(self) -> None:
        super().connect()
        _with_deadline(self, self._deadline_s)


class _CheckedHTTPSConnection(http.client.HTTPSConnection):
    def __init__(self, *args: Any, policy: FetchPolicy, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._create_connection = partial(_checked_connection, policy)
        self._deadline_s = policy.deadline_s

    def connect(self) -> None:
        super().connect()  # TCP, then TLS
        _with_deadline(self, self._deadline_s)


def _bounded(response: Any, limit: int | None) -> Any:
    """The response, its body readable up to `limit` bytes (a RefusedURL past that)."""
    if limit is None:
        return response
    length = response.headers.get("Content-Length")
    if length is not None and length.isdigit() and int(length) > limit:
        response.close()
        raise RefusedURL("too_large", f"{response.url}: Content-Length {length} is over the "
                                      f"limit of {limit} bytes")
    read = response.read

    def bounded_read(amt: int | None = None) -> bytes:
        want = limit + 1 if amt is None or amt < 0 else min(amt, limit + 1)
        data = read(want) if amt is not None else _read_up_to(read, want)
        if response.bounded_total + len(data) > limit:
            response.close()
            raise RefusedURL("too_large", f"{response.url}: body over the limit of {limit} bytes")
        response.bounded_total += len(data)
        return data

    response.bounded_total = 0
    response.read = bounded_read
    return response


def _read_up_to(read: Callable[[int], bytes], size: int) -> bytes:
    chunks, total = [], 0
    while total < size and (chunk := read(min(1 << 20, size - total))):
        chunks.append(chunk)
        total += len(chunk)
    return b"".join(chunks)


class _CheckedHTTPHandler(urllib.request.HTTPHandler):
    def __init__(self, policy: FetchPolicy) -> None:
        super().__init__()
        self.policy = policy

    def http_open(self, req: urllib.request.Request) -> Any:
        _check_userinfo(req.full_url)
        return _bounded(self.do_open(partial(_CheckedHTTPConnection, policy=self.policy), req),
                        self.policy.max_bytes)


class _CheckedHTTPSHandler(urllib.request.HTTPSHandler):
    def __init__(self, policy: FetchPolicy) -> None:
        super().__init__()
        self.policy = policy

    def https_open(self, req: urllib.request.Request) -> Any:
        _check_userinfo(req.full_url)
        return _bounded(self.do_open(partial(_CheckedHTTPSConnection, policy=self.policy), req,
                                     context=self._context), self.policy.max_bytes)


class _CheckedRedirectHandler(urllib.request.HTTPRedirectHandler):
    """Follows a redirect only to the same scheme (or http -> https) and an allowed address."""

    def __init__(self, policy: FetchPolicy) -> None:
        super().__init__()
        self.policy = policy

    def redirect_request(self, req: urllib.request.Request, fp: Any, code: int, msg: str,
                         headers: Any, newurl: str) -> urllib.request.Request | None:
        old, new = urlsplit(req.full_url).scheme.lower(), urlsplit(newurl).scheme.lower()
        if (new != old and (old, new) != ("http", "https")) or new not in \
                self.policy.allowed_schemes:
            raise RefusedURL("redirect_scheme", f"redirect from {old}: to {_shown(newurl)}")
        try:  # a clear reason now; the connection checks the address again
            check_url(newurl, self.policy)
        except RefusedURL as err:
            raise RefusedURL(err.reason, f"redirect to {_shown(newurl)}: {err}") from None
        return super().redirect_request(req, fp, code, msg, headers, newurl)


class _GuardedOpener(urllib.request.OpenerDirector):
    """Starts each fetch's deadline (a redirect's `open()` keeps its fetch's deadline), and
    gives errors that quote a URL's secrets with those redacted."""

    def __init__(self, deadline_s: float | None) -> None:
        super().__init__()
        self.deadline_s = deadline_s

    def open(self, fullurl: Any, data: Any = None,
             timeout: Any = socket._GLOBAL_DEFAULT_TIMEOUT) -> Any:  # type: ignore[attr-defined]
        outer = getattr(_FETCH, "deadline", None) is None
        if outer and self.deadline_s is not None:
            _FETCH.deadline = time.monotonic() + self.deadline_s
        try:
            return super().open(fullurl, data, timeout)
        except urllib.error.URLError as err:
            if isinstance(err.reason, DeadlinePassed):
                raise err.reason from None  # the same message as a deadline hit in the body
            _raise_redacted(err)
            raise
        except (OSError, http.client.HTTPException) as err:
            _raise_redacted(err)
            raise
        finally:
            if outer:
                _FETCH.deadline = None


def _raise_redacted(err: Exception) -> None:
    """A URLError with the message of `err` redacted, when its message quotes a secret (http.client
    quotes the URL in some of its errors). An HTTPError keeps its status, headers and body (a
    caller reads them) and is redacted in place: urllib quotes a redirect target it will not
    follow (another scheme) in its reason and keeps it as the error's URL."""
    message = str(err)
    # without a proxy it quotes the path and query only: no scheme for redact_text to find
    if isinstance(err, http.client.InvalidURL) and "://" not in message:
        unquoted = message.split(" '")[0].rstrip(".:")
        raise urllib.error.URLError(f"invalid URL ({unquoted})") from None
    if redact_text(message) == message:
        return
    if isinstance(err, urllib.error.HTTPError):
        err.msg = redact_text(err.msg)
        err.url = err.filename = redact_text(err.url)
        return  # the caller re-raises it
    raise urllib.error.URLError(redact_text(message)) from None


def build_opener(policy: FetchPolicy) -> urllib.request.OpenerDirector:
    """A urllib opener that applies `policy` (see the module docstring)."""
    opener = _GuardedOpener(policy.deadline_s)
    handlers: list[urllib.request.BaseHandler] = [
        urllib.request.UnknownHandler(), _CheckedHTTPHandler(policy),
        _CheckedHTTPSHandler(policy), urllib.request.HTTPDefaultErrorHandler(),
        _CheckedRedirectHandler(policy), urllib.request.HTTPErrorProcessor()]
    if "file" in policy.allowed_schemes:  # the synthetic source only (download.allowed_schemes)
        handlers.append(urllib.request.FileHandler())
    if policy.allow_private_addresses:  # no address to check: proxies may resolve the host
        handlers.append(urllib.request.ProxyHandler())
    for handler in handlers:
        opener.add_handler(handler)
    return opener


def refusal_counts(reasons: Iterable[str | None]) -> dict[str, int]:
    """{reason: count} over PRECHECK_REASONS (zeros included, so the metrics keep their keys)."""
    counts = dict.fromkeys(PRECHECK_REASONS, 0)
    for reason in reasons:
        if reason is not None:
            counts[reason] += 1
    return counts
