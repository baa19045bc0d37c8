"""The URL grammar of the bazel-remote HTTP protocol and ccache's HTTP storage layouts.

- `layout=bazel` (and Bazel itself): `/{instance…}/ac/{sha256}` and `/{instance…}/cas/{sha256}`.
- ccache `layout=subdirs`: `/{instance…}/{first 2 chars}/{the rest}`; `layout=flat`:
  `/{instance…}/{key}`, where the key is ccache's 20-byte key in its string form: 4 hex digits
  + 29 base32hex (33 characters) up to ccache 4.7, 40 lowercase hex digits from 4.8 on. Both
  map to the 64-hex key that `layout=bazel` uses for the same 20 bytes, so the three layouts
  (and both key spellings) share one set of action entries.

Anything else is an InvalidDigest naming what was wrong; no path escapes its instance.
"""

from __future__ import annotations

import base64
import re
from dataclasses import dataclass

from buildvault.digest import Digest, DigestFunction, InvalidDigest, is_hash, verify_instance_name

__all__ = ["CachePath", "ccache_key_to_hash", "parse_cache_path"]

_PATH_CHARS = re.compile(r"[A-Za-z0-9_.\-/]*")
_MAX_PATH = 1024
# ccache's 20-byte keys: up to 4.7 written as 4 hex digits + 29 base32hex digits (33 characters),
# from 4.8 on as 40 lowercase hex digits. The lengths (33/31 against 40/38) tell them apart.
_CCACHE_SUBDIR = re.compile(r"[0-9a-f]{2}")
_CCACHE_REST = re.compile(r"[0-9a-f]{2}[0-9a-v]{29}|[0-9a-f]{38}")
_CCACHE_FLAT = re.compile(r"[0-9a-f]{4}[0-9a-v]{29}|[0-9a-f]{40}")


@dataclass(frozen=True, slots=True)
class CachePath:
    """A parsed cache URL path."""

    instance: str
    kind: str  # "ac" or "cas"
    hash: str  # 64 lowercase hex digits
    layout: str = "bazel"  # "bazel", "ccache-subdirs" or "ccache-flat"

    @property
    def digest(self) -> Digest:
        """The storage key. The HTTP protocol has no sizes; stores key by function and hash."""
        return Digest(self.hash, 0, DigestFunction.SHA256)


def ccache_key_to_hash(key: str) -> str:
    """ccache's key string -> the 64 hex digits `layout=bazel` sends for the same 20 bytes.

    The key is 40 lowercase hex digits (ccache 4.8 and later) or 4 hex + 29 base32hex (up to
    4.7). ccache pads the 40 hex digits to SHA-256's 64 by repeating the first 24.
    """
    if not _CCACHE_FLAT.fullmatch(key):
        raise InvalidDigest(f"invalid ccache key {key[:100]!r}: want 40 hex digits, or 4 hex + 29 base32hex")
    if len(key) == 40:
        hex_digits = key
    else:
        raw = bytes.fromhex(key[:4]) + base64.b32hexdecode(key[4:].upper() + "===")
        if base64.b32hexencode(raw[2:]).decode().rstrip("=").lower() != key[4:]:
            raise InvalidDigest(f"invalid ccache key {key!r}: not canonical base32hex")
        hex_digits = raw.hex()
    return hex_digits + hex_digits[:24]


def parse_cache_path(raw_path: str) -> CachePath:
    """`/{instance…}/ac|cas/{hash}` or a ccache subdirs/flat path; InvalidDigest when neither."""
    if not raw_path.startswith("/") or not _PATH_CHARS.fullmatch(raw_path) or len(raw_path) > _MAX_PATH:
        raise InvalidDigest(f"invalid path {raw_path[:100]!r}")
    segments = raw_path[1:].split("/")
    last = segments[-1]
    if len(segments) >= 2 and segments[-2] in ("ac", "cas") and len(last) == 64:
        if not is_hash(last):
            raise InvalidDigest(f"invalid SHA-256 hash {last!r}: want 64 lowercase hex digits")
        return CachePath(verify_instance_name("/".join(segments[:-2])), segments[-2], last)
    if len(segments) >= 2 and _CCACHE_SUBDIR.fullmatch(segments[-2]) and _CCACHE_REST.fullmatch(last):
        hash_ = ccache_key_to_hash(segments[-2] + last)
        return CachePath(verify_instance_name("/".join(segments[:-2])), "ac", hash_, "ccache-subdirs")
    if _CCACHE_FLAT.fullmatch(last):
        return CachePath(verify_instance_name("/".join(segments[:-1])), "ac", ccache_key_to_hash(last), "ccache-flat")
    if len(segments) >= 2 and segments[-2] in ("ac", "cas"):
        raise InvalidDigest(f"invalid SHA-256 hash {last[:100]!r}: want 64 lowercase hex digits")
    raise InvalidDigest(
        f"invalid path {raw_path[:100]!r}: want /[instance/]ac/<sha256>, /[instance/]cas/<sha256> "
        "or a ccache key path"
    )
