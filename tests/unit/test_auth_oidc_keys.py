"""server/auth/oidc.py on its own: JWKS parsing, the key cache's refresh rules (with an injected
clock, against the test issuer on loopback), and the verified-token memo."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "integration"))

from oidc_issuer import TestIssuer, new_key

from buildvault.server.auth.credentials import BadCredentials, CredentialsFileError
from buildvault.server.auth.oidc import (
    REFRESH_EVERY,
    REFRESH_LIMIT,
    RETRY_FIRST_LOAD,
    IssuerKeys,
    OidcVerifier,
    check_issuer_url,
    load_jwks_file,
    parse_jwks,
)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_parse_jwks_keeps_only_usable_signing_keys():
    from cryptography.hazmat.primitives.asymmetric import rsa
    from jwt.algorithms import RSAAlgorithm

    good = new_key("rsa", kid="good").jwk()
    ec = new_key("ec", kid="ec").jwk()
    small = dict(RSAAlgorithm.to_jwk(rsa.generate_private_key(65537, 1024).public_key(), as_dict=True), kid="small")
    private = dict(RSAAlgorithm.to_jwk(rsa.generate_private_key(65537, 2048), as_dict=True), kid="private")
    document = {
        "keys": [
            good, ec, small, private,
            {"kty": "oct", "kid": "hmac", "k": "c2VjcmV0"},
            dict(new_key("rsa").jwk(), use="enc", kid="enc"),
            {k: v for k, v in new_key("rsa").jwk().items() if k != "kid"},
            dict(new_key("rsa").jwk(), alg="HS256", kid="hs"),
            dict(good, kid="good"),  # a second key under the same kid: the first is used
            "not a key",
        ]
    }  # fmt: skip
    keys = parse_jwks(document, "test")
    assert sorted(keys) == ["ec", "good", "private"]
    assert keys["good"].fits("RS256") and keys["good"].algorithm == "RS256" and not keys["good"].fits("PS256")
    assert keys["private"].fits("PS256") and not keys["private"].fits("ES256")
    assert not hasattr(keys["private"].key, "private_numbers")  # only the public half is kept
    assert keys["ec"].fits("ES256") and not keys["ec"].fits("EdDSA")
    with pytest.raises(ValueError, match="no usable signing key"):
        parse_jwks({"keys": [{"kty": "oct", "kid": "x", "k": "c2VjcmV0"}]}, "test")
    with pytest.raises(ValueError, match="not a JWK set"):
        parse_jwks({"key": []}, "test")


def test_jwks_file_forms(tmp_path):
    path = tmp_path / "jwks.json"
    key = new_key("ed25519", kid="k1").jwk()
    path.write_text(json.dumps({"keys": [key]}))
    assert list(load_jwks_file(path, ("https://a",))["https://a"]) == ["k1"]
    with pytest.raises(CredentialsFileError, match="serves one issuer"):
        load_jwks_file(path, ("https://a", "https://b"))
    path.write_text(json.dumps({"https://a": {"keys": [key]}, "https://b": {"keys": [key]}}))
    assert set(load_jwks_file(path, ("https://a", "https://b"))) == {"https://a", "https://b"}
    with pytest.raises(CredentialsFileError, match="not an --oidc-issuer"):
        load_jwks_file(path, ("https://a",))
    path.write_text("{")
    with pytest.raises(CredentialsFileError, match="oidc_jwks_file"):
        load_jwks_file(path, ("https://a",))


def test_issuer_urls():
    assert check_issuer_url("https://token.actions.githubusercontent.com") is None
    assert check_issuer_url("http://127.0.0.1:8000/x") is None
    assert check_issuer_url("http://ci.example") is not None
    assert check_issuer_url("https://ci.example/?a=b") is not None
    assert check_issuer_url("ftp://ci.example") is not None


async def test_key_refreshes_follow_the_limits():
    clock = Clock()
    with TestIssuer(kinds=("rsa",)) as issuer:
        keys = IssuerKeys(issuer.url, clock=clock)
        first = issuer.published[0]
        assert await keys.key(first.kid) is not None and issuer.jwks_requests == 1  # the first load
        # Unknown kids: one refresh, then none for a minute, then one again.
        assert await keys.key("nope-1") is None and issuer.jwks_requests == 2
        assert await keys.key("nope-2") is None and issuer.jwks_requests == 2
        clock.now += REFRESH_LIMIT - 1
        assert await keys.key("nope-3") is None and issuer.jwks_requests == 2
        clock.now += 2
        rotated = issuer.rotate("ec")
        assert await keys.key(rotated.kid) is not None and issuer.jwks_requests == 3
        assert await keys.key(first.kid) is None  # the set the issuer publishes now
        # A set in use is refreshed in the background once it is an hour old.
        clock.now += REFRESH_EVERY + 1
        assert await keys.key(rotated.kid) is not None
        assert keys._background is not None
        await keys._background
        assert issuer.jwks_requests == 4
        # An outage keeps the known keys; a failed refresh lets nothing new in.
        issuer.down = True
        clock.now += REFRESH_LIMIT + 1
        assert await keys.key("nope-4") is None and keys.fetches == 5
        assert await keys.key(rotated.kid) is not None
        await keys.close()


async def test_a_first_load_that_fails_is_retried_every_ten_seconds():
    clock = Clock()
    with TestIssuer(kinds=("ec",)) as issuer:
        issuer.down = True
        keys = IssuerKeys(issuer.url, clock=clock)
        kid = issuer.published[0].kid
        assert await keys.key(kid) is None and keys.fetches == 1
        issuer.down = False
        assert await keys.key(kid) is None and keys.fetches == 1
        clock.now += RETRY_FIRST_LOAD
        assert await keys.key(kid) is not None and keys.fetches == 2


async def test_verified_tokens_are_remembered_until_they_expire_and_forgotten_with_their_key():
    issuer = TestIssuer(kinds=("rsa",))
    issuer.url = "https://ci.example"
    fixed = parse_jwks(issuer.jwks(), "test")
    now = [1_000_000.0]
    keys = IssuerKeys(issuer.url, fixed)
    verifier = OidcVerifier({issuer.url: keys}, issuer.audience, 3600, now=lambda: now[0])
    token = issuer.mint()
    identity = await verifier.verify(token)
    assert identity.principal == "oidc:ci.example:repo:org/vllm-ascend:ref:refs/heads/main"
    assert verifier.remembered(token) is identity
    now[0] = identity.expires + 1
    assert verifier.remembered(token) is None  # the memo answers only while the token lives
    now[0] = 1_000_000.0
    again = await verifier.verify(token)
    verifier._forget_issuer(issuer.url)
    assert again.revoked and verifier.remembered(token) is None
    with pytest.raises(BadCredentials) as caught:
        await verifier.verify(issuer.mint(lifetime=7200))
    assert caught.value.reason == "bad_token" and "more than the 3600 s" in str(caught.value)
