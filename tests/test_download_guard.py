"""Downloads cannot be turned against the machine: the address rule, redirects,
bounded bodies, and images refused by size before they are decoded.

In-process tests drive `clipms.prep.urlguard`'s opener against a loopback server; the stage tests
run the real `download` stage (real img2dataset, its own worker processes) against one. Only DNS
cannot exist here (no public name resolves offline): where a test needs a public answer or a
changing one (rebinding), it replaces `socket.getaddrinfo` and says so; every connection is still
real and goes to 127.0.0.1 only.
"""

from __future__ import annotations

import json
import socket
import struct
import subprocess
import sys
import urllib.error
import zlib

import pytest

from clipms.prep.urlguard import FetchPolicy, RefusedURL, address_problem, build_opener, precheck
from tests.image_site import Site, images_parquet, jpeg, stage_env, write_params

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
])
def test_address_rule(address, reason):
    assert address_problem(address) == reason


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
