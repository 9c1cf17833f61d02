"""Downloads cannot be turned against the machine: the address rule, redirects,
bounded bodies, and images refused by size before they are decoded.

In-process tests drive `prep.urlguard`'s opener against a loopback server; the stage tests
run the real `download` stage (real img2dataset, its own worker processes) against one. Only DNS
cannot exist here (no public name resolves offline): where a test needs a public answer or a
changing one (rebinding), it replaces `socket.getaddrinfo` and says so; every connection is still
real and goes to 127.0.0.1 only.
"""

from __future__ import annotations

import contextlib
import json
import socket
import struct
import subprocess
import sys
import threading
import time
import urllib.error
import zlib
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from harness.image_site import Site, images_parquet, jpeg, stage_env, write_params
from prep.urlguard import (
    PRECHECK_REASONS,
    DeadlinePassed,
    FetchPolicy,
    RefusedURL,
    _read_up_to,
    address_problem,
    build_opener,
    check_url,
    precheck,
    refusal_counts,
)

PUBLIC = "93.184.216.34"  # a public address (never connected to: see the module docstring)


@pytest.mark.parametrize(("address", "reason"), [
    ("127.0.0.1", "loopback_address"), ("127.8.9.10", "loopback_address"),
    ("::1", "loopback_address"), ("::ffff:127.0.0.1", "loopback_address"),
    ("10.1.2.3", "private_address"), ("172.16.0.1", "private_address"),
    ("192.168.1.1", "private_address"), ("fd00::1", "private_address"),
    ("169.254.169.254", "link_local_address"), ("fe80::1%eth0", "link_local_address"),
    ("224.0.0.1", "multicast_address"), ("ff02::1", "multicast_address"),
    ("0.0.0.0", "private_address"), ("100.64.0.1", "reserved_address"),
    ("240.0.0.1", "private_address"), ("192.0.2.7", "private_address"),
    ("8.8.8.8", None), (PUBLIC, None), ("2606:4700::1111", None),
    # reserved IPv6 that `ipaddress` calls global (x_address_problem__mutmut_12): 4000::/3 is
    # unassigned, 64:ff9b::/96 is NAT64 (64:ff9b::7f00:1 reaches 127.0.0.1 through a gateway)
    ("4000::1", "reserved_address"), ("64:ff9b::7f00:1", "reserved_address"),
])
def test_address_rule(address, reason):
    assert address_problem(address) == reason


@pytest.mark.parametrize("ipv4", ["127.0.0.1", "127.8.9.10", "10.1.2.3", "169.254.169.254",
                                  "224.0.0.1", "100.64.0.1", "0.0.0.0", "8.8.8.8", PUBLIC])
def test_an_ipv4_mapped_address_gets_the_rule_of_its_ipv4_address(ipv4):
    """::ffff:a.b.c.d reaches a.b.c.d: the IPv4 rule, reason included, not what `ipaddress`
    says of the IPv6 form (::ffff:127.0.0.1 is "private" there, not loopback, so a rule that
    forgot the mapping still refused it, by accident; and ::ffff:8.8.8.8 "reserved")."""
    assert address_problem(f"::ffff:{ipv4}") == address_problem(ipv4)


def fake_dns(answers: dict[str, list[str]]):
    """getaddrinfo for the names in `answers` (a stand-in for DNS, see the module docstring);
    IP literals and localhost resolve for real. A list of several answers is served in turn."""
    real = socket.getaddrinfo
    calls: dict[str, int] = {}

    def resolve(host, port, *args, **kwargs):
        if host not in answers:
            return real(host, port, *args, **kwargs)
        if not answers[host]:
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        address = answers[host][min(calls.get(host, 0), len(answers[host]) - 1)]
        calls[host] = calls.get(host, 0) + 1
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (address, port))]
    return resolve


def test_precheck_refuses_and_names_the_reason_per_url():
    policy = FetchPolicy()
    urls = ["http://127.0.0.1:8000/a.jpg", "http://localhost/b.jpg", "http://[::1]/c.jpg",
            "http://10.0.0.1/d.jpg", "http://169.254.169.254/latest/meta-data",
            "http://224.0.0.1/e.jpg", "http://100.64.0.1/f.jpg", "ftp://example.org/g.jpg",
            "file:///etc/passwd", " http://x.org/h.jpg", "http://:80/i.jpg",
            "http://public.test/j.jpg", "http://public.test/k.jpg", "http://gone.test/l.jpg",
            "https://inside.test/m.jpg"]
    dns = fake_dns({"public.test": [PUBLIC], "gone.test": [], "inside.test": ["10.9.8.7"]})
    assert precheck(urls, policy, resolver=dns) == [
        "loopback_address", "loopback_address", "loopback_address", "private_address",
        "link_local_address", "multicast_address", "reserved_address", "disallowed_scheme",
        "disallowed_scheme", "disallowed_scheme", "bad_url", None, None, "unresolvable_host",
        "private_address"]
    # an internal mirror: one network exempt, or every address
    mirror = FetchPolicy(allowed_networks=("10.0.0.0/24",))
    assert precheck(urls[3:4] + urls[14:], mirror, resolver=dns) == [None, "private_address"]
    assert precheck(urls[:7], FetchPolicy(allow_private_addresses=True)) == [None] * 7


def internal_redirects(site: Site) -> dict[str, str]:
    """Redirects to internal addresses that, should the rule ever fail, still reach only this
    machine (0.0.0.0 and 127.0.0.2 connect locally): no test may send traffic to a private
    network. 0.0.0.0 counts as a private address (0.0.0.0/8), 127.0.0.2 as loopback."""
    port = site.base.rsplit(":", 1)[1]
    return {"/to-ftp.jpg": "ftp://127.0.0.1/x.jpg",
            "/to-private.jpg": f"http://0.0.0.0:{port}/good/1.jpg",
            "/to-loopback.jpg": f"http://127.0.0.2:{port}/good/1.jpg",
            "/to-good.jpg": "/good/1.jpg"}


@pytest.fixture()
def site():
    with Site(files={"/big.jpg": b"x" * 5000}, unsized={"/unsized/big.jpg": b"x" * 5000}) as served:
        served.redirects.update(internal_redirects(served))
        yield served


def fetch(policy: FetchPolicy, url: str) -> bytes:
    with build_opener(policy).open(url, timeout=10) as response:
        return response.read()


def refusal(policy: FetchPolicy, url: str) -> str:
    """The RefusedURL reason raised by fetching `url` (directly, or wrapped by urllib)."""
    with pytest.raises((RefusedURL, urllib.error.URLError)) as caught:
        fetch(policy, url)
    err = caught.value
    refused = err if isinstance(err, RefusedURL) else err.reason
    assert isinstance(refused, RefusedURL), err
    return refused.reason


def test_the_opener_checks_addresses_where_it_connects(site):
    """No pre-check here: the connection itself refuses the loopback server, which never sees a
    request; with the address exempt it is fetched."""
    url = f"{site.base}/good/0.jpg"
    assert refusal(FetchPolicy(), url) == "loopback_address"
    assert refusal(FetchPolicy(), url.replace("127.0.0.1", "localhost")) == "loopback_address"
    assert site.requests == []
    assert fetch(FetchPolicy(allowed_networks=("127.0.0.1/32",)), url) == jpeg((200, 30, 30))


def test_dns_rebinding_between_precheck_and_connect_is_refused(site, monkeypatch):
    host_url = f"http://rebind.test:{site.base.rsplit(':', 1)[1]}/good/0.jpg"
    dns = fake_dns({"rebind.test": [PUBLIC, "127.0.0.1"]})  # public first, then loopback
    monkeypatch.setattr(socket, "getaddrinfo", dns)
    assert precheck([host_url], FetchPolicy()) == [None]  # looked public
    assert refusal(FetchPolicy(), host_url) == "loopback_address"
    assert site.requests == []


def test_redirects_may_not_change_scheme_or_reach_an_internal_address(site):
    loopback_only = FetchPolicy(allowed_networks=("127.0.0.1/32",))
    assert refusal(loopback_only, f"{site.base}/to-ftp.jpg") == "redirect_scheme"
    assert refusal(loopback_only, f"{site.base}/to-private.jpg") == "private_address"
    assert refusal(loopback_only, f"{site.base}/to-loopback.jpg") == "loopback_address"
    assert "/good/1.jpg" not in site.requests  # none of them was followed
    assert fetch(loopback_only, f"{site.base}/to-good.jpg") == jpeg((30, 160, 60))
    # even with every address allowed, the scheme rule stands (urllib would follow to ftp)
    assert refusal(FetchPolicy(allow_private_addresses=True),
                   f"{site.base}/to-ftp.jpg") == "redirect_scheme"


TOKEN = "ghp_SECRET123"
USERINFO_FORMS = [f"{TOKEN}@", f"user:{TOKEN}@", "user:@", f":{TOKEN}@", "@"]


@pytest.mark.parametrize("userinfo", USERINFO_FORMS)
def test_user_info_in_any_form_is_refused_and_never_printed(site, userinfo):
    """A token as the user name (`TOKEN@`, as GitHub and many object stores take it) is as secret
    as a password: refused before any request, directly and as a redirect target, by the
    pre-check and by the opener, and the token is in no refusal text."""
    port = site.base.rsplit(":", 1)[1]
    secret_url = f"http://{userinfo}127.0.0.1:{port}/good/0.jpg"
    site.redirects["/to-secret.jpg"] = secret_url
    everything = FetchPolicy(allow_private_addresses=True)
    with pytest.raises(RefusedURL) as refused:
        check_url(secret_url, FetchPolicy())
    texts = [str(refused.value)]
    assert refused.value.reason == "bad_url"
    assert precheck([secret_url], FetchPolicy()) == ["bad_url"]
    assert precheck([secret_url], everything) == ["bad_url"]
    for url in (secret_url, f"{site.base}/to-secret.jpg"):
        with pytest.raises(RefusedURL) as refused:
            fetch(everything, url)
        assert refused.value.reason == "bad_url"
        texts.append(str(refused.value))
    assert "/good/0.jpg" not in site.requests  # never fetched, neither directly nor redirected
    assert all("user-info" in text and TOKEN not in text for text in texts), texts


def test_a_url_urllib_cannot_split_is_one_bad_url_not_a_crash():
    """`http://[::1/x` (an unclosed IPv6 bracket) made urlsplit raise inside the pre-check, and one
    such row in a URL list stopped the whole download stage."""
    urls = ["http://[::1/x.jpg", f"http://[::1@{TOKEN}/x.jpg", "http://[fe80::1%zz/x.jpg"]
    assert precheck(urls, FetchPolicy()) == ["bad_url"] * 3
    for url in urls:
        with pytest.raises(RefusedURL) as refused:
            check_url(url, FetchPolicy())
        assert refused.value.reason == "bad_url" and TOKEN not in str(refused.value)


def test_a_user_info_refusal_names_the_url_without_it_and_says_what_to_do():
    """The refusal names the URL (redacted) and tells the user what to do
    (x__check_userinfo__mutmut_8..11)."""
    with pytest.raises(RefusedURL) as refused:
        check_url(f"https://{TOKEN}@mirror.test/a.jpg?sig=x", FetchPolicy())
    assert str(refused.value) == (
        "refused (bad_url): 'https://<redacted>@mirror.test/a.jpg?<redacted>': user-info "
        "(user:password@, TOKEN@) in a URL is not sent by the downloader; give the URL without it")


def test_only_tcp_addresses_are_connected_to():
    """The resolved addresses are stream (TCP) ones only: a refused TCP connection must not fall
    through to a UDP or raw socket of the same address (x_resolve_checked__mutmut_9)."""
    from prep.urlguard import resolve_checked

    infos = resolve_checked("127.0.0.1", 80, FetchPolicy(allow_private_addresses=True))
    assert infos and {info[1] for info in infos} == {socket.SOCK_STREAM}


def test_a_refusal_never_quotes_the_user_info_of_a_host_string():
    """http.client quotes a request's host as `TOKEN@host`; whatever reaches the resolver, the
    refusal text has no token."""
    from prep.urlguard import resolve_checked

    dns = fake_dns({f"{TOKEN}@mirror.test": [], f"{TOKEN}@inside.test": ["10.9.8.7"]})
    for host in (f"{TOKEN}@mirror.test", f"{TOKEN}@inside.test"):
        with pytest.raises(RefusedURL) as refused:
            resolve_checked(host, 80, FetchPolicy(), dns)
        assert TOKEN not in str(refused.value) and "@" in str(refused.value)


def test_bodies_are_bounded(site):
    policy = FetchPolicy(allow_private_addresses=True, max_bytes=4096)
    assert refusal(policy, f"{site.base}/big.jpg") == "too_large"  # by its Content-Length
    with pytest.raises(RefusedURL, match="too_large"):  # no Content-Length: while reading
        fetch(policy, f"{site.base}/unsized/big.jpg")
    roomy = FetchPolicy(allow_private_addresses=True, max_bytes=8192)
    assert fetch(roomy, f"{site.base}/big.jpg") == fetch(roomy, f"{site.base}/unsized/big.jpg")


# ---------------------------------------------------------------- the stage, real img2dataset


def huge_png(side: int = 12_000) -> bytes:
    """A valid RGBA PNG of side x side transparent pixels: ~0.6 MB on the wire, 576 MB as cv2
    decodes it (and ~3.5 GB more for img2dataset's float64 alpha matting)."""
    def chunk(kind: bytes, payload: bytes) -> bytes:
        return (struct.pack(">I", len(payload)) + kind + payload
                + struct.pack(">I", zlib.crc32(kind + payload) & 0xFFFFFFFF))
    packer, row = zlib.compressobj(6), b"\0" * (1 + 4 * side)
    body = b"".join(packer.compress(row) for _ in range(side)) + packer.flush()
    header = struct.pack(">IIBBBBB", side, side, 8, 6, 0, 0, 0)  # 8-bit RGBA
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", body) + chunk(b"IEND",
                                                                                       b"")


def tiff_duplicate_size_tags(small: int = 100, big: int = 12_000) -> bytes:
    """A 10 KB greyscale TIFF whose IFD gives its width and height twice: PIL reads
    small x small from the header; a decoder that takes the other pair sees big x big."""
    entries = [(256, 4, big), (257, 4, big), (256, 3, small), (257, 3, small), (258, 3, 8),
               (259, 3, 1), (262, 3, 1), (273, 4, 0), (277, 3, 1), (278, 4, small),
               (279, 4, small * small)]
    data_at = 8 + 2 + 12 * len(entries) + 4
    out = [b"II*\0", struct.pack("<I", 8), struct.pack("<H", len(entries))]
    for tag, kind, value in entries:
        value = data_at if tag == 273 else value  # StripOffsets: the pixels after the IFD
        packed = struct.pack("<HH", value, 0) if kind == 3 else struct.pack("<I", value)
        out.append(struct.pack("<HHI", tag, kind, 1) + packed)
    return b"".join([*out, struct.pack("<I", 0), b"\x80" * small * small])


class HandedOn:
    """Records what the header check hands on to img2dataset's resizer (cv2). It decodes nothing
    itself: what must never reach cv2 is not decoded here either, even where the check fails."""

    def __init__(self) -> None:
        self.seen: list[bytes] = []

    def __call__(self, img_stream, blurring_bbox_list=None) -> tuple:
        self.seen.append(img_stream.getvalue())
        return (b"handed on", 1, 1, 1, 1, None)


def test_only_jpeg_png_and_webp_reach_cv2():
    """cv2 decodes JPEG 2000 and TIFF too: a worker crashing in cv2's JPEG 2000 decoder hangs
    the stage; a TIFF with duplicate size tags passed the header check as 100 x 100.
    Both, and every other format, are refused by name before cv2; the three allowed formats
    still go through img2dataset's own resizer."""
    import io

    from img2dataset.resizer import Resizer

    from harness.hostile_images import encoded
    from prep.img2dataset_guard import HeaderCheckedResizer, ImageLimits

    limits = ImageLimits(max_image_area=4_000_000, max_aspect_ratio=8.0)
    handed_on = HandedOn()
    check = HeaderCheckedResizer(handed_on, limits)
    hostile = {"JPEG2000": encoded("JPEG2000")[:200], "TIFF": tiff_duplicate_size_tags(),
               "GIF": encoded("GIF"), "BMP": encoded("BMP")}
    hostile["JPEG2000 whole"] = encoded("JPEG2000")
    for name, data in hostile.items():
        err = check(io.BytesIO(data))[-1]
        assert err == f"image format {name.split()[0]} not allowed (only JPEG, PNG, WEBP)", name
    assert check(io.BytesIO(b"not an image at all"))[-1] == "Image decoding error"
    assert handed_on.seen == []
    real = HeaderCheckedResizer(Resizer(16, "border", False), limits)
    for fmt in ("JPEG", "PNG", "WEBP"):
        image, width, height, *_, err = real(io.BytesIO(encoded(fmt)))
        assert err is None and (width, height) == (16, 16) and image, fmt


def run_download_measured(folder) -> tuple[subprocess.CompletedProcess[str], float]:
    """The download stage in a fresh wrapper process; returns it and the peak RSS (MB) of the
    largest process of its tree (the stage and every img2dataset worker it waited for)."""
    wrapper = ("import resource, subprocess, sys\n"
               "rc = subprocess.call([sys.executable, '-m', 'stages.download'])\n"
               "print('PEAK_RSS_KB', resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)\n"
               "sys.exit(rc)\n")
    proc = subprocess.run([sys.executable, "-c", wrapper], cwd=folder, env=stage_env(),
                          capture_output=True, text=True, timeout=300)
    peak_kb = int(proc.stdout.rsplit("PEAK_RSS_KB", 1)[1].split()[0])
    return proc, peak_kb / 1024


def metrics_of(folder) -> dict:
    return json.loads((folder / "metrics/download.json").read_text())


@pytest.mark.slow
def test_huge_pngs_are_refused_by_area_before_decoding(tmp_path):
    png = huge_png()
    with Site(files={f"/huge/{i}.png": png for i in range(3)}) as site:
        urls = [f"{site.base}/huge/{i}.png" for i in range(3)] + [f"{site.base}/good/0.jpg"]
        images_parquet(tmp_path, urls)
        write_params(tmp_path, max_image_area=25_000_000, min_success_rate=0.5)
        proc, peak_mb = run_download_measured(tmp_path)
    metrics = metrics_of(tmp_path)
    assert metrics["failure_reasons"] == {"image area too large": 3}, metrics
    assert metrics["successes"] == 1 and metrics["attempted"] == 4
    # measured: 196 MB; with the header check taken out, 10,617 MB (img2dataset decodes first)
    assert peak_mb < 1024, f"peak RSS {peak_mb:.0f} MB"
    # 1 of 4 arrived: under min_success_rate, the stage fails and names the reason
    assert proc.returncode == 1
    assert "3 x image area too large" in proc.stderr, proc.stderr


@pytest.mark.slow
def test_loopback_urls_are_refused_without_allow_private_addresses(tmp_path):
    with Site() as site:
        port = site.base.rsplit(":", 1)[1]
        images_parquet(tmp_path, [f"{site.base}/good/0.jpg", f"http://localhost:{port}/good/1.jpg",
                                  f"http://[::1]:{port}/good/2.jpg"])
        write_params(tmp_path, allow_private_addresses=False, min_success_rate=0.5)
        proc, _ = run_download_measured(tmp_path)
        requests = list(site.requests)
    metrics = metrics_of(tmp_path)
    assert metrics["refused"]["loopback_address"] == 3 and metrics["attempted"] == 0
    assert requests == []  # refused before any download
    assert proc.returncode == 1 and "3 x refused: loopback_address" in proc.stderr


@pytest.mark.slow
def test_redirects_to_ftp_or_a_private_address_are_refused_in_img2dataset(tmp_path):
    """Inside img2dataset's own worker process: its urllib.urlopen goes through the policy."""
    with Site() as site:
        site.redirects.update(internal_redirects(site))
        images_parquet(tmp_path, [f"{site.base}/good/0.jpg", f"{site.base}/to-ftp.jpg",
                                  f"{site.base}/to-private.jpg"])
        write_params(tmp_path, allow_private_addresses=False, allowed_networks=["127.0.0.1/32"])
        proc, _ = run_download_measured(tmp_path)
        requests = list(site.requests)
    assert proc.returncode == 0, proc.stderr
    assert "/good/1.jpg" not in requests  # the redirect target was never fetched
    metrics = metrics_of(tmp_path)
    assert metrics["successes"] == 1 and metrics["failed_to_download"] == 2
    reasons = " | ".join(metrics["failure_reasons"])
    assert "refused (redirect_scheme)" in reasons and "refused (private_address)" in reasons


# ---------------------------------------------------------------- urlguard: check_url, precheck
# Edges `make mutation` (benchmarks/mutation.py) found untested; each docstring names the
# mutants (mutmut's names) the test kills.


class Resolver:
    """getaddrinfo for made-up names: records (host, port) asked, answers `address`."""

    def __init__(self, address: str = PUBLIC) -> None:
        self.address, self.asked = address, []

    def __call__(self, host, port, *_args, **_kwargs):
        self.asked.append((host, port))
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (self.address, port))]


def refused(url: str, policy: FetchPolicy, resolver=None) -> RefusedURL:
    with pytest.raises(RefusedURL) as caught:
        check_url(url, policy, resolver)
    return caught.value


def test_check_url_resolves_with_the_given_resolver_and_the_default_port_of_the_scheme():
    """x_check_url__mutmut_17/20 (resolver dropped), x__host_port__mutmut_3..10 (port)."""
    dns = Resolver()
    for url in ("http://public.test/a.jpg", "https://public.test/b.jpg",
                "HTTPS://public.test/c.jpg", "http://public.test:8080/d.jpg"):
        check_url(url, FetchPolicy(), dns)
    assert dns.asked == [("public.test", 80), ("public.test", 443), ("public.test", 443),
                         ("public.test", 8080)]
    assert refused("http://inside.test/x.jpg", FetchPolicy(), Resolver("10.9.8.7")).reason == \
        "private_address"


def test_check_url_names_the_reason_and_what_is_allowed():
    """x_check_url__mutmut_4..10 (reason/message), x__host_port__mutmut_11..14."""
    err = refused("ftp://public.test/a.jpg", FetchPolicy())
    assert err.reason == "disallowed_scheme"
    assert str(err) == ("refused (disallowed_scheme): 'ftp://public.test/a.jpg': scheme 'ftp' is "
                        "not in ['http', 'https']")
    err = refused("http://public.test:99999/a.jpg", FetchPolicy(), Resolver())
    assert err.reason == "bad_url" and "'http://public.test:99999/a.jpg': Port out of range" \
        in str(err)
    assert str(refused("http://:80/a.jpg", FetchPolicy())) == \
        "refused (bad_url): 'http://:80/a.jpg': no host"  # x__host_port__mutmut_19
    # x_resolve_checked__mutmut_22/25/26/27: the address (not the port) and the setting named
    assert str(refused("http://inside.test/a.jpg", FetchPolicy(), Resolver("10.9.8.7"))) == (
        "refused (private_address): inside.test resolves to 10.9.8.7 "
        "(download.allow_private_addresses is false)")

    def no_such_host(host, *_args, **_kwargs):
        raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")

    gone = refused("http://gone.test/a.jpg", FetchPolicy(), no_such_host)  # _13
    assert (gone.reason, str(gone)) == ("unresolvable_host", "refused (unresolvable_host): "
                                        "gone.test: [Errno -2] Name or service not known")


def test_check_url_resolves_nothing_for_file_urls_or_when_private_addresses_are_allowed():
    """x_check_url__mutmut_11..15: which URLs are resolved at all."""
    never = Resolver()
    check_url("file:///tmp/a.jpg", FetchPolicy(allowed_schemes=frozenset({"file"})), never)
    check_url("http://anything.test/a.jpg", FetchPolicy(allow_private_addresses=True), never)
    assert never.asked == []
    assert refused("http://127.0.0.1/a.jpg", FetchPolicy()).reason == "loopback_address"


def test_precheck_passes_file_urls_of_the_synthetic_source_without_a_host():
    """x_precheck__mutmut_9/11/12 (a file URL sent to the host check: 'bad_url, no host')."""
    dns = Resolver()
    files = FetchPolicy(allowed_schemes=frozenset({"file", "http"}))
    assert precheck(["file:///data/a.jpg", "http://public.test:81/b.jpg"], files, dns) == \
        [None, None]
    assert dns.asked == [("public.test", 81)]  # x_precheck__mutmut_41: the port is passed on


def test_precheck_resolves_at_most_threads_hosts_at_a_time():
    """`threads` bounds the lookups in flight (a user's DNS server, a rate-limited resolver): one
    at a time with threads=1, and more than one when allowed (x_precheck__mutmut_24/29)."""

    def peak(threads: int) -> int:
        lock, state = threading.Lock(), {"now": 0, "peak": 0}

        def resolve(host, port, *_args, **_kwargs):
            with lock:
                state["now"] += 1
                state["peak"] = max(state["peak"], state["now"])
            time.sleep(0.05)
            with lock:
                state["now"] -= 1
            return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (PUBLIC, port))]

        urls = [f"http://host{i}.test/a.jpg" for i in range(6)]
        assert precheck(urls, FetchPolicy(), resolve, threads=threads) == [None] * 6
        return state["peak"]

    assert peak(1) == 1
    assert peak(0) == 1  # no thread asked for: one, not a crash
    assert 1 < peak(3) <= 3


def test_refusal_counts_has_every_reason_and_counts_each_refusal():
    """x_refusal_counts__mutmut_1..10 (no fast test called it)."""
    counts = refusal_counts([None, "loopback_address", "bad_url", "loopback_address", None])
    assert counts == {**dict.fromkeys(PRECHECK_REASONS, 0), "loopback_address": 2, "bad_url": 1}
    assert list(counts) == list(PRECHECK_REASONS)


# ---------------------------------------------------------------- urlguard: inside urllib


LIMIT = 4096


@pytest.fixture(scope="module")
def limit_site():
    """Bodies of exactly LIMIT bytes and one byte more, sized and unsized; redirects."""
    body = bytes(range(256)) * (LIMIT // 256)  # exactly LIMIT bytes
    with Site(files={"/limit.bin": body, "/over.bin": body + b"!"},
              unsized={"/unsized/limit.bin": body, "/unsized/over.bin": body + b"!"}) as served:
        port = served.base.rsplit(":", 1)[1]
        served.redirects.update({"/to-https.jpg": f"https://0.0.0.0:{port}/limit.bin",
                                 "/to-same.jpg": "/limit.bin"})
        yield served


def opened(policy: FetchPolicy, url: str):
    return build_opener(policy).open(url, timeout=10)


def refusal_of(policy: FetchPolicy, url: str, read_size: int | None = None) -> RefusedURL:
    import urllib.error

    with pytest.raises((RefusedURL, urllib.error.URLError)) as caught, opened(policy, url) as r:
        while r.read(read_size) if read_size else r.read():
            pass
    err = caught.value
    return err if isinstance(err, RefusedURL) else err.reason


def test_a_body_of_exactly_the_limit_is_read_whole_in_any_chunk_size(limit_site):
    """x__bounded__mutmut_11/44 (> became >=), _54 (start count), _51/52 (the running count),
    _21/_23/_28.._33 (how much one read asks for), _26/_27 (read(0))."""
    policy = FetchPolicy(allow_private_addresses=True, max_bytes=LIMIT)
    want = bytes(range(256)) * (LIMIT // 256)
    for path in ("/limit.bin", "/unsized/limit.bin"):
        with opened(policy, limit_site.base + path) as response:
            assert response.read(0) == b""
            assert response.read(10) == want[:10]
            assert response.read() == want[10:]
        with opened(policy, limit_site.base + path) as response:  # _32: one read may ask for it all
            assert response.read(2 * LIMIT) == want
        with opened(policy, limit_site.base + path) as response:
            chunks = iter(lambda: response.read(1000), b"")
            assert [len(c) for c in chunks] == [1000] * 4 + [96]


def test_one_byte_over_the_limit_is_refused_and_says_why(limit_site):
    """x__bounded__mutmut_2/4 (Content-Length not read), _13/_46/_49 (reason, message), and
    chunked reads of an unsized body (_51/_52: the count must add up across reads)."""
    policy = FetchPolicy(allow_private_addresses=True, max_bytes=LIMIT)
    sized = refusal_of(policy, limit_site.base + "/over.bin")
    assert sized.reason == "too_large"
    assert f"Content-Length {LIMIT + 1} is over the limit of {LIMIT} bytes" in str(sized)
    for size in (None, 1000):
        unsized = refusal_of(policy, limit_site.base + "/unsized/over.bin", size)
        assert unsized.reason == "too_large"
        assert f"/unsized/over.bin: body over the limit of {LIMIT} bytes" in str(unsized)


def test_reading_a_small_body_does_not_allocate_the_limit(limit_site):
    """A body without Content-Length is read a megabyte at a time up to the limit: reading it
    whole must not allocate a buffer of `max_bytes` (32 MB by default) per image, as one
    `read(limit + 1)` does (x__bounded__mutmut_36/38)."""
    import tracemalloc

    policy = FetchPolicy(allow_private_addresses=True)
    assert policy.max_bytes >= 32 << 20
    with opened(policy, limit_site.base + "/unsized/limit.bin") as response:
        tracemalloc.start()
        try:
            body = response.read()
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
    assert len(body) == LIMIT
    assert peak < 4 << 20, peak


def test_read_up_to_stops_at_the_size_even_when_the_source_answers_in_small_pieces():
    """x__read_up_to__mutmut_5/13/15/16: a short-reading source is read to `size`, no further."""
    source, served = bytes(100), []

    def read(n: int) -> bytes:  # a socket-like reader: at most 7 bytes per call
        piece = source[sum(served):][:min(n, 7)]
        served.append(len(piece))
        return piece

    assert _read_up_to(read, 30) == bytes(30)
    assert sum(served) == 30


def test_https_connections_check_the_address_where_they_connect():
    """xǁ_CheckedHTTPSHandlerǁhttps_open__mutmut_*, xǁ_CheckedHTTPSConnectionǁ__init____mutmut_*
    (no fast test opened an https URL): refused at connect, before any TLS (port 9 is discard;
    nothing is sent)."""
    assert refusal_of(FetchPolicy(), "https://127.0.0.1:9/a.jpg").reason == "loopback_address"
    assert refusal_of(FetchPolicy(), "https://localhost:9/a.jpg").reason == "loopback_address"


def test_a_failed_connection_names_its_own_error(monkeypatch):
    """Where an allowed address refuses the connection, the error is that refusal, not "no
    address to connect to"; a host with no address at all says that, naming the host
    (x__checked_connection__mutmut_20/21/22). Nothing listens on the port: it was just freed."""
    with socket.create_server(("127.0.0.1", 0)) as freed:
        port = freed.getsockname()[1]
    opener = build_opener(FetchPolicy(allowed_networks=("127.0.0.1/32",)))
    with pytest.raises(urllib.error.URLError) as caught:
        opener.open(f"http://127.0.0.1:{port}/a.jpg", timeout=3)
    assert isinstance(caught.value.reason, ConnectionRefusedError), caught.value
    monkeypatch.setattr(socket, "getaddrinfo", lambda *_args, **_kwargs: [])  # an empty answer
    with pytest.raises(urllib.error.URLError, match="empty.test: no address to connect to"):
        opener.open("http://empty.test/a.jpg", timeout=3)


def test_a_connection_leaves_from_the_source_address_it_is_given(limit_site):
    """http.client's `source_address` reaches the checked socket: the connection leaves from
    127.0.0.2 when asked to (x__checked_connection__mutmut_18)."""
    from prep.urlguard import _CheckedHTTPConnection

    port = int(limit_site.base.rsplit(":", 1)[1])
    connection = _CheckedHTTPConnection("127.0.0.1", port, timeout=3,
                                        source_address=("127.0.0.2", 0),
                                        policy=FetchPolicy(allowed_networks=("127.0.0.1/32",)))
    try:
        connection.request("GET", "/limit.bin")
        assert connection.sock.getsockname()[0] == "127.0.0.2"
        assert len(connection.getresponse().read()) == LIMIT
    finally:
        connection.close()


def test_the_opener_reads_local_files_only_when_the_file_scheme_is_allowed(tmp_path):
    """x_build_opener__mutmut_6..9: the FileHandler is there for the synthetic source only."""
    import urllib.error

    local = tmp_path / "a.jpg"
    local.write_bytes(b"local bytes")
    with pytest.raises(urllib.error.URLError, match="unknown url type: file"):
        build_opener(FetchPolicy()).open(local.as_uri())
    with build_opener(FetchPolicy(allowed_schemes=frozenset({"file"}))).open(local.as_uri()) as f:
        assert f.read() == b"local bytes"


def test_the_timeout_reaches_the_checked_socket(limit_site):
    """x__checked_connection__mutmut_16/17 and xǁ_CheckedHTTPConnectionǁ__init____mutmut_2 (the
    timeout dropped: a stalled server would hold the download for as long as it likes). The
    stalled path answers after 60 s at most; the fetch must give up after 0.5 s."""
    import time

    policy = FetchPolicy(allow_private_addresses=True)
    started = time.monotonic()
    with pytest.raises(OSError, match="timed out"):
        build_opener(policy).open(limit_site.base + "/stall/1.jpg", timeout=0.5).read()
    assert time.monotonic() - started < 30


def test_the_timeout_reaches_the_checked_https_socket():
    """xǁ_CheckedHTTPSConnectionǁ__init____mutmut_2 (the timeout dropped for https): a loopback
    listener that never answers stalls the TLS handshake; the fetch gives up after 0.5 s."""
    import time

    with socket.create_server(("127.0.0.1", 0)) as silent:  # accepts (backlog), never speaks
        url = f"https://127.0.0.1:{silent.getsockname()[1]}/a.jpg"
        policy = FetchPolicy(allowed_networks=("127.0.0.1/32",))
        started = time.monotonic()
        with pytest.raises(OSError, match="timed out"):
            build_opener(policy).open(url, timeout=0.5)
        assert time.monotonic() - started < 30


def _self_signed_certificate(folder) -> tuple[str, str]:
    """A self-signed certificate for 127.0.0.1 (and its key) as PEM files: the TLS test servers'
    own CA, made by the test with `cryptography` (pinned in the dev extra)."""
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "clipms test limit_site")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(hours=1))
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .add_extension(x509.SubjectAlternativeName([
                x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
            .sign(key, hashes.SHA256()))
    cert_file, key_file = folder / "limit_site.pem", folder / "limit_site.key"
    cert_file.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_file.write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                           serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return str(cert_file), str(key_file)


@pytest.fixture(scope="module")
def tls_site(tmp_path_factory):
    """The `limit_site` files over HTTPS on 127.0.0.1 (its certificate: `tls_site.ca`)."""
    import ssl

    cert, key = _self_signed_certificate(tmp_path_factory.mktemp("tls"))
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, key)
    body = bytes(range(256)) * (LIMIT // 256)
    served = Site(files={"/limit.bin": body, "/over.bin": body + b"!"},
                  unsized={"/unsized/over.bin": body + b"!"})
    served.server.socket = context.wrap_socket(served.server.socket, server_side=True)
    served.base, served.ca = served.base.replace("http://", "https://"), cert
    with served:
        yield served


def test_an_https_body_is_bounded_like_an_http_one(tls_site, monkeypatch):
    """xǁ_CheckedHTTPSHandlerǁhttps_open__mutmut_2/4 (the HTTPS response not bounded by
    `max_bytes`: an https URL could send an unbounded body). A real TLS server on 127.0.0.1
    with a certificate the test made, trusted through SSL_CERT_FILE as a user's own CA is."""
    monkeypatch.setenv("SSL_CERT_FILE", tls_site.ca)
    policy = FetchPolicy(allow_private_addresses=True, max_bytes=LIMIT)
    with opened(policy, tls_site.base + "/limit.bin") as response:
        assert response.read() == bytes(range(256)) * (LIMIT // 256)
    sized = refusal_of(policy, tls_site.base + "/over.bin")
    assert sized.reason == "too_large"
    assert f"/over.bin: Content-Length {LIMIT + 1} is over the limit of {LIMIT} bytes" in str(sized)
    unsized = refusal_of(policy, tls_site.base + "/unsized/over.bin", 1000)
    assert unsized.reason == "too_large"
    assert f"/unsized/over.bin: body over the limit of {LIMIT} bytes" in str(unsized)
    monkeypatch.delenv("SSL_CERT_FILE")  # and the certificate is really checked
    with pytest.raises(OSError, match="CERTIFICATE_VERIFY_FAILED"):
        opened(policy, tls_site.base + "/limit.bin")


def test_redirect_http_to_https_is_an_upgrade_not_a_scheme_change(limit_site):
    """xǁ_CheckedRedirectHandlerǁredirect_request__mutmut_9..13: http -> https is followed to the
    address check (0.0.0.0 is refused: private; it would only reach this machine anyway), _6: a
    same-scheme redirect to a scheme the policy does not allow, _16/_26: the messages."""
    first_hop_exempt = FetchPolicy(allowed_networks=("127.0.0.1/32",))
    upgrade = refusal_of(first_hop_exempt, limit_site.base + "/to-https.jpg")
    assert upgrade.reason == "private_address"
    port = limit_site.base.rsplit(":", 1)[1]
    assert f"redirect to 'https://0.0.0.0:{port}/limit.bin'" in str(upgrade)
    only_https = FetchPolicy(allowed_schemes=frozenset({"https"}), allow_private_addresses=True)
    same = refusal_of(only_https, limit_site.base + "/to-same.jpg")
    assert same.reason == "redirect_scheme"
    assert f"redirect from http: to '{limit_site.base}/limit.bin'" in str(same)



# ---------------------------------------------------------------- urlguard: a fetch's deadline


def read_for(response, seconds: float) -> None:
    """Read `response` to its end, or give up after `seconds` (a test must not wait on a server
    that drips for minutes when the deadline it checks is missing)."""
    until = time.monotonic() + seconds
    while time.monotonic() < until and response.read(1):  # a byte: a read waits for no more
        pass


def test_an_http_fetch_ends_at_its_deadline_in_the_headers_or_the_body(limit_site):
    """`deadline_s` reaches the HTTP connection the opener makes: a body dripped a byte at a time
    and headers that never come both end at the deadline, as DeadlinePassed (its one message),
    and the next fetch gets a deadline of its own (xǁ_CheckedHTTPConnectionǁ__init____mutmut_8,
    xǁ_CheckedHTTPConnectionǁconnect__mutmut_1/2, xǁ_GuardedOpenerǁopen__mutmut_*)."""
    opener = build_opener(FetchPolicy(allow_private_addresses=True, deadline_s=0.5))
    for path in ("/drip.jpg", "/stall/2.jpg"):
        started = time.monotonic()
        with pytest.raises(DeadlinePassed, match="download deadline of 0.5 s passed"), \
                opener.open(limit_site.base + path, timeout=2) as response:
            read_for(response, 2)
        assert 0.4 < time.monotonic() - started < 2.5, path
    with opener.open(limit_site.base + "/limit.bin", timeout=3) as response:
        assert len(response.read()) == LIMIT  # the expired deadline was the last fetch's


def test_an_https_fetch_ends_at_its_deadline(tls_site, monkeypatch):
    """The same over TLS: `deadline_s` reaches the HTTPS connection and its reads of the
    decrypted body (xǁ_CheckedHTTPSConnectionǁ__init____mutmut_*, ǁconnect__mutmut_*)."""
    monkeypatch.setenv("SSL_CERT_FILE", tls_site.ca)
    opener = build_opener(FetchPolicy(allow_private_addresses=True, deadline_s=0.5))
    started = time.monotonic()
    with pytest.raises(DeadlinePassed, match="download deadline of 0.5 s passed"), \
            opener.open(tls_site.base + "/drip.jpg", timeout=2) as response:
        read_for(response, 2)
    assert 0.4 < time.monotonic() - started < 2.5


def test_an_error_that_quotes_a_secret_of_the_url_is_redacted(monkeypatch):
    """http.client quotes the request line in some errors; through a proxy that is the whole URL,
    a presigned query string included. The error says what failed without the signature
    (x__raise_redacted__mutmut_*). Nothing is sent: http.client refuses the line first."""
    for name in ("no_proxy", "NO_PROXY"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("http_proxy", "http://127.0.0.1:9")
    opener = build_opener(FetchPolicy(allow_private_addresses=True))  # proxies read here
    with pytest.raises(urllib.error.URLError) as caught:
        opener.open("http://mirror.test/a\x01b.jpg?X-Amz-Signature=SECRET", timeout=3)
    text = str(caught.value)
    assert "SECRET" not in text and "can't contain control characters" in text
    assert "http://mirror.test/a" in text and "<redacted>" in text


def test_an_invalid_url_error_never_quotes_the_query():
    """Without a proxy http.client quotes only the path and query of a URL with a control
    character: no scheme for redaction to find, so the message must not quote it at all."""
    opener = build_opener(FetchPolicy(allow_private_addresses=True))
    with pytest.raises(urllib.error.URLError) as caught:
        opener.open("http://127.0.0.1:9/a\x01b.jpg?X-Amz-Signature=SECRET", timeout=3)
    assert str(caught.value) == "<urlopen error invalid URL (URL can't contain control characters)>"


class OtherScheme(BaseHTTPRequestHandler):
    """Redirects to a presigned URL of a scheme urllib does not follow."""

    def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
        self.send_response(302)
        self.send_header("Location", "gopher://mirror.test/x.jpg?X-Amz-Signature=SECRET")
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *_args) -> None:
        pass


def test_a_redirect_to_another_scheme_is_refused_without_its_secret():
    """urllib refuses the redirect with an HTTPError that quotes the target in its reason and
    keeps it as its URL; both are redacted, and the status stays the server's."""
    with serving(OtherScheme) as base, pytest.raises(urllib.error.HTTPError) as caught:
        build_opener(FetchPolicy(allowed_networks=("127.0.0.1/32",))).open(f"{base}/a", timeout=3)
    err = caught.value
    assert err.code == 302 and "is not allowed" in str(err)
    assert "gopher://mirror.test/x.jpg" in str(err)
    assert "SECRET" not in f"{err} {err.reason} {err.url} {err.filename}"


@contextlib.contextmanager
def serving(handler: type[BaseHTTPRequestHandler]) -> Iterator[str]:
    """A loopback server of one handler class; yields its base URL."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05},
                     daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


class SlowHops(BaseHTTPRequestHandler):
    """/hop/<n> waits HOP_S, then redirects to /hop/<n-1>; /hop/0 is a quick small body."""

    HOP_S = 0.25

    def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
        hops = int(self.path.rsplit("/", 1)[1])
        if hops == 0:
            self.send_response(200)
            self.send_header("Content-Length", "4")
            self.end_headers()
            self.wfile.write(b"done")
            return
        time.sleep(self.HOP_S)
        self.send_response(302)
        self.send_header("Location", f"/hop/{hops - 1}")
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *_args) -> None:
        pass


def test_one_deadline_holds_for_a_whole_chain_of_redirects():
    """Redirects are part of the fetch they redirect: four hops of 0.25 s each, every one well
    within a 0.6 s deadline, end at 0.6 s all together; two hops fit. And a fetch after one
    that hit its deadline gets the whole deadline again (xǁ_GuardedOpenerǁopen__mutmut_1..12,
    _22: a deadline per hop, or none kept for the fetch)."""
    opener = build_opener(FetchPolicy(allowed_networks=("127.0.0.1/32",), deadline_s=0.6))
    with serving(SlowHops) as base:
        for _ in range(2):
            started = time.monotonic()
            with pytest.raises(DeadlinePassed, match="download deadline of 0.6 s passed"), \
                    opener.open(f"{base}/hop/4", timeout=3) as response:
                response.read()
            assert 0.5 < time.monotonic() - started < 0.95
            with opener.open(f"{base}/hop/2", timeout=3) as response:
                assert response.read() == b"done"


class Moved(BaseHTTPRequestHandler):
    """Answers a POST with 307 (urllib does not re-send a POST) and a body."""

    def do_POST(self) -> None:  # noqa: N802 (http.server's naming)
        self.rfile.read(int(self.headers["Content-Length"]))
        body = b"moved for a while"
        self.send_response(307)
        self.send_header("Location", "/elsewhere")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *_args) -> None:
        pass


def test_a_redirect_urllib_will_not_follow_keeps_its_status_reason_and_body():
    """A POST answered by 307 is not re-sent by urllib: the HTTPError carries the server's
    status, reason, headers and body, as urllib's own does
    (xǁ_CheckedRedirectHandlerǁredirect_request__mutmut_32/34/35, xǁ_GuardedOpenerǁopen__mutmut_15:
    the data dropped)."""
    with serving(Moved) as base, pytest.raises(urllib.error.HTTPError) as caught:
        build_opener(FetchPolicy(allowed_networks=("127.0.0.1/32",))).open(
            f"{base}/form", data=b"x=1", timeout=3)
    err = caught.value
    assert (err.code, err.reason, err.headers["Location"]) == (307, "Temporary Redirect",
                                                               "/elsewhere")
    assert err.read() == b"moved for a while"
