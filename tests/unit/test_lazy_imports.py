"""A server that trusts no OIDC issuer does not load PyJWT and cryptography (about 9 MiB of RSS);
one that does, loads them when its verifier is built."""

from __future__ import annotations

import subprocess
import sys

PROBE = """
import sys
from buildvault.config import Settings
from buildvault.server.app import App
from buildvault.server.auth.runtime import oidc_verifier
before = sorted(m for m in ("jwt", "cryptography") if m in sys.modules)
issuers = %r
oidc = dict(oidc_issuer=issuers, oidc_audience="buildvault", access_file="access.toml") if issuers else {}
oidc_verifier(Settings(**oidc), {})
after = sorted(m for m in ("jwt", "cryptography") if m in sys.modules)
print(before, after)
"""


def probe(issuers: tuple[str, ...]) -> str:
    done = subprocess.run([sys.executable, "-c", PROBE % (issuers,)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_no_issuer_loads_no_jwt_library() -> None:
    assert probe(()) == "[] []"


def test_an_issuer_loads_the_jwt_library_for_its_verifier() -> None:
    assert probe(("https://token.actions.githubusercontent.com",)) == "[] ['cryptography', 'jwt']"
