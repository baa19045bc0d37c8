"""The Remote Asset request and origin rules on their own: SRI parsing, qualifiers, credentials
per URI, what counts as a private address, which URLs are refused before any connection."""

from __future__ import annotations

import base64
import hashlib

import pytest
from yarl import URL

from buildvault.assets.errors import InvalidAssetRequest
from buildvault.assets.origin import OriginRules, Refused, is_private_address
from buildvault.assets.request import parse_request, parse_sri, public_uri, uri_host


def b64(data: bytes, algorithm: str) -> str:
    return base64.b64encode(hashlib.new(algorithm, data).digest()).decode()


def test_sri_takes_several_values_and_algorithms_and_ignores_options() -> None:
    text = f"sha256-{b64(b'a', 'sha256')}  sha384-{b64(b'a', 'sha384')}?opt sha512-{b64(b'a', 'sha512')}"
    found = parse_sri(text)
    assert [c.algorithm for c in found] == ["sha256", "sha384", "sha512"]
    assert found[0].hex == hashlib.sha256(b"a").hexdigest()


@pytest.mark.parametrize(
    "text", ["", "   ", "md5-abcd", "sha256", "sha256-", "sha256-@@@@", "sha256-" + b64(b"a", "sha512"), "sha1-x"]
)
def test_bad_sri_is_invalid(text: str) -> None:
    with pytest.raises(InvalidAssetRequest):
        parse_sri(text)


def test_credentials_go_to_the_uri_they_name_and_are_not_part_of_the_name() -> None:
    uris = ["https://a.example/x.tgz", "https://b.example/x.tgz"]
    request = parse_request(
        "",
        uris,
        [
            ("bazel.auth_headers", '{"https://a.example/x.tgz": {"Authorization": "Bearer t"}}'),
            ("http_header:X-All", "1"),
            ("http_header_url:1:X-B", "2"),
            ("bazel.canonical_id", "x-1.0"),
        ],
        0,
    )
    assert request.headers[0] == {"Authorization": "Bearer t", "X-All": "1"}
    assert request.headers[1] == {"X-All": "1", "X-B": "2"}
    assert request.named == (("bazel.canonical_id", "x-1.0"),)
    assert "Bearer" not in repr(request) and all("Bearer" not in v for _, v in request.qualifiers())


@pytest.mark.parametrize(
    "qualifiers",
    [
        [("unknown", "v")],
        [("http_header_url:5:X", "v")],
        [("http_header:Bad Name", "v")],
        [("http_header:X", "a\r\nInjected: yes")],
        [("bazel.auth_headers", "[1]")],
        [("bazel.canonical_id", "a"), ("bazel.canonical_id", "b")],
    ],
)
def test_bad_qualifiers_are_invalid(qualifiers: list[tuple[str, str]]) -> None:
    with pytest.raises(InvalidAssetRequest) as caught:
        parse_request("", ["https://a.example/x"], qualifiers, 0)
    assert caught.value.violations


@pytest.mark.parametrize(
    "address",
    ["127.0.0.1", "::1", "10.0.0.1", "172.16.3.4", "192.168.1.1", "169.254.169.254", "fe80::1", "224.0.0.1",
     "0.0.0.0", "::ffff:127.0.0.1", "100.64.0.1", "fc00::1", "not-an-address"],
)  # fmt: skip
def test_private_addresses(address: str) -> None:
    assert is_private_address(address)


@pytest.mark.parametrize("address", ["93.184.216.34", "2606:2800:220:1:248:1893:25c8:1946", "8.8.8.8"])
def test_public_addresses(address: str) -> None:
    assert not is_private_address(address)


def test_urls_refused_before_connecting() -> None:
    rules = OriginRules()
    for url in [
        "ftp://a.example/x",
        "http://127.0.0.1/x",
        "http://[::1]/x",
        "http://169.254.169.254/",
        "file:///etc/passwd",
    ]:
        with pytest.raises(Refused):
            rules.check(URL(url))
    rules.check(URL("https://example.org/x"))  # a name: its addresses are checked when it resolves
    allowed = OriginRules(allow_hosts=OriginRules.parse_hosts("127.0.0.1, Mirror.Internal."))
    allowed.check(URL("http://127.0.0.1:8080/x"))
    assert allowed.exempt("mirror.internal") and not allowed.exempt("localhost")
    with pytest.raises(Refused):
        OriginRules("allow-list", frozenset({"a.example"})).check(URL("https://b.example/x"))
    with pytest.raises(Refused):
        OriginRules("none").check(URL("https://a.example/x"))


def test_public_uri_drops_credentials_and_query() -> None:
    assert public_uri("https://user:pw@host.example:8443/a/b.tgz?token=s#f") == "https://host.example:8443/a/b.tgz"


def test_uri_host_names_the_host_alone() -> None:
    assert uri_host("https://user:secret@mirror.example:8443/dep.tgz?token=x") == "mirror.example:8443"
    assert uri_host("http://[::1]/a") == "[::1]"
    assert uri_host("urn:x:dep") == "?"
