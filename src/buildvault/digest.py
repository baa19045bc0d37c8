"""Digests, digest functions and ByteStream resource names: the one place these rules live,
with the check that content (bytes, an open file) is the blob a digest names.

A blob is named by (digest function, hash, size). The digest function is part of every
storage key, so a BLAKE3 blob and a SHA-256 blob whose hex happens to match never collide.
"""

from __future__ import annotations

import enum
import hashlib
import os
import re
import threading
import uuid as uuid_mod
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, TypeVar, cast

import blake3

if TYPE_CHECKING:
    # Types only: digest rules stay free of the generated modules at run time.
    from buildvault.remote_apis import re_pb2

_Message = TypeVar("_Message")


class InvalidDigest(ValueError):
    """A digest, digest function or resource name that does not follow the spec."""


class DigestFunction(enum.Enum):
    """Supported digest functions; `wire` is the REAPI DigestFunction.Value number."""

    SHA256 = ("sha256", 1)
    BLAKE3 = ("blake3", 9)

    def __init__(self, label: str, wire: int) -> None:
        self.label = label
        self.wire = wire

    @property
    def proto(self) -> re_pb2.DigestFunction.Value:
        """`wire` typed as the generated enum, for message fields: `Request(digest_function=fn.proto)`."""
        return cast("re_pb2.DigestFunction.Value", self.wire)

    # Members are singletons: identity hashing is correct, and C-fast (Enum.__hash__ is Python).
    __hash__ = object.__hash__

    @classmethod
    def from_wire(cls, value: int, default: DigestFunction | None = None) -> DigestFunction:
        """Map a request's digest_function field; 0 (UNKNOWN) means "the default" (SHA-256)."""
        if value == 0:
            return default or cls.SHA256
        for function in cls:
            if function.wire == value:
                return function
        raise InvalidDigest(f"unsupported digest function {value}; this server supports SHA256 (1) and BLAKE3 (9)")

    @classmethod
    def from_label(cls, label: str) -> DigestFunction:
        for function in cls:
            if function.label == label:
                return function
        raise InvalidDigest(f"unsupported digest function {label!r}; this server supports sha256 and blake3")


class Hasher(Protocol):
    def update(self, data: bytes | bytearray | memoryview, /) -> object: ...
    def hexdigest(self) -> str: ...


HASH_HEX_LENGTH = 64  # both SHA-256 and BLAKE3 (default output) are 32 bytes
_HEX = re.compile(r"[0-9a-f]{64}")
# A resource name far longer than any real one is an attack or a bug, not a blob name.
MAX_RESOURCE_NAME_LENGTH = 4096
# Path segments the spec reserves; they can never be part of an instance name.
_RESERVED_SEGMENTS = frozenset(
    {"blobs", "uploads", "compressed-blobs", "actions", "actionResults", "operations", "capabilities"}
)
_INSTANCE_SEGMENT = re.compile(r"[A-Za-z0-9_.\-]+")
SUPPORTED_COMPRESSORS = frozenset({"zstd"})


_HEX_DIGITS = b"0123456789abcdef"


def is_hash(text: str) -> bool:
    """`text` is a well-formed hash: HASH_HEX_LENGTH lowercase hex digits."""
    return _HEX.fullmatch(text) is not None


def all_hashes(hashes: list[str]) -> bool:
    """Every item is a well-formed hash; one bytes.translate over all of them (FindMissingBlobs
    of 1,000 digests: far faster than a regex each)."""
    if any(len(h) != HASH_HEX_LENGTH for h in hashes):
        return False
    try:
        return not "".join(hashes).encode("ascii").translate(None, _HEX_DIGITS)
    except UnicodeEncodeError:
        return False


def new_hasher(function: DigestFunction) -> Hasher:
    if function is DigestFunction.BLAKE3:
        return blake3.blake3(max_threads=1)
    return hashlib.sha256()


def raw_hash(function: DigestFunction, data: bytes | memoryview) -> bytes:
    """The raw (not hex) hash of `data`: what a store key holds."""
    if function is DigestFunction.BLAKE3:
        return blake3.blake3(data, max_threads=1).digest()
    return hashlib.sha256(data).digest()


@dataclass(frozen=True, slots=True)
class Digest:
    """A content digest. `hash` is lowercase hex; the function is part of identity."""

    hash: str
    size_bytes: int
    function: DigestFunction = DigestFunction.SHA256

    @classmethod
    def parse(cls, hash: str, size_bytes: int, function: DigestFunction = DigestFunction.SHA256) -> Digest:
        """Validate and build a digest from untrusted input."""
        if not isinstance(hash, str) or not _HEX.fullmatch(hash):
            raise InvalidDigest(f"invalid {function.label} hash {hash!r}: want {HASH_HEX_LENGTH} lowercase hex digits")
        if not isinstance(size_bytes, int) or size_bytes < 0:
            raise InvalidDigest(f"invalid size {size_bytes!r} for blob {hash}: must be >= 0")
        return cls(hash, size_bytes, function)

    @classmethod
    def of(cls, data: bytes, function: DigestFunction = DigestFunction.SHA256) -> Digest:
        hasher = new_hasher(function)
        hasher.update(data)
        return cls(hasher.hexdigest(), len(data), function)

    @classmethod
    def from_proto(cls, message: object, function: DigestFunction = DigestFunction.SHA256) -> Digest:
        """From a REAPI Digest message (anything with .hash and .size_bytes)."""
        return cls.parse(message.hash, message.size_bytes, function)  # type: ignore[attr-defined]

    def to_proto(self, message_type: Callable[..., _Message]) -> _Message:
        """The REAPI Digest message: `digest.to_proto(re_pb2.Digest)` (the type is handed in, so
        this module needs no generated code at run time)."""
        return message_type(hash=self.hash, size_bytes=self.size_bytes)

    def __hash__(self) -> int:
        # The hex hash alone (str caches its hash): equal digests have equal hashes, and the
        # dataclass default would build a tuple and call the enum's hash per digest.
        return hash(self.hash)

    @property
    def key(self) -> str:
        """Storage key: unique across digest functions."""
        return f"{self.function.label}/{self.hash}"

    def __str__(self) -> str:
        return f"{self.function.label}:{self.hash}/{self.size_bytes}"


_FILE_READ = 1 << 20
_file_buffers = threading.local()  # one read buffer per hashing thread, not one per file


def file_matches(fd: int, digest: Digest) -> bool:
    """Whether the open file `fd`, from its offset to its end, is exactly the blob `digest` names,
    re-hashed with the digest function (start-up's check after a crash, `buildvault verify`)."""
    hasher = new_hasher(digest.function)
    if digest.size_bytes <= _FILE_READ:
        # One byte more than the size (a longer file shows in the length); asking for more would
        # allocate (and fault in) that much for every small blob.
        data = os.read(fd, digest.size_bytes + 1)
        if len(data) != digest.size_bytes:
            return False
        hasher.update(data)
        return hasher.hexdigest() == digest.hash
    buffer = getattr(_file_buffers, "buffer", None)
    if buffer is None:
        buffer = _file_buffers.buffer = bytearray(_FILE_READ)
    view = memoryview(buffer)
    size = 0
    while read := os.readv(fd, [buffer]):
        size += read
        if size > digest.size_bytes:
            return False
        hasher.update(view[:read])
    return size == digest.size_bytes and hasher.hexdigest() == digest.hash


def verify_instance_name(instance_name: str) -> str:
    """Instance names become storage namespaces: allow only plain path segments."""
    if instance_name == "":
        return instance_name
    if len(instance_name) > 256:
        raise InvalidDigest("instance name longer than 256 characters")
    for segment in instance_name.split("/"):
        if segment in ("", ".", "..") or segment in _RESERVED_SEGMENTS or not _INSTANCE_SEGMENT.fullmatch(segment):
            raise InvalidDigest(
                f"invalid instance name {instance_name!r}: segments must be non-empty [A-Za-z0-9_.-], "
                "not '.', '..' or a reserved word"
            )
    return instance_name


@dataclass(frozen=True, slots=True)
class ResourceName:
    """A parsed ByteStream resource name."""

    instance_name: str
    digest: Digest
    compressor: str | None = None  # None: identity; "zstd": compressed-blobs
    upload_id: str | None = None  # set for uploads/{uuid}/... names


def parse_read_resource(name: str) -> ResourceName:
    """`{instance}/blobs/{fn/}{hash}/{size}[/meta]` or `{instance}/compressed-blobs/zstd/...`."""
    return _parse_resource(name, upload=False)


def parse_write_resource(name: str) -> ResourceName:
    """`{instance}/uploads/{uuid}/blobs/...` or `.../uploads/{uuid}/compressed-blobs/zstd/...`."""
    return _parse_resource(name, upload=True)


def _parse_resource(name: str, upload: bool) -> ResourceName:
    if not name:
        raise InvalidDigest("empty resource name")
    if len(name) > MAX_RESOURCE_NAME_LENGTH:
        raise InvalidDigest(f"resource name longer than {MAX_RESOURCE_NAME_LENGTH} characters")
    if name.startswith("/"):
        raise InvalidDigest(f"resource name {name[:100]!r} must not start with '/'")
    parts = name.split("/")
    marker = "uploads" if upload else None
    index = _first_index(parts, {marker} if marker else {"blobs", "compressed-blobs"})
    if index is None:
        expected = "{instance}/uploads/{uuid}/blobs/{hash}/{size}" if upload else "{instance}/blobs/{hash}/{size}"
        raise InvalidDigest(f"resource name {name[:100]!r} does not match {expected}")
    instance_name = verify_instance_name("/".join(parts[:index]))
    rest = parts[index:]
    upload_id = None
    if upload:
        if len(rest) < 2:
            raise InvalidDigest(f"resource name {name[:100]!r} lacks an upload id")
        upload_id = rest[1]
        try:
            uuid_mod.UUID(upload_id)
        except ValueError:
            # Clients use UUIDs; any other token is still fine if it is one plain segment.
            if not _INSTANCE_SEGMENT.fullmatch(upload_id) or upload_id in (".", ".."):
                raise InvalidDigest(f"invalid upload id {upload_id[:64]!r}") from None
        rest = rest[2:]
        if not rest or rest[0] not in ("blobs", "compressed-blobs"):
            raise InvalidDigest(
                f"resource name {name[:100]!r}: expected blobs/ or compressed-blobs/ after the upload id"
            )
    compressor = None
    if rest[0] == "compressed-blobs":
        if len(rest) < 2:
            raise InvalidDigest(f"resource name {name[:100]!r} lacks a compressor")
        compressor = rest[1]
        if compressor not in SUPPORTED_COMPRESSORS:
            raise InvalidDigest(f"unsupported compressor {compressor[:32]!r}; this server supports zstd")
        rest = rest[2:]
    else:
        rest = rest[1:]
    # rest: [fn/]hash/size[/optional metadata...]
    function = DigestFunction.SHA256
    if rest and len(rest[0]) != HASH_HEX_LENGTH and not rest[0].isdigit():
        function = DigestFunction.from_label(rest[0])
        rest = rest[1:]
    if len(rest) < 2:
        raise InvalidDigest(f"resource name {name[:100]!r} lacks {{hash}}/{{size}}")
    hash_text, size_text = rest[0], rest[1]
    if not size_text.isdigit() or (len(size_text) > 1 and size_text.startswith("0")) or len(size_text) > 19:
        raise InvalidDigest(f"invalid size {size_text[:32]!r} in resource name")
    digest = Digest.parse(hash_text, int(size_text), function)
    return ResourceName(instance_name, digest, compressor, upload_id)


def _first_index(parts: list[str], markers: set[str]) -> int | None:
    for i, part in enumerate(parts):
        if part in markers:
            return i
    return None
