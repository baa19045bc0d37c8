"""The auth rule engine on its own: parsing authorization values, files, grants, decisions."""

from __future__ import annotations

import asyncio
import base64
import hashlib

import bcrypt
import pytest
from passlib.hash import apr_md5_crypt

from buildvault.config import ConfigError, Settings
from buildvault.server.auth.credentials import (
    BadCredentials,
    Credentials,
    CredentialsFileError,
    add_token,
    load_htpasswd,
    load_tokens,
    parse_authorization,
)
from buildvault.server.auth.grants import Permission, load_access_file
from buildvault.server.auth.policy import Policy, Refusal


def basic(user: str, password: str) -> str:
    return "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()


@pytest.mark.parametrize(
    ("value", "reason"),
    [
        ("", "unknown_scheme"),
        ("Digest x", "unknown_scheme"),
        ("Bearer", "malformed"),
        ("Bearer a b", "malformed"),
        ("Basic !!!", "malformed"),
        ("Basic " + base64.b64encode(b"nocolon").decode(), "malformed"),
        ("Basic " + base64.b64encode(b":pw").decode(), "malformed"),
        ("Basic " + base64.b64encode(b"\xff\xfe:x").decode(), "malformed"),
        ("Bearer " + "a" * 5000, "malformed"),
        ("Bearer \x00", "malformed"),
        ("Bearer é", "malformed"),
    ],
)
def test_malformed_values_name_their_reason(value, reason):
    with pytest.raises(BadCredentials) as caught:
        parse_authorization(value)
    assert caught.value.reason == reason


def test_parse_basic_and_bearer():
    assert parse_authorization(basic("u", "p:w")).secret == "p:w"
    assert parse_authorization("bearer  tok").secret == "tok"


def test_htpasswd_accepts_bcrypt_and_apr1_refuses_others(tmp_path):
    good = tmp_path / "h"
    good.write_text(
        "# comment\n"
        f"a:{bcrypt.hashpw(b'pw-a', bcrypt.gensalt(4)).decode().replace('$2b$', '$2y$', 1)}\n"
        f"b:{apr_md5_crypt.hash('pw-b')}\n"
    )
    users = load_htpasswd(good)
    credentials = Credentials(users, [])
    assert asyncio.run(credentials.check(parse_authorization(basic("a", "pw-a")))) == "a"
    assert asyncio.run(credentials.check(parse_authorization(basic("b", "pw-b")))) == "b"
    with pytest.raises(BadCredentials):
        asyncio.run(credentials.check(parse_authorization(basic("a", "pw-b"))))
    for line in ("c:{SHA}abc=", "c:plaintext", "nohash", "c:$2y$05$short"):
        bad = tmp_path / "bad"
        bad.write_text(line + "\n")
        with pytest.raises(CredentialsFileError, match="line 1"):
            load_htpasswd(bad)


def test_tokens_file_and_token_add(tmp_path):
    path = tmp_path / "t"
    token = add_token("ci", path)
    assert load_tokens(path) == [("ci", hashlib.sha256(token.encode()).hexdigest())]
    credentials = Credentials({}, load_tokens(path))
    assert asyncio.run(credentials.check(parse_authorization(f"Bearer {token}"))) == "ci"
    for line in ("ci", "ci abc", "cert:x " + "0" * 64, "a b c"):
        path.write_text(line + "\n")
        with pytest.raises(CredentialsFileError):
            load_tokens(path)
    with pytest.raises(CredentialsFileError):
        add_token("cert:spoof", tmp_path / "u")


def test_access_file_grants_and_prefixes(tmp_path):
    path = tmp_path / "a.toml"
    path.write_text(
        '[[grant]]\nprincipal = "team-a"\npermissions = ["read", "write"]\ninstances = ["team-a/"]\n'
        '[[grant]]\nprincipal = "*"\npermissions = ["read"]\ninstances = ["public"]\n'
    )
    policy = Policy(enabled=True, grants=load_access_file(path))
    assert policy.allows("team-a", Permission.WRITE, "team-a")
    assert policy.allows("team-a", Permission.WRITE, "team-a/x/y")
    assert not policy.allows("team-a", Permission.WRITE, "team-ab")
    assert not policy.allows("team-a", Permission.EXECUTE, "team-a")
    assert policy.allows("someone", Permission.READ, "public/x")
    assert not policy.allows(None, Permission.READ, "public")
    assert policy.allows("someone", Permission.READ, None)  # some instance
    with pytest.raises(Refusal) as caught:
        policy.authorize("team-a", Permission.WRITE, "team-b")
    assert not caught.value.unauthenticated and "lacks write on instance 'team-b'" in str(caught.value)
    for text in (
        '[[grant]]\nprincipal = "x"\npermissions = ["fly"]\n',
        "[[grant]]\nprincipal = 1\n",
        "x = 1\n",
        "[[grant",
    ):
        path.write_text(text)
        with pytest.raises(CredentialsFileError, match="access file"):
            load_access_file(path)


def _token_caller(issuer: str, **claims):  # type: ignore[no-untyped-def]
    from buildvault.server.auth.grants import Caller
    from buildvault.server.auth.oidc import Identity

    identity = Identity(f"oidc:host:{claims.get('sub', 's')}", issuer, claims, expires=2e9)
    return Caller(identity.principal, identity)


def test_claim_grants_match_exactly_or_by_star_glob(tmp_path):
    path = tmp_path / "a.toml"
    path.write_text(
        '[[grant]]\nissuer = "https://ci"\npermissions = ["read", "write"]\ninstances = ["csrc"]\n'
        'claims = { repository = "org/r", ref = "refs/heads/*", ref_protected = "true" }\n'
        '[[grant]]\nissuer = "https://ci"\npermissions = ["read"]\nclaims = { groups = "dev?[x]*" }\n'
        '[[grant]]\nissuer = "https://ci"\npermissions = ["execute"]\nclaims = { admin = true, level = 3 }\n'
        '[[grant]]\nprincipal = "*"\npermissions = ["read"]\n'
    )
    grants = load_access_file(path)
    policy = Policy(enabled=True, grants=grants)
    main = _token_caller("https://ci", repository="org/r", ref="refs/heads/main", ref_protected="true")
    assert policy.allows(main, Permission.WRITE, "csrc") and not policy.allows(main, Permission.WRITE, "other")
    assert policy.allows(main, Permission.WRITE, "csrc")  # the memo of matched grants gives the same answer
    assert not policy.allows(main, Permission.READ, "other")  # "*" never names an OIDC token
    assert not policy.allows(
        _token_caller("https://ci", repository="org/r", ref="refs/heads/main"), Permission.READ, "csrc"
    )
    assert not policy.allows(
        _token_caller("https://other", repository="org/r", ref="refs/heads/main", ref_protected="true"),
        Permission.READ,
        "csrc",
    )
    assert not policy.allows(
        _token_caller("https://ci", repository="org/rx", ref="refs/heads/m", ref_protected="true"),
        Permission.READ,
        "csrc",
    )
    # Only `*` is special: `?` and `[x]` are literal; a list claim matches through any element.
    assert policy.allows(_token_caller("https://ci", groups=["ops", "dev?[x]-team"]), Permission.READ, "any")
    assert not policy.allows(_token_caller("https://ci", groups=["devA[x]"]), Permission.READ, "any")
    # Booleans and numbers match equal values of the same type only.
    assert policy.allows(_token_caller("https://ci", admin=True, level=3), Permission.EXECUTE, "x")
    assert not policy.allows(_token_caller("https://ci", admin="true", level=3), Permission.EXECUTE, "x")
    assert not policy.allows(_token_caller("https://ci", admin=True, level=3.5), Permission.EXECUTE, "x")
    assert policy.allows("someone", Permission.READ, "x")
    for text in (
        '[[grant]]\nissuer = "https://ci"\nprincipal = "x"\npermissions = ["read"]\n',
        '[[grant]]\npermissions = ["read"]\n',
        '[[grant]]\nprincipal = "x"\nclaims = { a = "b" }\npermissions = ["read"]\n',
        '[[grant]]\nissuer = "https://ci"\nclaims = { a = 1.5 }\npermissions = ["read"]\n',
        '[[grant]]\nissuer = "https://ci"\nclaims = "a"\npermissions = ["read"]\n',
    ):
        path.write_text(text)
        with pytest.raises(CredentialsFileError, match="grant 1"):
            load_access_file(path)


def test_no_access_file_means_authenticated_read_write_and_open_when_disabled():
    policy = Policy(enabled=True)
    assert policy.allows("anyone", Permission.WRITE, "x") and not policy.allows(None, Permission.READ, "x")
    assert Policy(enabled=True, allow_unauthenticated_reads=True).allows(None, Permission.READ, "x")
    assert Policy(enabled=False).allows(None, Permission.WRITE, "x")


@pytest.mark.parametrize(
    "kwargs",
    [
        {"tls_client_auth": "sometimes"},
        {"min_tls_version": "1.1"},
        {"tls_cert_file": "c.pem"},
        {"tls_client_auth": "require", "tls_cert_file": "c", "tls_key_file": "k"},
    ],
)
def test_tls_settings_are_checked(kwargs):
    with pytest.raises(ConfigError):
        Settings(**kwargs)
