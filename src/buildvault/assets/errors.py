"""What a Remote Asset request can fail with; server/errors.py maps each to its status."""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["AssetNotFound", "AssetTimeout", "InvalidAssetRequest"]


class InvalidAssetRequest(ValueError):
    """A malformed request or an unsupported qualifier (INVALID_ARGUMENT with BadRequest details):
    `violations` are (field, description) pairs, e.g. ("qualifiers.name", '"x" not supported')."""

    def __init__(self, violations: Sequence[tuple[str, str]]) -> None:
        self.violations = list(violations)
        shown = "; ".join(f"{field}: {text}" for field, text in self.violations[:3])
        more = f" (and {len(self.violations) - 3} more)" if len(self.violations) > 3 else ""
        super().__init__(f"invalid asset request: {shown}{more}")


class AssetNotFound(Exception):
    """Nothing could be served or fetched (NOT_FOUND): the message names each URI tried (without
    credentials or query) and what its origin (or the rules) answered."""

    def __init__(self, reason: str, attempts: Sequence[tuple[str, str]] = ()) -> None:
        self.reason = reason
        self.attempts = list(attempts)
        tried = "; ".join(f"{uri}: {answer}" for uri, answer in self.attempts)
        super().__init__(f"{reason}" + (f" (tried {tried})" if tried else ""))


class AssetTimeout(AssetNotFound):
    """Every origin tried ran past the request's (or the server's) timeout (DEADLINE_EXCEEDED)."""
