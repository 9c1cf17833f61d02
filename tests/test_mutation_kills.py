"""Edges of the critical modules that `make mutation` found untested.

Each test names the mutants it kills (mutmut's names, `mutmut show <name>` prints the diff;
benchmarks/RESULTS.md lists the mutants left alive and why). Fast: no process; loopback HTTP(S)
servers for the URL guard, a SQLite MLflow store for the gate, MindSpore only for the export parity
(a micro model's bundle) and the checkpoint tests.
"""

from __future__ import annotations

import socket

import pytest

from clipms.prep.urlguard import (
    PRECHECK_REASONS,
    FetchPolicy,
    RefusedURL,
    _read_up_to,
    build_opener,
    check_url,
    precheck,
    refusal_counts,
)
from tests.image_site import Site

PUBLIC = "93.184.216.34"  # never connected to: every resolver below answers without the network


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


# ---------------------------------------------------------------- urlguard: check_url, precheck


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


def test_refusal_counts_has_every_reason_and_counts_each_refusal():
    """x_refusal_counts__mutmut_1..10 (no fast test called it)."""
    counts = refusal_counts([None, "loopback_address", "bad_url", "loopback_address", None])
    assert counts == {**dict.fromkeys(PRECHECK_REASONS, 0), "loopback_address": 2, "bad_url": 1}
    assert list(counts) == list(PRECHECK_REASONS)


# ---------------------------------------------------------------- urlguard: inside urllib


LIMIT = 4096


@pytest.fixture(scope="module")
def site():
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


def test_a_body_of_exactly_the_limit_is_read_whole_in_any_chunk_size(site):
    """x__bounded__mutmut_11/44 (> became >=), _54 (start count), _51/52 (the running count),
    _21/_23/_28.._33 (how much one read asks for), _26/_27 (read(0))."""
    policy = FetchPolicy(allow_private_addresses=True, max_bytes=LIMIT)
    want = bytes(range(256)) * (LIMIT // 256)
    for path in ("/limit.bin", "/unsized/limit.bin"):
        with opened(policy, site.base + path) as response:
            assert response.read(0) == b""
            assert response.read(10) == want[:10]
            assert response.read() == want[10:]
        with opened(policy, site.base + path) as response:  # _32: one read may ask for it all
            assert response.read(2 * LIMIT) == want
        with opened(policy, site.base + path) as response:
            chunks = iter(lambda: response.read(1000), b"")
            assert [len(c) for c in chunks] == [1000] * 4 + [96]


def test_one_byte_over_the_limit_is_refused_and_says_why(site):
    """x__bounded__mutmut_2/4 (Content-Length not read), _13/_46/_49 (reason, message), and
    chunked reads of an unsized body (_51/_52: the count must add up across reads)."""
    policy = FetchPolicy(allow_private_addresses=True, max_bytes=LIMIT)
    sized = refusal_of(policy, site.base + "/over.bin")
    assert sized.reason == "too_large"
    assert f"Content-Length {LIMIT + 1} is over the limit of {LIMIT} bytes" in str(sized)
    for size in (None, 1000):
        unsized = refusal_of(policy, site.base + "/unsized/over.bin", size)
        assert unsized.reason == "too_large"
        assert f"/unsized/over.bin: body over the limit of {LIMIT} bytes" in str(unsized)


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


def test_the_opener_reads_local_files_only_when_the_file_scheme_is_allowed(tmp_path):
    """x_build_opener__mutmut_6..9: the FileHandler is there for the synthetic source only."""
    import urllib.error

    local = tmp_path / "a.jpg"
    local.write_bytes(b"local bytes")
    with pytest.raises(urllib.error.URLError, match="unknown url type: file"):
        build_opener(FetchPolicy()).open(local.as_uri())
    with build_opener(FetchPolicy(allowed_schemes=frozenset({"file"}))).open(local.as_uri()) as f:
        assert f.read() == b"local bytes"


def test_the_timeout_reaches_the_checked_socket(site):
    """x__checked_connection__mutmut_16/17 and xǁ_CheckedHTTPConnectionǁ__init____mutmut_2 (the
    timeout dropped: a stalled server would hold the download for as long as it likes). The
    stalled path answers after 60 s at most; the fetch must give up after 0.5 s."""
    import time

    policy = FetchPolicy(allow_private_addresses=True)
    started = time.monotonic()
    with pytest.raises(OSError, match="timed out"):
        build_opener(policy).open(site.base + "/stall/1.jpg", timeout=0.5).read()
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
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "clipms test site")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(hours=1))
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .add_extension(x509.SubjectAlternativeName([
                x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
            .sign(key, hashes.SHA256()))
    cert_file, key_file = folder / "site.pem", folder / "site.key"
    cert_file.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_file.write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                           serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return str(cert_file), str(key_file)


@pytest.fixture(scope="module")
def tls_site(tmp_path_factory):
    """The `site` files over HTTPS on 127.0.0.1 (its certificate: `tls_site.ca`)."""
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


def test_redirect_http_to_https_is_an_upgrade_not_a_scheme_change(site):
    """xǁ_CheckedRedirectHandlerǁredirect_request__mutmut_9..13: http -> https is followed to the
    address check (0.0.0.0 is refused: private; it would only reach this machine anyway), _6: a
    same-scheme redirect to a scheme the policy does not allow, _16/_26: the messages."""
    first_hop_exempt = FetchPolicy(allowed_networks=("127.0.0.1/32",))
    upgrade = refusal_of(first_hop_exempt, site.base + "/to-https.jpg")
    assert upgrade.reason == "private_address"
    assert f"redirect to 'https://0.0.0.0:{site.base.rsplit(':', 1)[1]}/limit.bin'" in str(upgrade)
    only_https = FetchPolicy(allowed_schemes=frozenset({"https"}), allow_private_addresses=True)
    same = refusal_of(only_https, site.base + "/to-same.jpg")
    assert same.reason == "redirect_scheme"
    assert f"redirect from http: to '{site.base}/limit.bin'" in str(same)


# ---------------------------------------------------------------- the gate's decision

DIGEST = "a" * 32


def test_a_gain_of_exactly_the_margin_promotes():
    """registry.gate.x_decide__mutmut_107 (>= margin became > margin). 0.75 - 0.5 == 0.25 exactly
    in binary floating point (tests/test_registry.py's 0.55 - 0.50 is 0.05000000000000004)."""
    from registry.gate import CHAMPION, Candidate, decide

    d = decide(Candidate("2", 0.75, DIGEST), Candidate("1", 0.5, DIGEST), "i2t_R@5", 0.25)
    assert (d.alias, d.compared, d.margin, d.primary_metric) == (CHAMPION, True, 0.25, "i2t_R@5")
    assert d.reason == ("i2t_R@5 0.75 beats champion v1's 0.5 (higher is better) by 0.25 >= "
                        "margin 0.25")
    worse = decide(Candidate("2", 12.0, DIGEST), Candidate("1", 10.0, DIGEST), "i2t_mean_rank",
                   0.0, direction="lower")
    assert worse.reason == ("i2t_mean_rank 12 does not beat champion v1's 10 (lower is better) "
                            "by more than 0 and at least margin 0 (gain -2)")


@pytest.mark.parametrize(("new", "champion", "unknown"), [
    (None, DIGEST, "this version"),
    (DIGEST, None, "champion v1"),
    (None, None, "this version and champion v1"),
])
def test_an_unknown_val_set_on_either_side_is_named_and_not_compared(new, champion, unknown):
    """x_decide__mutmut_46 (either -> both unknown: the 'different set' path), _55.._72 (which
    side the reason names), _8/_10 (the decision's fields)."""
    from registry.gate import CHALLENGER, Candidate, decide

    d = decide(Candidate("2", 0.9, new), Candidate("1", 0.1, champion), "i2t_R@5", 0.1)
    assert (d.alias, d.compared) == (CHALLENGER, False)
    assert d.reason == f"not compared: unknown evaluation set (no val digest on {unknown})"
    assert (d.primary_metric, d.margin, d.new_value, d.champion_value) == ("i2t_R@5", 0.1, 0.9,
                                                                            0.1)


def test_missing_values_are_recorded_as_not_compared_with_their_reason():
    """x_decide__mutmut_40/41/45 (no value on the new version), _84/_85/_89 (none on the
    champion), _77 (a different set), _35 (the first version's reason), _5 (direction)."""
    from registry.gate import CHALLENGER, CHAMPION, Candidate, decide

    champion = Candidate("1", 0.5, DIGEST)
    no_value = decide(Candidate("2", None, DIGEST), champion, "i2t_R@5", 0.0)
    assert (no_value.alias, no_value.compared, no_value.reason) == (
        CHALLENGER, False, "this version has no 'i2t_R@5' value")
    no_champion_value = decide(Candidate("2", 0.9, DIGEST), Candidate("1", None, DIGEST),
                               "i2t_R@5", 0.0)
    assert (no_champion_value.compared, no_champion_value.reason) == (
        False, "not compared: champion v1 has no 'i2t_R@5' value")
    other_set = decide(Candidate("2", 0.9, "b" * 32), champion, "i2t_R@5", 0.0)
    assert other_set.compared is False
    first = decide(Candidate("1", 0.9, DIGEST), None, "i2t_R@5", 0.0)
    assert (first.alias, first.reason) == (CHAMPION, "first version: there is no champion yet")
    with pytest.raises(ValueError, match="direction must be 'higher' or 'lower', got 'up'"):
        decide(Candidate("2", 0.9, DIGEST), champion, "i2t_R@5", 0.0, direction="up")


def test_the_recorded_description_names_alias_metric_value_and_reason():
    """describe/decided_alias (they replaced decision_tags, whose mutants 1/3 wrote a missing
    value wrongly): a missing value reads 'none', and the alias reads back from the text."""
    from registry.gate import CHALLENGER, Candidate, decide, decided_alias, describe

    d = decide(Candidate("2", None, DIGEST), Candidate("1", 0.5, DIGEST), "i2t_R@5", 0.0)
    text = describe(d)
    assert text == "challenger (i2t_R@5 none): this version has no 'i2t_R@5' value"
    assert decided_alias(text) == CHALLENGER
    assert decided_alias("champions are made") is None and decided_alias(None) is None


def test_primary_direction_lists_exactly_the_ranking_metrics_allowed():
    """x_primary_direction__mutmut_3/4 (what is allowed), _18/_23 (the message)."""
    from registry.gate import GateError, primary_direction

    metrics = {"i2t_R@5": 0.5, "i2t_mean_rank": 3.0, "num_images": 10, "chance_i2t_R@5": 0.1,
               "zeroshot_top1": True, "mAP@10": "0.4"}
    with pytest.raises(GateError) as err:
        primary_direction("num_images", metrics)
    assert str(err.value) == ("register.primary_metric 'num_images' does not rank models (a count "
                              "or a chance level); allowed: i2t_R@5 (higher is better), "
                              "i2t_mean_rank (lower is better)")
    with pytest.raises(GateError, match="'zeroshot_top1' is not in the evaluation metrics"):
        primary_direction("zeroshot_top1", {"i2t_R@5": 0.5})
    with pytest.raises(GateError, match="allowed: i2t_R@5"):  # a bool is not a metric value
        primary_direction("zeroshot_top1", metrics)


def test_candidate_from_version_reads_the_metric_and_digest_tags():
    """x_candidate_from_version__mutmut_* (no fast test read a version: the gate against a real
    MLflow server is slow). A real MLflow ModelVersion entity, no server."""
    from mlflow.entities.model_registry import ModelVersion, ModelVersionTag

    from registry.gate import Candidate, candidate_from_version

    def version(tags):
        return ModelVersion("clip", 7, 0, tags=[ModelVersionTag(k, v) for k, v in tags.items()])

    tagged = version({"metric.i2t_R_at_5": "0.25", "lineage.val_digest": DIGEST})
    assert candidate_from_version(tagged, "i2t_R@5") == Candidate("7", 0.25, DIGEST)
    assert candidate_from_version(version({"metric.i2t_R_at_5": "", "lineage.val_digest": ""}),
                                  "i2t_R@5") == Candidate("7", None, None)
    assert candidate_from_version(version({}), "i2t_R@5") == Candidate("7", None, None)


def test_a_version_without_the_metric_tag_is_read_from_its_logged_model(tmp_path, monkeypatch):
    """x_candidate_from_version__mutmut_12..21 (the fallback for a version registered while another
    metric was primary: no client, the wrong model, the wrong key, or the tag overwritten). A real
    MLflow SQLite store in tmp_path, the version registered as register_version registers it."""
    from mlflow import MlflowClient

    from registry.gate import Candidate, candidate_from_version
    from registry.registration import link_metrics

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)  # the registry resolves models:/ through it
    client = MlflowClient(tracking_uri=uri, registry_uri=uri)
    experiment = client.create_experiment("gate", artifact_location=(tmp_path / "art").as_uri())
    run_id = client.create_run(experiment).info.run_id
    model = client.create_logged_model(experiment, source_run_id=run_id, name="clip")
    link_metrics(client, run_id, model.model_id, {"i2t_R@5": 0.25, "t2i_R@5": 0.5})
    client.create_registered_model("clip")
    version = client.create_model_version(
        "clip", source=f"models:/{model.model_id}", run_id=run_id,
        tags={"lineage.val_digest": DIGEST, "metric.t2i_R_at_5": "0.75"})  # t2i was primary
    assert candidate_from_version(version, "i2t_R@5", client) == Candidate("1", 0.25, DIGEST)
    # the tag is the gate's input: the logged model's 0.5 does not replace it
    assert candidate_from_version(version, "t2i_R@5", client) == Candidate("1", 0.75, DIGEST)
    assert candidate_from_version(version, "i2t_R@5") == Candidate("1", None, DIGEST)
    assert candidate_from_version(version, "i2t_R@10", client) == Candidate("1", None, DIGEST)


# ---------------------------------------------------------------- params


def _params_models():
    from clipms.schema import Section

    class Leaf(Section):
        depth: int = 1
        width: int = 2

    class Middle(Section):
        leaf: Leaf = Leaf()
        name: str = "m"

    class Top(Section):
        middle: Middle = Middle()
        leaves: list[Leaf] = []
        rate: float = 0.5

    return Top


def test_unknown_keys_list_the_keys_of_the_model_that_holds_them(tmp_path):
    """pipeline.params.x__describe__mutmut_14 (the separator), _21 (which parent: three levels
    deep), x__allowed_keys__mutmut_13 (a list of models is not a model: no TypeError)."""
    from pipeline.params import ParamsError, load_section

    top, path = _params_models(), tmp_path / "params.yaml"
    path.write_text("top:\n  middle:\n    leaf:\n      dept: 3\n")
    with pytest.raises(ParamsError) as err:
        load_section("top", top, path)
    assert str(err.value) == (f"{path}: invalid 'top' params:\n  top.middle.leaf.dept: unknown "
                              "key (allowed keys here: depth, width)")
    path.write_text("top:\n  leaves:\n    - dept: 3\n")
    with pytest.raises(ParamsError, match=r"top\.leaves\.0\.dept: unknown key \(allowed keys "
                                          r"here: \)"):
        load_section("top", top, path)


def test_a_missing_section_is_all_defaults_and_a_non_mapping_is_named(tmp_path):
    """x_load_section__mutmut_5 (a missing section), _7 (its message), _11/_15/_16 (the file is
    the source the error names)."""
    from pipeline.params import ParamsError, load_section

    top, path = _params_models(), tmp_path / "params.yaml"
    path.write_text("other: {}\n")
    assert load_section("top", top, path) == top()
    path.write_text("top: [1, 2]\n")
    with pytest.raises(ParamsError) as err:
        load_section("top", top, path)
    assert str(err.value) == f"{path}: section 'top' must be a mapping, got [1, 2]"
    path.write_text("top:\n  rate: fast\n")
    with pytest.raises(ParamsError) as err:
        load_section("top", top, path)
    assert str(err.value).startswith(f"{path}: invalid 'top' params:\n  top.rate = 'fast': ")


def test_each_params_file_problem_has_its_own_message(tmp_path):
    """x_read_params__mutmut_7/9 (bad YAML, not a mapping), x__describe__mutmut_26/27 (a missing
    required key), x_validate_section__mutmut_1/2/13 (the default source, one line a problem)."""
    from clipms.schema import Section
    from pipeline.params import ParamsError, read_params, validate_section

    path = tmp_path / "params.yaml"
    path.write_text("top: [unclosed\n")
    with pytest.raises(ParamsError, match=f"^{path}: not valid YAML: "):
        read_params(path)
    path.write_text("- a\n- b\n")
    with pytest.raises(ParamsError) as err:
        read_params(path)
    assert str(err.value) == f"{path}: the top level must be a mapping of sections"

    class Needs(Section):
        size: int
        name: str

    with pytest.raises(ParamsError) as err:
        validate_section("needs", Needs, {"name": 3})
    assert str(err.value) == ("params: invalid 'needs' params:\n  needs.size: required but "
                              "missing\n  needs.name = 3: Input should be a valid string")


# ---------------------------------------------------------------- metrics: zero-shot edges


def test_zero_shot_chance_levels_at_one_and_five_classes():
    """clipms.eval.metrics.x_zeroshot_chance_levels__mutmut_1/2 (one class refused), _13/_14 (five
    classes lose top-5, which evaluate reports at five), _3 (the message)."""
    from clipms.eval.metrics import MetricsInputError, zeroshot_chance_levels

    assert zeroshot_chance_levels(1) == {"zeroshot_top1": 1.0,
                                         "zeroshot_mean_per_class_recall": 1.0}
    assert zeroshot_chance_levels(5) == {"zeroshot_top1": 0.2, "zeroshot_top5": 1.0,
                                         "zeroshot_mean_per_class_recall": 0.2}
    assert "zeroshot_top5" not in zeroshot_chance_levels(4)
    with pytest.raises(MetricsInputError, match=r"^num_classes: expected >= 1, got 0$"):
        zeroshot_chance_levels(0)


def test_class_embeddings_take_one_template_and_name_the_bad_input():
    """x_class_embeddings__mutmut_9 (a single template or class refused: one template is the
    common case), _12/_17/_19/_27/_28/_30/_32/_35/_36 (which input an error names)."""
    import numpy as np

    from clipms.eval.metrics import MetricsInputError, class_embeddings

    single = class_embeddings(np.array([[[3.0, 4.0]], [[0.0, 2.0]]]))
    np.testing.assert_allclose(single, [[0.6, 0.8], [0.0, 1.0]], atol=1e-7)
    np.testing.assert_allclose(class_embeddings(np.array([[[1.0, 0.0], [0.0, 1.0]]])),
                               [[np.sqrt(0.5), np.sqrt(0.5)]], atol=1e-7)
    with pytest.raises(MetricsInputError) as err:
        class_embeddings(np.ones((2, 0, 3)))
    assert str(err.value) == ("template_features: expected a non-empty (classes, templates, dim) "
                              "array, got (2, 0, 3)")
    with pytest.raises(MetricsInputError, match=r"^template_features: rows \[1\] have zero"):
        class_embeddings(np.array([[[1.0, 0.0], [0.0, 0.0]]]))
    with pytest.raises(MetricsInputError, match=r"^class embeddings \(mean of templates\): rows "
                                                r"\[0\] have zero norm"):
        class_embeddings(np.array([[[1.0, 0.0], [-1.0, 0.0]]]))  # opposite templates cancel


def test_confusion_matrix_counts_are_integers_and_errors_name_their_input():
    """x_confusion_matrix__mutmut_33/35 (float counts), _5/_6/_12.._15/_20/_21/_27.._30 (which
    vector an error names, and of what)."""
    import numpy as np

    from clipms.eval.metrics import MetricsInputError, confusion_matrix

    matrix = confusion_matrix(np.array([0, 1, 1]), np.array([1, 1, 0]), 2)
    assert matrix.dtype == np.int64 and matrix.tolist() == [[0, 1], [1, 1]]
    with pytest.raises(MetricsInputError) as err:
        confusion_matrix(np.array([0, 2]), np.array([0, 0]), 2)
    assert str(err.value) == "labels: entries [1] are outside [0, 2) (the number of classes)"
    with pytest.raises(MetricsInputError) as err:
        confusion_matrix(np.array([0, 1]), np.array([3, 0]), 2)
    assert str(err.value) == "predictions: entries [0] are outside [0, 2) (the number of classes)"


def test_zero_shot_at_five_classes_has_top5_and_errors_name_their_input():
    """x_zeroshot_metrics__mutmut_34/35 (five classes: no top-5), _11.._21 (the labels' error),
    x_zeroshot_scores__mutmut_18..20 (a dimension mismatch: its message, not an IndexError)."""
    import numpy as np

    from clipms.eval.metrics import MetricsInputError, zeroshot_metrics

    classes = np.eye(5, dtype=np.float32)
    images = np.array([[1, 2, 3, 4, 5], [5, 4, 3, 2, 1]], dtype=np.float32)  # class 0: 5th, 1st
    assert zeroshot_metrics(images, classes, np.array([0, 0])) == {
        "zeroshot_top1": 0.5, "zeroshot_top5": 1.0, "zeroshot_mean_per_class_recall": 0.5}
    with pytest.raises(MetricsInputError) as err:
        zeroshot_metrics(images, classes, np.array([0, 5]))
    assert str(err.value) == "labels: entries [1] are outside [0, 5) (the number of classes)"
    with pytest.raises(MetricsInputError) as err:
        zeroshot_metrics(images, np.eye(3, 4, dtype=np.float32), np.array([0, 0]))
    assert str(err.value) == "image_features dim 5 != class_features dim 4"


def test_retrieval_chance_levels_of_one_image_and_bad_counts():
    """x_retrieval_chance_levels__mutmut_10 (one image refused), _8 (an empty list or a zero
    count let through: NaN metrics), _13.._15 (the message)."""
    from clipms.eval.metrics import MetricsInputError, retrieval_chance_levels

    assert retrieval_chance_levels([3], ks=(1,)) == {"i2t_R@1": 1.0, "t2i_R@1": 1.0,
                                                      "mAP@10": 1.0}
    for bad in ([], [2, 0]):
        with pytest.raises(MetricsInputError) as err:
            retrieval_chance_levels(bad, ks=(1,))
        assert str(err.value) == "captions_per_image: expected a non-empty list of counts >= 1"


def test_retrieval_refuses_non_positive_ks_and_names_each_bad_input():
    """x__check_ks__mutmut_4/9 (ks of 0 let through: an R@0 of 0), x_retrieval_metrics__mutmut_
    28/38/39 (the caption index error names images), _53 (a bad chunk's message),
    x_l2_normalize__mutmut_1/2/10 (the default name, the shape message)."""
    import numpy as np

    from clipms.eval.metrics import MetricsInputError, l2_normalize, retrieval_metrics

    images, texts = np.eye(2, dtype=np.float32), np.eye(2, dtype=np.float32)
    for ks in ((), (1, 0)):
        with pytest.raises(MetricsInputError) as err:
            retrieval_metrics(images, texts, np.array([0, 1]), ks=ks)
        assert str(err.value) == f"ks: expected positive integers, got {ks}"
    with pytest.raises(MetricsInputError) as err:
        retrieval_metrics(images, texts, np.array([0, 2]))
    assert str(err.value) == "text_to_image: entries [1] are outside [0, 2) (the number of images)"
    with pytest.raises(MetricsInputError) as err:
        retrieval_metrics(images, texts, np.array([0, 1]), chunk=0)
    assert str(err.value) == "chunk: expected a positive integer, got 0"
    with pytest.raises(MetricsInputError) as err:
        l2_normalize(np.ones(3))
    assert str(err.value) == "features: expected a 2-D array (rows, dim), got shape (3,)"


def test_l2_normalize_returns_float32_and_takes_one_dimension():
    """x_l2_normalize__mutmut_5/7 (float64 in, float64 out: the documented float32 lost), _17 (a
    one-dimensional embedding refused as empty)."""
    import numpy as np

    from clipms.eval.metrics import l2_normalize

    unit = l2_normalize(np.array([[3.0, 4.0]], dtype=np.float64))
    assert unit.dtype == np.float32 and unit.tolist() == [[0.6000000238418579, 0.800000011920929]]
    assert l2_normalize(np.array([[2.0], [-3.0]])).tolist() == [[1.0], [-1.0]]


def test_chance_map_of_one_image_with_two_captions_is_one():
    """x_retrieval_chance_levels__mutmut_72 (max(M - 1, 2): wrong whenever M = 2): two captions,
    both relevant, so every random order has AP 1."""
    from clipms.eval.metrics import retrieval_chance_levels

    assert retrieval_chance_levels([2], ks=(1,))["mAP@10"] == 1.0


def test_build_prompts_names_what_is_empty():
    """x_build_prompts__mutmut_3/6/7/8 (the messages of an empty class or template list)."""
    from clipms.eval.metrics import MetricsInputError, build_prompts

    with pytest.raises(MetricsInputError) as err:
        build_prompts([], ["a {}"])
    assert str(err.value) == "class_names: empty; zero-shot needs at least one class"
    with pytest.raises(MetricsInputError) as err:
        build_prompts(["cat"], [])
    assert str(err.value) == "templates: empty; zero-shot needs at least one prompt template"


# ---------------------------------------------------------------- export: the parity decision


def test_parity_errors_are_the_max_raw_and_max_normalised_differences():
    """clipms.deploy.export.x__errors__mutmut_* : which difference, which norm (per row, with the
    floor that keeps an all-zero row finite). Row 2's norm is under 1: a floor of 1 would change
    it."""
    import numpy as np

    from clipms.deploy.export import _errors

    got = np.array([[0.6, 0.8], [0.0, 0.0], [0.03, 0.04]], np.float32)
    want = np.array([[0.0, 2.0], [0.0, 0.0], [0.04, -0.03]], np.float32)
    errors = _errors(got, want)
    assert list(errors) == ["max_abs_error", "max_abs_error_normalized"]
    assert errors["max_abs_error"] == pytest.approx(1.2, rel=1e-6)  # row 0: |0.8 - 2.0|
    assert errors["max_abs_error_normalized"] == pytest.approx(1.4, rel=1e-6)  # row 2: |0.8+0.6|


def test_parity_failures_name_each_tower_and_batch_size_over_the_tolerance():
    """x_assert_parity__mutmut_* : only the gate metric's per-batch keys count (not the other
    metric, not the max over batches), an error equal to the tolerance passes, the message."""
    from clipms.deploy.export import ParityError, assert_parity

    report = {"precision": "fp16", "gate_metric": "max_abs_error_normalized", "tolerance": 2e-3,
              "batch_sizes": [1, 4], "image_max_abs_error_normalized_b1": 2e-3,
              "image_max_abs_error_normalized_b4": 0.0125, "image_max_abs_error_b1": 0.5,
              "image_max_abs_error_normalized": 0.0125, "text_max_abs_error_normalized_b1": 1e-3,
              "text_max_abs_error_normalized_b4": 0.25, "passed": False}
    with pytest.raises(ParityError) as err:
        assert_parity(report)
    assert str(err.value) == (
        "exported fp16 MindIR differs from the checkpoint beyond tolerance 0.002: "
        "image_max_abs_error_normalized_b4 = 0.0125, text_max_abs_error_normalized_b4 = 0.25")
    assert_parity({**report, "image_max_abs_error_normalized_b4": 2e-3,
                   "text_max_abs_error_normalized_b4": 0.0})  # at the tolerance: passes


def test_parity_inputs_are_cycled_up_to_the_batch_size():
    """x__cycle_rows__mutmut_1..3."""
    import numpy as np

    from clipms.deploy.export import _cycle_rows

    rows = np.arange(6).reshape(3, 2)
    assert _cycle_rows(rows, 5).tolist() == [[0, 1], [2, 3], [4, 5], [0, 1], [2, 3]]
    assert _cycle_rows(rows, 2).tolist() == [[0, 1], [2, 3]]


def _micro_clip(seed: int, embed_dim: int = 16):
    import mindspore as ms

    from clipms.model.clip import CLIP
    from clipms.model.config import CLIPConfig, TextConfig, VisionConfig

    ms.set_seed(seed)
    return CLIP(CLIPConfig(
        embed_dim=embed_dim,
        vision=VisionConfig(image_size=16, patch_size=8, width=32, layers=1, head_width=16),
        text=TextConfig(context_length=8, vocab_size=40, width=32, heads=2, layers=1)))


@pytest.fixture(scope="module")
def micro_bundle(tmp_path_factory):
    """A real MindIR bundle of a micro CLIP (seed 0), and inputs for its parity check."""
    import numpy as np

    import clipms  # noqa: F401  (MindSpore's environment first)
    from clipms.data.preprocess import PreprocessConfig
    from clipms.deploy.export import export_bundle

    root = tmp_path_factory.mktemp("micro-export")
    (root / "tokenizer.json").write_text("{}")  # copied into the bundle, not read
    export_bundle(_micro_clip(0), PreprocessConfig(image_size=16), root / "tokenizer.json",
                  root / "bundle")
    rng = np.random.default_rng(0)
    return (root / "bundle", rng.normal(size=(2, 3, 16, 16)).astype(np.float32),
            rng.integers(1, 40, size=(2, 8)).astype(np.int32))


def test_parity_report_passes_its_own_checkpoint_and_fails_another(micro_bundle):
    """x_parity_report__mutmut_* : the report's keys and values (per tower, per batch size, the
    max over batch sizes), the bar of each precision, `passed` over both towers (all, <=), the
    empty-input (its whole message: x_parity_report__mutmut_11) and wrong-shape errors. Same
    weights and kernels: the fp32 errors are 0.0."""
    from clipms.deploy.export import ParityError, parity_report

    bundle, images, tokens = micro_bundle
    empty = "parity check needs at least one image and one caption"
    same = parity_report(_micro_clip(0), bundle, images, tokens, (1, 3), tolerance=0.0)
    metrics = ("max_abs_error", "max_abs_error_normalized")
    assert list(same) == ["precision", "gate_metric", "tolerance", "batch_sizes", *(
        f"{tower}_{m}{b}" for tower in ("image", "text")
        for b in ("_b1", "_b3", "") for m in metrics), "passed"]
    assert (same["precision"], same["gate_metric"], same["tolerance"], same["batch_sizes"],
            same["passed"]) == ("fp32", "max_abs_error", 0.0, [1, 3], True)
    assert {v for k, v in same.items() if k.endswith(metrics + ("_b1", "_b3"))} == {0.0}

    other = parity_report(_micro_clip(1), bundle, images, tokens, (1, 3))
    assert (other["tolerance"], other["passed"]) == (1e-5, False)
    for tower in ("image", "text"):
        for m in metrics:
            b1, b3 = other[f"{tower}_{m}_b1"], other[f"{tower}_{m}_b3"]
            # batch 3 adds the second row; its first row may round differently (fp32) than batch 1
            assert 0.1 < b1 <= b3 + 1e-5 and other[f"{tower}_{m}"] == max(b1, b3)
    # the max over batch sizes: batch 3's second row is the worse one in at least one tower
    assert max(other[f"{t}_max_abs_error_b3"] - other[f"{t}_max_abs_error_b1"]
               for t in ("image", "text")) > 0.1
    raw = sorted((other["image_max_abs_error"], other["text_max_abs_error"]))
    between = parity_report(_micro_clip(1), bundle, images, tokens, (1, 3),
                            tolerance=sum(raw) / 2)
    assert between["passed"] is False  # one tower within, the other not: fails
    assert parity_report(_micro_clip(1), bundle, images, tokens, (3,),
                         tolerance=raw[1] * 1.01)["passed"] is True
    fp16 = parity_report(_micro_clip(1), bundle, images, tokens, (1, 3), precision="fp16")
    assert (fp16["gate_metric"], fp16["tolerance"]) == ("max_abs_error_normalized", 2e-3)
    # the fp16 bar is on the normalised errors (under 1 here; the raw ones are over 2)
    normalised = max(other["image_max_abs_error_normalized"],
                     other["text_max_abs_error_normalized"])
    assert parity_report(_micro_clip(1), bundle, images, tokens, (1, 3), precision="fp16",
                         tolerance=normalised * 1.01)["passed"] is True

    with pytest.raises(ValueError, match=f"^{empty}$"):
        parity_report(_micro_clip(0), bundle, images[:0], tokens, (1,))
    with pytest.raises(ValueError, match=f"^{empty}$"):
        parity_report(_micro_clip(0), bundle, images, tokens[:0], (1,))
    with pytest.raises(ParityError) as err:
        parity_report(_micro_clip(0, embed_dim=8), bundle, images, tokens, (1,))
    assert str(err.value) == ("image encoder: MindIR output float32(1, 16) != checkpoint output "
                              "float32(1, 8) at batch size 1")


# ---------------------------------------------------------------- loss


def test_contrastive_loss_left_at_rank_zero_is_the_single_process_loss():
    """clipms.train.loss.x_contrastive_loss__mutmut_1 (a default rank of 1): called as its docstring
    says, without `rank` and with the local features as the global ones, it is ClipLoss's loss."""
    import numpy as np

    import clipms  # noqa: F401  (MindSpore's environment first)

    # isort: split
    import mindspore as ms

    from clipms.train.loss import ClipLoss, contrastive_loss

    rng = np.random.default_rng(3)
    image, text = rng.normal(size=(2, 4, 8)).astype(np.float32)
    image, text = (ms.Tensor(x / np.linalg.norm(x, axis=1, keepdims=True)) for x in (image, text))
    scale = ms.Tensor(np.float32(10.0))
    assert float(contrastive_loss(image, text, image, text, scale).asnumpy()) == \
        pytest.approx(float(ClipLoss()(image, text, scale).asnumpy()), rel=1e-6)


def test_gather_without_communication_says_what_to_do():
    """clipms.train.loss.xǁClipLossǁ__init____mutmut_7/8/10/11: the whole message (test_loss matches
    only its middle)."""
    from clipms.train.loss import ClipLoss

    with pytest.raises(RuntimeError) as err:
        ClipLoss(gather=True)
    assert str(err.value) == ("ClipLoss(gather=True) needs mindspore.communication.init() first "
                              "(launch the script with msrun)")


# ---------------------------------------------------------------- checkpoint


def test_host_copies_are_this_instants_values():
    """clipms.train.checkpoint.x__host_copy__mutmut_1..6, x__as_tensor__mutmut_1: a Tensor's
    asnumpy() shares its memory (an in-place update, as an optimizer step makes, shows through it),
    and
    np.array(copy=False/None) of an array is the array: without the copies a checkpoint submitted
    before a step could hold the step's values."""
    import numpy as np

    import clipms  # noqa: F401  (MindSpore's environment first)

    # isort: split
    import mindspore as ms
    from mindspore import ops

    from clipms.train.checkpoint import _as_tensor, _host_copy

    param = ms.Parameter(ms.Tensor(np.zeros(3, np.float32)), name="w")
    host, tensor = _host_copy(param), _as_tensor(param)
    array = np.zeros(2, np.float32)
    array_copy, from_list = _host_copy(array), _host_copy([1.5, 2.5])
    ops.assign(param, ms.Tensor(np.ones(3, np.float32)))
    array[:] = 7
    assert host.tolist() == [0, 0, 0] and tensor.asnumpy().tolist() == [0, 0, 0]
    assert array_copy.tolist() == [0, 0] and array_copy.dtype == np.float32
    assert from_list.tolist() == [1.5, 2.5]


def test_the_writer_keeps_the_last_k_logs_each_write_and_can_be_waited_on_twice(
        tmp_path, caplog):
    """xǁCheckpointWriterǁ_write__mutmut_5/10 (keep dropped), 11-16 (the "saved" line),
    xǁCheckpointWriterǁwait__mutmut_2 (a second wait after the thread is gone),
    submit 14/18 (the thread's name), submit 20 (a daemon thread: the interpreter would not wait
    for a write in flight at exit)."""
    import numpy as np

    from clipms.train import checkpoint

    writer = checkpoint.CheckpointWriter(tmp_path, keep=2)
    with caplog.at_level("INFO", logger="clipms.train.checkpoint"):
        for step in (1, 2, 3):
            path = writer.submit(step, {"w": np.full(2, step, np.float32)}, {"step": step})
            assert path == checkpoint.checkpoint_path(tmp_path, step)
            assert writer._thread.name == f"clipms-checkpoint-{step}"
            assert not writer._thread.daemon
        writer.wait()
        writer.close()
    assert [p.name for p in checkpoint.list_checkpoints(tmp_path)] == [
        "step-00000002.ckpt", "step-00000003.ckpt"]
    assert [r.getMessage() for r in caplog.records if r.name == "clipms.train.checkpoint"] == [
        f"saved {checkpoint.checkpoint_path(tmp_path, s)}" for s in (1, 2, 3)]


def test_a_failed_background_write_is_raised_once_by_the_next_call(tmp_path):
    """xǁCheckpointWriterǁ_write__mutmut_17 (the error lost), wait__mutmut_4/5 (how it is
    raised, its message), submit__mutmut_6 (the path in it): the folder is a regular file, so the
    write fails (FileExistsError) on the writer's thread; `close` raises it, then it is gone."""
    import numpy as np

    from clipms.train import checkpoint

    folder = tmp_path / "not-a-folder"
    folder.write_text("a file")
    writer = checkpoint.CheckpointWriter(folder)
    writer.submit(4, {"w": np.zeros(2, np.float32)}, {"step": 4})
    with pytest.raises(checkpoint.CheckpointWriteError) as err:
        writer.close()
    assert str(err.value).startswith(f"writing {folder / 'step-00000004.ckpt'} failed: ")
    assert isinstance(err.value.__cause__, FileExistsError)
    writer.close()  # reported once


def test_the_writer_as_a_context_reports_its_error_unless_the_loop_failed(tmp_path, caplog):
    """xǁCheckpointWriterǁ__exit____mutmut_1..7: a clean exit raises the write's error; when the
    loop itself failed, the loop's error goes on and the write's is logged."""
    import numpy as np

    from clipms.train import checkpoint

    folder = tmp_path / "not-a-folder"
    folder.write_text("a file")
    tensors, meta = {"w": np.zeros(2, np.float32)}, {"step": 1}
    with pytest.raises(checkpoint.CheckpointWriteError), checkpoint.CheckpointWriter(folder) as w:
        w.submit(1, tensors, meta)
    with (caplog.at_level("ERROR", logger="clipms.train.checkpoint"),
          pytest.raises(KeyError, match="the loop"),
          checkpoint.CheckpointWriter(folder) as writer):
        writer.submit(1, tensors, meta)
        raise KeyError("the loop")
    (record,) = [r for r in caplog.records if r.name == "clipms.train.checkpoint"]
    assert record.getMessage().startswith(f"writing {folder / 'step-00000001.ckpt'} failed: ")
    with checkpoint.CheckpointWriter(tmp_path / "ok") as writer:  # a clean exit waits
        writer.submit(1, tensors, meta)
    assert checkpoint.load(checkpoint.checkpoint_path(tmp_path / "ok", 1)).meta == meta


def test_prune_keeps_at_least_one_and_load_names_a_foreign_checkpoint(tmp_path, caplog):
    """x_prune__mutmut_1..3 (keep=1 allowed, 0 refused with its message), x_load__mutmut_7/9/11
    (a MindSpore checkpoint without clipms' meta: a ValueError naming it; the path read back),
    x_load_latest__mutmut_5/6/10 (the warning about a skipped file)."""
    import numpy as np

    import clipms  # noqa: F401  (MindSpore's environment first)

    # isort: split
    import mindspore as ms

    from clipms.train import checkpoint

    for step in (1, 2):
        checkpoint.save(tmp_path, step, {"w": np.full(2, step, np.float32)}, {"step": step})
    checkpoint.prune(tmp_path, 1)
    assert [p.name for p in checkpoint.list_checkpoints(tmp_path)] == ["step-00000002.ckpt"]
    with pytest.raises(ValueError) as err:
        checkpoint.prune(tmp_path, 0)
    assert str(err.value) == "keep must be >= 1, got 0"
    kept = checkpoint.checkpoint_path(tmp_path, 2)
    assert checkpoint.load(kept).path == kept

    foreign = checkpoint.checkpoint_path(tmp_path, 3)
    ms.save_checkpoint([{"name": "w", "data": ms.Tensor(np.ones(2, np.float32))}], str(foreign))
    with pytest.raises(ValueError) as err:
        checkpoint.load(foreign)
    assert str(err.value) == f"{foreign}: not a clipms training checkpoint (no 'clipms_meta' entry)"
    with caplog.at_level("WARNING", logger="clipms.train.checkpoint"):
        assert checkpoint.load_latest(tmp_path).path == kept
    assert [r.getMessage() for r in caplog.records if r.name == "clipms.train.checkpoint"] == [
        f"skipping unreadable checkpoint {foreign}: {err.value}"]


def test_stale_sets_are_folders_with_the_prefix_and_removing_one_is_logged(tmp_path, caplog):
    """x_stale_sets__mutmut_5 (`and` -> `or`: any folder, or a file named stale-...),
    x_set_aside__mutmut_30..37 (the line that names a removed set)."""
    import numpy as np

    from clipms.train import checkpoint

    (tmp_path / "other").mkdir()
    (tmp_path / "stale-notes.txt").write_text("not a set")
    with caplog.at_level("INFO", logger="clipms.train.checkpoint"):
        for label in ("aaa", "bbb"):
            checkpoint.save(tmp_path, 1, {"w": np.zeros(2, np.float32)}, {"step": 1})
            checkpoint.set_aside(tmp_path, label, keep_sets=1)
    assert [p.name for p in checkpoint.stale_sets(tmp_path)] == ["stale-bbb"]
    assert (tmp_path / "other").is_dir() and (tmp_path / "stale-notes.txt").is_file()
    assert [r.getMessage() for r in caplog.records if r.name == "clipms.train.checkpoint"] == [
        f"removed {tmp_path / 'stale-aaa'} (only the newest 1 stale checkpoint sets are kept)"]


# ---------------------------------------------------------------- shards: an fsspec URL input


def test_shards_from_a_url_are_the_shards_of_the_same_local_folder(tmp_path):
    """clipms.prep.shards.x_build_shards__mutmut_3..46 and x_fetch_tars__mutmut_1..22 (the URL
    input: tests/test_download_remote.py runs it only inside the shard stage's process, where
    mutmut cannot see it): the recorded tars are checked, copied into a hidden temporary folder
    beside the output (made with its parents; gone after) and give the bytes a local input gives;
    the copy line names the URL and its time; a tar that differs from the record, or one that
    cannot be copied, is a ShardError that says so."""
    import re

    from clipms.prep.shards import ShardError, ShardSettings, build_shards, fetch_tars
    from tests.test_shard import good, write_tar

    src = tmp_path / "store"
    src.mkdir()
    write_tar(src / "00000.tar", [good(i) for i in range(5)])
    write_tar(src / "00001.tar", [good(i, "val") for i in range(5, 8)])
    recorded = [{"name": p.name, "bytes": p.stat().st_size} for p in sorted(src.glob("*.tar"))]
    settings = ShardSettings(samples_per_shard=2, workers=1)
    local = build_shards(src, tmp_path / "local", settings, lambda _: None)
    url, out = f"file://{src}", tmp_path / "new" / "deeper" / "shards"
    lines: list[str] = []

    def print_fn(line: str) -> None:  # what is beside the output while the tars are in use
        lines.append(line)
        lines.append(" ".join(sorted(p.name[:13] for p in out.parent.iterdir())))

    for _ in range(2):  # the second time the output's parent exists
        lines.clear()
        assert build_shards(url, out, settings, print_fn, recorded) == local
        assert (out / "manifest.json").read_bytes() == \
            (tmp_path / "local/manifest.json").read_bytes()
        assert [p.name for p in out.parent.iterdir()] == ["shards"]
    copied = re.fullmatch(rf"shard: copied 2 tar\(s\) from {re.escape(url)} \((\d+\.\d) s\)",
                          lines[0])
    assert copied and float(copied.group(1)) < 60, lines[0]
    assert lines[1] in (".shard-input-", ".shard-input- shards")

    with pytest.raises(ShardError) as err:
        build_shards(url, out, settings, print_fn, [{**recorded[0], "bytes": 1}, recorded[1]])
    assert str(err.value) == (f"the tars at {url} are not the ones the download stage recorded "
                              "(size changed: 00000.tar); rerun the download stage")
    with pytest.raises(ShardError, match=r"\(not recorded: 00000\.tar, 00001\.tar\)"):
        build_shards(url, out, settings, print_fn)

    folder = tmp_path / "copies"
    folder.mkdir()
    sources = [str(src / "00001.tar"), str(src / "00000.tar")]
    assert fetch_tars(url, sources, folder) == [folder / "00001.tar", folder / "00000.tar"]
    assert (folder / "00000.tar").read_bytes() == (src / "00000.tar").read_bytes()
    assert fetch_tars(url, [], folder) == []
    with pytest.raises(ShardError) as err:
        fetch_tars(url, [str(src / "gone.tar")], folder)
    assert str(err.value).startswith(f"copying the tars from {url}: ") and "gone.tar" in \
        str(err.value)
