"""TLS for both listeners, reloadable without a restart.

gRPC gets `grpc.dynamic_ssl_server_credentials`: grpcio asks `Tls.grpc_fetch` at every new
connection, which hands over the certificate configuration once after each reload. HTTP gets
one stdlib `ssl.SSLContext` whose certificate chain is replaced in place on reload (new
handshakes use it; open connections keep theirs).

Client certificates: `require` refuses a handshake without a valid certificate on gRPC.
grpcio can only require or ignore a client certificate, so `optional` on gRPC is refused at
start-up. On HTTP both `optional` and `require` ask for a certificate and verify one that is
sent; under `require` the HTTP middleware refuses every request without one except
`GET /healthz`, which answers a load balancer that holds no certificate.
"""

from __future__ import annotations

import ssl
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

__all__ = ["Tls", "TlsError", "TlsFiles"]


class TlsError(ValueError):
    """A certificate, key or CA file is missing, unreadable or does not fit; the message names the setting."""


@dataclass(frozen=True, slots=True)
class TlsFiles:
    """The PEM bytes of one load: read and checked together, so a reload takes all or nothing."""

    cert_chain: bytes
    private_key: bytes
    client_ca: bytes | None


def _read(setting: str, path: str) -> bytes:
    try:
        data = Path(path).read_bytes()
    except OSError as e:
        raise TlsError(f"{setting} {path}: {e.strerror or e}") from None
    if b"-----BEGIN" not in data:
        raise TlsError(f"{setting} {path}: not a PEM file")
    return data


def read_tls_files(cert_file: str, key_file: str, client_ca_file: str) -> TlsFiles:
    """Read and check the files (blocking: call it in a thread once the loop runs)."""
    cert = _read("tls_cert_file", cert_file)
    key = _read("tls_key_file", key_file)
    ca = _read("tls_client_ca_file", client_ca_file) if client_ca_file else None
    probe = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        probe.load_cert_chain(cert_file, key_file)
    except (ssl.SSLError, OSError) as e:
        raise TlsError(f"tls_cert_file {cert_file} / tls_key_file {key_file}: {e}") from None
    if ca is not None:
        try:
            probe.load_verify_locations(cadata=ca.decode("ascii", "replace"))
        except (ssl.SSLError, ValueError) as e:
            raise TlsError(f"tls_client_ca_file {client_ca_file}: {e}") from None
    return TlsFiles(cert, key, ca)


class Tls:
    """The server's TLS state: the current files and the contexts built from them."""

    def __init__(self, cert_file: str, key_file: str, client_ca_file: str, client_auth: str, min_version: str) -> None:
        self.cert_file, self.key_file, self.client_ca_file = cert_file, key_file, client_ca_file
        self.client_auth = client_auth
        self.min_version = min_version
        self.files = read_tls_files(cert_file, key_file, client_ca_file)
        self._lock = threading.Lock()
        self._fresh_for_grpc = False  # a reload grpcio has not picked up yet
        self._http: ssl.SSLContext | None = None

    @property
    def requires_client_certificate(self) -> bool:
        return self.client_auth == "require"

    # -- reload -----------------------------------------------------------------------------
    def read(self) -> TlsFiles:
        """Read the files again (blocking); TlsError keeps nothing."""
        return read_tls_files(self.cert_file, self.key_file, self.client_ca_file)

    def apply(self, files: TlsFiles) -> None:
        """Serve `files` from the next handshake on (call on the event loop thread)."""
        with self._lock:
            self.files = files
            self._fresh_for_grpc = True
        if self._http is not None:
            self._http.load_cert_chain(self.cert_file, self.key_file)
            if files.client_ca is not None:
                # Adds to the trusted set: a CA removed from the file stays trusted until a restart.
                self._http.load_verify_locations(cadata=files.client_ca.decode("ascii", "replace"))

    # -- gRPC -------------------------------------------------------------------------------
    def grpc_credentials(self) -> grpc.ServerCredentials:
        if self.client_auth == "optional":
            raise TlsError(
                "tls_client_auth optional: grpcio cannot ask for an optional client certificate; "
                "use require (or none) when the gRPC listener has TLS"
            )
        if self.min_version != "1.2":
            raise TlsError(
                f"min_tls_version {self.min_version}: grpcio's server credentials cannot set a minimum TLS "
                "version (gRPC accepts TLS 1.2 and 1.3); use 1.2 when the gRPC listener has TLS"
            )
        return grpc.dynamic_ssl_server_credentials(
            self._grpc_config(self.files),
            self.grpc_fetch,
            require_client_authentication=self.requires_client_certificate,
        )

    def _grpc_config(self, files: TlsFiles) -> Any:
        roots = files.client_ca if self.requires_client_certificate else None
        return grpc.ssl_server_certificate_configuration([(files.private_key, files.cert_chain)], roots)

    def grpc_fetch(self) -> Any:
        """grpcio's per-connection question (from its own threads): a new configuration, or None."""
        with self._lock:
            if not self._fresh_for_grpc:
                return None
            self._fresh_for_grpc = False
            files = self.files
        return self._grpc_config(files)

    # -- HTTP -------------------------------------------------------------------------------
    def http_context(self) -> ssl.SSLContext:
        """The one context of the HTTP listener (built on first use, then updated in place)."""
        if self._http is None:
            context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            context.minimum_version = ssl.TLSVersion.TLSv1_3 if self.min_version == "1.3" else ssl.TLSVersion.TLSv1_2
            context.load_cert_chain(self.cert_file, self.key_file)
            if self.client_auth != "none" and self.files.client_ca is not None:
                context.load_verify_locations(cadata=self.files.client_ca.decode("ascii", "replace"))
                context.verify_mode = ssl.CERT_OPTIONAL
            self._http = context
        return self._http


def common_name(peercert: Any) -> str | None:
    """The subject CN of a verified peer certificate as `ssl.SSLObject.getpeercert()` gives it."""
    if not peercert:
        return None
    for rdn in peercert.get("subject", ()):
        for key, value in rdn:
            if key == "commonName":
                return str(value)
    return None
