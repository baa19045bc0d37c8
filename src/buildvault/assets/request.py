"""A Fetch or Push request checked and taken apart: nothing malformed reaches the index or an origin.

The qualifiers this server knows (any other name is INVALID_ARGUMENT with a BadRequest violation
`qualifiers.name: "x" not supported`, as the Remote Asset spec asks):

- `checksum.sri`: Subresource Integrity, one or more whitespace-separated `sha256-`, `sha384-`,
  `sha512-` values (base64); for every algorithm given the content must match one of its values;
- `bazel.canonical_id`, `resource_type`: part of the asset's name (its index key);
- credentials, never part of the name and never logged: `bazel.auth_headers` (Bazel's JSON map of
  URL -> {header: value}), `http_header:NAME` (sent to every URI of the request) and
  `http_header_url:INDEX:NAME` (sent to the INDEXth URI only).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from buildvault.assets.errors import InvalidAssetRequest
from buildvault.digest import DigestFunction, InvalidDigest, verify_instance_name

__all__ = [
    "AssetRequest",
    "Checksum",
    "MAX_QUALIFIERS",
    "MAX_URIS",
    "parse_request",
    "parse_sri",
    "public_uri",
    "uri_host",
]

MAX_URIS = 64
MAX_QUALIFIERS = 64
MAX_URI_LENGTH = 8192
MAX_NAME_LENGTH = 256
MAX_VALUE_LENGTH = 16384
# name -> (hashlib name, digest length in bytes)
SRI_ALGORITHMS: dict[str, int] = {"sha256": 32, "sha384": 48, "sha512": 64}
SRI_QUALIFIER = "checksum.sri"
CANONICAL_ID = "bazel.canonical_id"
AUTH_HEADERS = "bazel.auth_headers"
RESOURCE_TYPE = "resource_type"
_NAMED = (CANONICAL_ID, RESOURCE_TYPE)  # qualifiers that are part of the asset's name
_HEADER_NAME = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
_URI_SCHEME = re.compile(r"[A-Za-z][A-Za-z0-9+.\-]*:")
# A header value may not carry a line break or other control characters (header injection).
_BAD_VALUE = re.compile(r"[\x00-\x08\x0a-\x1f\x7f]")


@dataclass(frozen=True)
class Checksum:
    """One SRI value: an algorithm and the raw digest bytes."""

    algorithm: str
    digest: bytes

    @property
    def sri(self) -> str:
        return f"{self.algorithm}-{base64.b64encode(self.digest).decode()}"

    @property
    def hex(self) -> str:
        return self.digest.hex()


@dataclass(frozen=True)
class AssetRequest:
    """A checked request. `named` are the (name, value) qualifiers that name the asset (sorted);
    `headers[i]` are the credentials for `uris[i]` only (never logged, never in a key)."""

    instance_name: str
    uris: tuple[str, ...]
    digest_function: DigestFunction
    checksums: tuple[Checksum, ...] = ()
    named: tuple[tuple[str, str], ...] = ()
    headers: tuple[dict[str, str], ...] = field(default=(), repr=False, compare=False)

    def qualifiers(self) -> list[tuple[str, str]]:
        """The qualifiers worth telling a client (and storing): the name's and the checksum's."""
        out = list(self.named)
        if self.checksums:
            out.append((SRI_QUALIFIER, " ".join(c.sri for c in self.checksums)))
        return out

    def dedup_key(self) -> tuple[object, ...]:
        """What makes two in-flight requests the same download (credentials included, by hash)."""
        creds = hashlib.sha256(json.dumps([sorted(h.items()) for h in self.headers]).encode()).hexdigest()
        return (self.instance_name, self.uris, self.digest_function, self.checksums, self.named, creds)


def uri_host(uri: str) -> str:
    """The host of a URI, for a log line (never its path, query or credentials); `?` when none."""
    authority = uri.partition("://")[2].split("/", 1)[0]
    return authority.rpartition("@")[2] or "?"


def public_uri(uri: str) -> str:
    """A URI as it may appear in a message: no user info, no query, no fragment."""
    scheme, sep, rest = uri.partition("://")
    if not sep:
        return uri.split("?", 1)[0][:200]
    authority, slash, path = rest.partition("/")
    host = authority.rpartition("@")[2]
    path = path.split("?", 1)[0].split("#", 1)[0]
    shown = f"{scheme}://{host}{slash}{path}"
    return shown if len(shown) <= 200 else shown[:197] + "..."


def parse_sri(text: str, field_name: str = "qualifiers.value") -> tuple[Checksum, ...]:
    """The values of an SRI string (`sha256-… sha512-…`); options after `?` are ignored."""
    values = text.split()
    if not values:
        raise InvalidAssetRequest([(field_name, f"{SRI_QUALIFIER} is empty")])
    out: list[Checksum] = []
    for value in values:
        algorithm, sep, encoded = value.partition("-")
        encoded = encoded.split("?", 1)[0]
        size = SRI_ALGORITHMS.get(algorithm)
        if not sep or size is None:
            raise InvalidAssetRequest(
                [(field_name, f"{SRI_QUALIFIER}: unsupported value {value[:80]!r} (sha256-, sha384- or sha512-)")]
            )
        try:
            digest = base64.b64decode(encoded, validate=True)
        except (binascii.Error, ValueError):
            raise InvalidAssetRequest([(field_name, f"{SRI_QUALIFIER}: {value[:80]!r} is not base64")]) from None
        if len(digest) != size:
            raise InvalidAssetRequest(
                [(field_name, f"{SRI_QUALIFIER}: a {algorithm} digest is {size} bytes, got {len(digest)}")]
            )
        checksum = Checksum(algorithm, digest)
        if checksum not in out:
            out.append(checksum)
    return tuple(out)


def _check_uri(index: int, uri: str, violations: list[tuple[str, str]]) -> None:
    where = f"uris[{index}]"
    if not uri:
        violations.append((where, "empty URI"))
    elif len(uri) > MAX_URI_LENGTH:
        violations.append((where, f"longer than {MAX_URI_LENGTH} characters"))
    elif any(ch.isspace() or ord(ch) < 0x20 or ord(ch) == 0x7F for ch in uri):
        violations.append((where, "a URI may not contain whitespace or control characters"))
    elif not _URI_SCHEME.match(uri):
        violations.append((where, "not an absolute URI (no scheme)"))


def _header(name: str, value: str, where: str, violations: list[tuple[str, str]]) -> tuple[str, str] | None:
    if not _HEADER_NAME.fullmatch(name):
        violations.append((where, f"{name[:80]!r} is not an HTTP header name"))
        return None
    if _BAD_VALUE.search(value):
        violations.append((where, f"the value of header {name!r} has a control character"))
        return None
    return name, value


def _auth_headers(
    value: str, uris: Sequence[str], headers: list[dict[str, str]], violations: list[tuple[str, str]]
) -> None:
    where = f"qualifiers[{AUTH_HEADERS}]"
    try:
        parsed = json.loads(value)
    except ValueError:
        violations.append((where, "not JSON"))
        return
    if not isinstance(parsed, dict):
        violations.append((where, "not a JSON object of URL -> {header: value}"))
        return
    for url, entries in parsed.items():
        if not isinstance(entries, dict):
            violations.append((where, "not a JSON object of URL -> {header: value}"))
            return
        for name, raw in entries.items():
            # Bazel 4 sends a string per header; later versions a list of strings.
            values = raw if isinstance(raw, list) else [raw]
            if not values or not all(isinstance(v, str) for v in values) or not isinstance(name, str):
                violations.append((where, "header values must be strings"))
                return
            checked = _header(name, ", ".join(values), where, violations)
            if checked is None:
                return
            for i, uri in enumerate(uris):
                if uri == url:  # sent only to the URL it names
                    headers[i][checked[0]] = checked[1]


def parse_request(
    instance_name: str,
    uris: Sequence[str],
    qualifiers: Iterable[tuple[str, str]],
    digest_function: int,
    *,
    require_uri: bool = True,
) -> AssetRequest:
    """Check a request's parts; InvalidAssetRequest lists every violation found."""
    violations: list[tuple[str, str]] = []
    try:
        instance = verify_instance_name(instance_name)
    except InvalidDigest as e:
        violations.append(("instance_name", str(e)))
        instance = ""
    try:
        function = DigestFunction.from_wire(digest_function)
    except InvalidDigest as e:
        violations.append(("digest_function", str(e)))
        function = DigestFunction.SHA256
    uris = list(uris)
    if require_uri and not uris:
        violations.append(("uris", "at least one URI is required"))
    if len(uris) > MAX_URIS:
        raise InvalidAssetRequest([("uris", f"at most {MAX_URIS} URIs, got {len(uris)}")])
    for i, uri in enumerate(uris):
        _check_uri(i, uri, violations)
    pairs = list(qualifiers)
    if len(pairs) > MAX_QUALIFIERS:
        raise InvalidAssetRequest([("qualifiers", f"at most {MAX_QUALIFIERS} qualifiers, got {len(pairs)}")])
    seen: set[str] = set()
    checksums: tuple[Checksum, ...] = ()
    named: list[tuple[str, str]] = []
    headers: list[dict[str, str]] = [{} for _ in uris]
    for name, value in pairs:
        if len(name) > MAX_NAME_LENGTH or len(value) > MAX_VALUE_LENGTH:
            violations.append(
                ("qualifiers", f"a qualifier name is at most {MAX_NAME_LENGTH} characters, a value {MAX_VALUE_LENGTH}")
            )
            continue
        if name in seen:
            violations.append(("qualifiers.name", f'"{name}" given twice (names must be unique)'))
            continue
        seen.add(name)
        if name == SRI_QUALIFIER:
            try:
                checksums = parse_sri(value)
            except InvalidAssetRequest as e:
                violations.extend(e.violations)
        elif name in _NAMED:
            if _BAD_VALUE.search(value):
                violations.append(("qualifiers.value", f'"{name}" has a control character'))
            else:
                named.append((name, value))
        elif name == AUTH_HEADERS:
            _auth_headers(value, uris, headers, violations)
        elif name.startswith("http_header:"):
            checked = _header(name[len("http_header:") :], value, "qualifiers.name", violations)
            if checked is not None:
                for h in headers:
                    h[checked[0]] = checked[1]
        elif name.startswith("http_header_url:"):
            index_text, _, header_name = name[len("http_header_url:") :].partition(":")
            if not index_text.isdigit() or int(index_text) >= len(uris):
                violations.append(("qualifiers.name", f'"{name[:80]}": no URI with that index'))
                continue
            checked = _header(header_name, value, "qualifiers.name", violations)
            if checked is not None:
                headers[int(index_text)][checked[0]] = checked[1]
        else:
            violations.append(("qualifiers.name", f'"{name[:80]}" not supported'))
    if violations:
        raise InvalidAssetRequest(violations)
    return AssetRequest(instance, tuple(uris), function, checksums, tuple(sorted(named)), tuple(headers))
