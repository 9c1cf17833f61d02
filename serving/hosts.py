"""Which `Host` and `Origin` headers the service answers: its defence against web pages.

A page the user opens in a browser can send requests to a service on the user's machine: a POST
with `Content-Type: text/plain` goes out without a CORS preflight (serving.guard refuses any body
that is not declared JSON, so such a POST never runs), and DNS rebinding (a name of the page's
own domain that first resolves to the page's server, then to 127.0.0.1) turns the same-origin
policy against the service, letting the page read the answers too. A rebinding request still
carries the page's name in `Host`, and a cross-site request its site in `Origin`:

- `Host` must name the service: its bind address, `localhost` and the loopback addresses when it
  binds loopback, any IP address when it binds every interface (an IP literal cannot be rebound:
  a page that uses one is served by the address itself), or a name configured with
  `--allowed-host` (the name users or a reverse proxy use). A request without `Host` (HTTP/1.0
  tools, not browsers) passes.
- `Origin`, when present (browsers send it with every POST and cross-origin fetch), must be the
  service itself: the same host and port as `Host` (the search page's own requests), or a
  configured name (a page served through a reverse proxy under that name). `Origin: null`
  (sandboxed frames, local files) is refused.
"""

# tested by: tests/serving/test_guard.py

from __future__ import annotations

import ipaddress
from dataclasses import dataclass
from urllib.parse import urlsplit

LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "::1"})
WILDCARDS = frozenset({"0.0.0.0", "::", ""})


def _ip(name: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        return ipaddress.ip_address(name)
    except ValueError:
        return None


def split_host(value: str) -> tuple[str, int | None] | None:
    """(host name lower-cased, port or None) of a Host header value; None when malformed."""
    try:
        parts = urlsplit(f"//{value}")
        return (parts.hostname or "").rstrip("."), parts.port
    except ValueError:  # a port that is not a number, a bracket left open
        return None


@dataclass(frozen=True)
class HostPolicy:
    """The names and addresses this service answers to (module docstring)."""

    names: frozenset[str]  # exact host names and addresses, lower-case
    configured: frozenset[str] = frozenset()  # --allowed-host names (also allowed as Origin)
    any_ip: bool = False  # bound to every interface: any IP literal names the service

    @classmethod
    def for_bind(cls, bind_host: str, allowed: tuple[str, ...] = ()) -> HostPolicy:
        configured = frozenset(name.lower().rstrip(".") for name in allowed)
        bind = bind_host.lower().strip("[]")
        names = {bind, *configured}
        ip = _ip(bind)
        if bind == "localhost" or (ip is not None and ip.is_loopback):
            names |= LOOPBACK_NAMES
        return cls(frozenset(names), configured, any_ip=bind in WILDCARDS)

    def allows_host(self, value: str) -> bool:
        parsed = split_host(value)
        if parsed is None or not parsed[0]:
            return False
        name = parsed[0]
        return name in self.names or (self.any_ip and _ip(name) is not None)

    def allows_origin(self, origin: str, host: str | None) -> bool:
        """Whether a request with this `Origin` came from the service's own pages (`host`: the
        request's Host header, None when it had none)."""
        try:
            parts = urlsplit(origin)
            name, port = (parts.hostname or "").rstrip("."), parts.port
        except ValueError:
            return False
        if parts.scheme not in ("http", "https") or not name:
            return False  # `null`, file:, an extension's scheme
        if name in self.configured:
            return True
        target = split_host(host) if host is not None else None
        default = {"http": 80, "https": 443}[parts.scheme]
        return target is not None and target[0] == name and (target[1] or default) == (
            port or default)


def shown(value: str, limit: int = 64) -> str:
    """A header value quoted in an error: at most `limit` characters of it."""
    return repr(value if len(value) <= limit else value[:limit] + "...")
