"""A test OpenID Connect issuer on loopback: discovery document, JWKS, tokens minted by the test.

    with TestIssuer() as issuer:                 # aiohttp in its own thread, port 0
        issuer.url                               # "http://127.0.0.1:PORT" (the tokens' iss)
        token = issuer.mint(sub="repo:org/x:ref:refs/heads/main", repository="org/x", ...)
        issuer.rotate()                          # a new key becomes the only published one
        issuer.down = True                       # discovery and JWKS answer 503 (an outage)
        issuer.jwks_requests                     # how many times the JWKS was fetched

Keys are made with `cryptography` (RSA 2048, EC P-256, Ed25519) and published with PyJWT's
JWK export; tokens are signed with PyJWT. `github_claims` and `gitlab_claims` give the claims
those CI systems put in a job's token.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import hmac
import json
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any

import jwt
from aiohttp import web
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed25519, rsa
from jwt.algorithms import ECAlgorithm, OKPAlgorithm, RSAAlgorithm

AUDIENCE = "buildvault-test"
_ALGORITHM_OF = {"rsa": "RS256", "ec": "ES256", "ed25519": "EdDSA"}


@dataclass
class SigningKey:
    kid: str
    kind: str  # rsa, ec, ed25519
    private: Any

    @property
    def algorithm(self) -> str:
        return _ALGORITHM_OF[self.kind]

    def jwk(self) -> dict[str, Any]:
        public = self.private.public_key()
        exporter = {"rsa": RSAAlgorithm, "ec": ECAlgorithm, "ed25519": OKPAlgorithm}[self.kind]
        data = dict(exporter.to_jwk(public, as_dict=True))
        data.update(kid=self.kid, use="sig")
        if self.kind == "rsa":
            data["alg"] = "RS256"
        return data

    def public_pem(self) -> bytes:
        return self.private.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        )


def new_key(kind: str = "rsa", kid: str | None = None) -> SigningKey:
    if kind == "rsa":
        private: Any = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    elif kind == "ec":
        private = ec.generate_private_key(ec.SECP256R1())
    else:
        private = ed25519.Ed25519PrivateKey.generate()
    return SigningKey(kid or f"{kind}-{uuid.uuid4().hex[:12]}", kind, private)


def github_claims(repository: str = "org/vllm-ascend", ref: str = "refs/heads/main", event: str = "push") -> dict:
    run_id = str(int(time.time() * 1000) % 10**10)
    return {
        "sub": f"repo:{repository}:ref:{ref}",
        "repository": repository,
        "repository_owner": repository.split("/")[0],
        "ref": ref,
        "event_name": event,
        "workflow": "ci",
        "job_workflow_ref": f"{repository}/.github/workflows/ci.yml@{ref}",
        "run_id": run_id,
        "run_attempt": "1",
    }


def gitlab_claims(project: str = "org/vllm-ascend", ref: str = "main", protected: bool = True) -> dict:
    return {
        "sub": f"project_path:{project}:ref_type:branch:ref:{ref}",
        "project_path": project,
        "ref": ref,
        "ref_type": "branch",
        "ref_protected": "true" if protected else "false",
        "pipeline_source": "push",
        "pipeline_id": "4242",
        "job_id": "777",
    }


def b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def hand_signed_hs256(header: dict, payload: dict, secret: bytes) -> str:
    """A forgery no library would make: HS256 keyed with the issuer's public key bytes."""
    signing_input = b64(json.dumps(header).encode()) + "." + b64(json.dumps(payload).encode())
    signature = hmac.new(secret, signing_input.encode(), hashlib.sha256).digest()
    return signing_input + "." + b64(signature)


class TestIssuer:
    __test__ = False  # not a pytest class

    def __init__(self, kinds: tuple[str, ...] = ("rsa", "ec", "ed25519"), audience: str = AUDIENCE) -> None:
        self.keys = [new_key(kind) for kind in kinds]
        self.published: list[SigningKey] = list(self.keys)
        self.audience = audience
        self.down = False
        self.jwks_requests = 0
        self.discovery_requests = 0
        self.url = ""
        self._loop: asyncio.AbstractEventLoop | None = None
        self._runner: web.AppRunner | None = None
        self._thread: threading.Thread | None = None

    # -- serving ------------------------------------------------------------------------------
    async def _discovery(self, request: web.Request) -> web.Response:
        self.discovery_requests += 1
        if self.down:
            return web.Response(status=503)
        return web.json_response(
            {
                "issuer": self.url,
                "jwks_uri": self.url + "/keys",
                "id_token_signing_alg_values_supported": ["RS256", "ES256", "EdDSA"],
            }
        )

    async def _jwks(self, request: web.Request) -> web.Response:
        self.jwks_requests += 1
        if self.down:
            return web.Response(status=503)
        return web.json_response({"keys": [k.jwk() for k in self.published]})

    def __enter__(self) -> TestIssuer:
        ready = threading.Event()

        def run() -> None:
            loop = asyncio.new_event_loop()
            self._loop = loop
            app = web.Application()
            app.router.add_get("/.well-known/openid-configuration", self._discovery)
            app.router.add_get("/keys", self._jwks)
            runner = web.AppRunner(app, access_log=None)
            loop.run_until_complete(runner.setup())
            site = web.TCPSite(runner, "127.0.0.1", 0)
            loop.run_until_complete(site.start())
            port = runner.addresses[0][1]
            self.url = f"http://127.0.0.1:{port}"
            self._runner = runner
            ready.set()
            loop.run_forever()
            loop.run_until_complete(runner.cleanup())
            loop.close()

        self._thread = threading.Thread(target=run, name="test-oidc-issuer", daemon=True)
        self._thread.start()
        assert ready.wait(10), "the test issuer did not start"
        return self

    def __exit__(self, *exc: object) -> None:
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)
        if self._thread is not None:
            self._thread.join(10)

    # -- keys ---------------------------------------------------------------------------------
    def rotate(self, kind: str = "rsa") -> SigningKey:
        """A new key replaces every published one."""
        key = new_key(kind)
        self.keys.append(key)
        self.published = [key]
        return key

    def jwks(self) -> dict:
        return {"keys": [k.jwk() for k in self.published]}

    # -- tokens -------------------------------------------------------------------------------
    def claims(self, lifetime: int = 300, **extra: Any) -> dict[str, Any]:
        now = int(time.time())
        claims: dict[str, Any] = {"iss": self.url, "aud": self.audience, "iat": now, "nbf": now, "exp": now + lifetime}
        claims.update(github_claims())
        claims.update(extra)
        return {k: v for k, v in claims.items() if v is not None}

    def mint(self, key: SigningKey | None = None, headers: dict[str, Any] | None = None, **claims: Any) -> str:
        """A token signed by `key` (default: the first published one) with `claims` over the defaults."""
        key = key or self.published[0]
        return jwt.encode(
            self.claims(**claims), key.private, algorithm=key.algorithm, headers={"kid": key.kid, **(headers or {})}
        )
