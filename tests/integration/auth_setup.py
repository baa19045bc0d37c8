"""What the access-control tests set up: certificates, htpasswd and token files, access files.

- `Pki(dir)`: a CA (RSA or EC) that issues server and client certificates as PEM files (the
  `cryptography` package); `expired=True` makes one that ended yesterday.
- `htpasswd(path, user, password, scheme)`: the real `htpasswd` tool (`-B` bcrypt, `-m` apr1).
- `new_token(path, principal)`: the real `buildvault token add`; the token is its last stdout line.
- `write_access(path, grants)`: a TOML access file.
- `bearer(token)`, `basic(user, password)`: the `authorization` values.
- `metric(http_address, name, labels, headers)`: one sample from /metrics.
"""

from __future__ import annotations

import base64
import datetime
import ipaddress
import shutil
import subprocess
import sys
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from prometheus_client.parser import text_string_to_metric_families

from buildvault.remote_apis import re_pb2


def _key(kind: str):  # type: ignore[no-untyped-def]
    if kind == "ec":
        return ec.generate_private_key(ec.SECP256R1())
    return rsa.generate_private_key(public_exponent=65537, key_size=2048)


def _pem_key(key) -> bytes:  # type: ignore[no-untyped-def]
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


@dataclass
class Issued:
    cert: Path
    key: Path

    @property
    def cert_pem(self) -> bytes:
        return self.cert.read_bytes()

    @property
    def key_pem(self) -> bytes:
        return self.key.read_bytes()


class Pki:
    """A test CA in `directory` (made on construction)."""

    def __init__(self, directory: Path, name: str = "test-ca", kind: str = "rsa") -> None:
        self.directory = directory
        directory.mkdir(parents=True, exist_ok=True)
        self.kind = kind
        self._key = _key(kind)
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
        now = datetime.datetime.now(datetime.UTC)
        self._cert = (
            x509.CertificateBuilder()
            .subject_name(subject)
            .issuer_name(subject)
            .public_key(self._key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(days=1))
            .not_valid_after(now + datetime.timedelta(days=30))
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .add_extension(x509.KeyUsage(True, False, False, False, False, True, True, False, False), critical=True)
            .sign(self._key, hashes.SHA256())
        )
        self.ca_cert = directory / f"{name}.pem"
        self.ca_cert.write_bytes(self._cert.public_bytes(serialization.Encoding.PEM))

    def issue(self, cn: str, *, server: bool = False, kind: str | None = None, expired: bool = False) -> Issued:
        key = _key(kind or self.kind)
        now = datetime.datetime.now(datetime.UTC)
        start, end = (
            (now - datetime.timedelta(days=10), now - datetime.timedelta(days=1))
            if expired
            else (
                now - datetime.timedelta(hours=1),
                now + datetime.timedelta(days=10),
            )
        )
        builder = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)]))
            .issuer_name(self._cert.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(start)
            .not_valid_after(end)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        )
        if server:
            builder = builder.add_extension(
                x509.SubjectAlternativeName(
                    [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
                ),
                critical=False,
            ).add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        else:
            builder = builder.add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
        cert = builder.sign(self._key, hashes.SHA256())
        stem = self.directory / f"{cn}-{x509.random_serial_number() % 100000}"
        issued = Issued(stem.with_suffix(".crt"), stem.with_suffix(".key"))
        issued.cert.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        issued.key.write_bytes(_pem_key(key))
        return issued


def htpasswd(path: Path, user: str, password: str, scheme: str = "bcrypt") -> None:
    """Add `user` with the real htpasswd tool (bcrypt: `-B`, as the docs tell users; apr1: `-m`)."""
    tool = shutil.which("htpasswd")
    assert tool, "htpasswd not installed: run scripts/install-system-deps.sh (apache2-utils)"
    flags = ["-B", "-C", "5"] if scheme == "bcrypt" else ["-m"]
    create = [] if path.exists() else ["-c"]
    subprocess.run([tool, *create, "-b", *flags, str(path), user, password], check=True, capture_output=True)


def new_token(path: Path, principal: str) -> str:
    """`buildvault token add PRINCIPAL --token-file PATH`; the token is the last line of stdout."""
    done = subprocess.run(
        [sys.executable, "-m", "buildvault.cli", "token", "add", principal, "--token-file", str(path)],
        check=True,
        capture_output=True,
        text=True,
    )
    return done.stdout.splitlines()[-1]


def write_access(path: Path, grants: list[tuple[str, list[str], list[str]]]) -> Path:
    lines = []
    for principal, permissions, instances in grants:
        lines += [
            "[[grant]]",
            f"principal = {principal!r}".replace("'", '"'),
            "permissions = [" + ", ".join(f'"{p}"' for p in permissions) + "]",
            "instances = [" + ", ".join(f'"{i}"' for i in instances) + "]",
            "",
        ]
    path.write_text("\n".join(lines))
    return path


def bearer(token: str) -> str:
    return f"Bearer {token}"


def basic(user: str, password: str) -> str:
    return "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()


def metric(  # type: ignore[no-untyped-def]
    http_address: str,
    name: str,
    labels: dict[str, str],
    headers: dict[str, str] | None = None,
    *,
    scheme: str = "http",
    context=None,
) -> float:
    """The value of one sample on /metrics (0 when absent)."""
    request = urllib.request.Request(f"{scheme}://{http_address}/metrics", headers=headers or {})
    with urllib.request.urlopen(request, timeout=10, context=context) as response:
        text = response.read().decode()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return float(sample.value)
    return 0.0


def action_result(stdout: bytes) -> tuple[re_pb2.Digest, re_pb2.ActionResult]:
    """An ActionResult that inlines its stdout (complete without any CAS blob) and a fresh action digest."""
    import hashlib
    import os

    action = os.urandom(16)
    digest = re_pb2.Digest(hash=hashlib.sha256(action).hexdigest(), size_bytes=len(action))
    return digest, re_pb2.ActionResult(exit_code=0, stdout_raw=stdout)


def status(http_address: str, authorization: str, *, scheme: str = "http", context=None) -> dict:  # type: ignore[no-untyped-def]
    """GET /status with credentials (the /status page follows the read rule)."""
    import json

    request = urllib.request.Request(f"{scheme}://{http_address}/status", headers={"Authorization": authorization})
    with urllib.request.urlopen(request, timeout=20, context=context) as response:
        return dict(json.load(response))


def trust_store(directory: Path, ca_pem: Path, password: str = "changeit") -> Path:
    """A PKCS12 trust store holding `ca_pem`, made with the JDK's keytool (what Bazel's JVM reads)."""
    tool = shutil.which("keytool")
    assert tool, "keytool not installed: run scripts/install-system-deps.sh (default-jdk-headless)"
    store = directory / "truststore.p12"
    subprocess.run(
        [tool, "-importcert", "-noprompt", "-storetype", "PKCS12", "-keystore", str(store),
         "-storepass", password, "-alias", "buildvault-test-ca", "-file", str(ca_pem)],
        check=True,
        capture_output=True,
    )  # fmt: skip
    return store
