"""ActionCache semantics, independent of any wire protocol.

An ActionResult is only worth serving if a client can fetch everything it names. So:

- `get` returns a stored result only if every blob it references is in the CAS: output files,
  output directories' Tree blobs *and every file inside those trees* (or, for results stored
  as separate Directory blobs, every Directory and file reached from the root), and the
  stdout/stderr digests. Otherwise the entry is as good as absent: NotFound.
- `update` validates the result, moves any inlined bytes (stdout_raw, stderr_raw, output file
  contents) into the CAS, refuses results that reference missing blobs (MissingBlobs, which the
  gRPC layer turns into FAILED_PRECONDITION with a PreconditionFailure), and stores the result
  under `ac_namespace(instance_name)`.
- Entries that arrive as bytes (bazel-remote's HTTP PUT /ac/) are classified: a valid
  ActionResult whose blobs are all present is a real entry (what GetActionResult serves);
  anything else, e.g. a ccache entry, is kept byte-for-byte under `ac_namespace(instance, "raw")`,
  which gRPC never serves. `lookup_entry` looks in the real namespace first, then the raw one,
  and never serves an ActionResult whose blobs are missing from either.
- A client's lookup (`get(counted=True)`: GetActionResult; `lookup_entry(counted=True)`: HTTP
  GET /ac/) is counted here, once for both protocols, as a hit or a miss (a missing, unreadable
  or incomplete entry) under the protocol the front end named in storage's
  REQUEST_PROTOCOL; Execute's own cache check and HTTP HEAD are not lookups a client counts.

Empty blobs are always present, as the REAPI requires: the store stack's rule
(storage.EmptyBlobStore), which every BlobStore handed to ActionCache sits under.
"""

from __future__ import annotations

import asyncio
import enum
from collections.abc import Iterable, Sequence
from typing import Protocol

from google.protobuf.message import DecodeError

from buildvault.digest import Digest, DigestFunction, InvalidDigest, verify_instance_name
from buildvault.remote_apis import re_pb2
from buildvault.storage import REQUEST_PROTOCOL, ActionStore, BlobStore, NotFound, ac_namespace, single_chunk

__all__ = [
    "ActionCache",
    "EntryKind",
    "InvalidActionResult",
    "MissingBlobs",
    "read_blob",
]

# A Tree (or Directory) larger than this is not read into memory to check completeness.
MAX_TREE_BYTES = 64 << 20
# Directory blobs visited when walking a root_directory_digest hierarchy.
MAX_WALK_DIRECTORIES = 200_000
# Default total of bytes inlined into one GetActionResult response.
DEFAULT_INLINE_BUDGET = 2 << 20


class MissingBlobs(Exception):
    """An ActionResult references blobs that are not in the CAS."""

    def __init__(self, digests: Sequence[Digest]) -> None:
        self.digests = list(digests)
        shown = ", ".join(str(d) for d in self.digests[:3])
        more = f" and {len(self.digests) - 3} more" if len(self.digests) > 3 else ""
        super().__init__(f"{len(self.digests)} referenced blob(s) missing from the CAS: {shown}{more}")


class InvalidActionResult(ValueError):
    """An ActionResult that breaks the spec (bad path, a Tree that is not a Tree, ...)."""


class EntryKind(enum.Enum):
    """What the bytes of an action entry are, by the ActionCache's rules."""

    COMPLETE = "complete"  # a valid ActionResult whose referenced blobs are all in the CAS
    INCOMPLETE = "incomplete"  # a valid ActionResult that references missing blobs
    OPAQUE = "opaque"  # anything else (e.g. a ccache entry): kept and served byte-for-byte


async def read_blob(store: BlobStore, digest: Digest, max_size: int | None = None) -> bytes:
    """A whole (small) blob; NotFound if absent. `max_size` guards memory."""
    if max_size is not None and digest.size_bytes > max_size:
        raise InvalidActionResult(f"blob {digest} is larger than the {max_size} bytes this server reads at once")
    chunks = await store.read(digest)
    parts = [chunk async for chunk in chunks]
    return parts[0] if len(parts) == 1 else b"".join(parts)


def _optional_digest(message: re_pb2.Digest, has: bool, function: DigestFunction, what: str) -> Digest | None:
    """stdout/stderr digests: unset (or an all-default Digest) means "no output"."""
    if not has or (message.hash == "" and message.size_bytes == 0):
        return None
    try:
        return Digest.from_proto(message, function)
    except InvalidDigest as e:
        raise InvalidDigest(f"{what}: {e}") from None


def _check_path(path: str, what: str, allow_empty: bool = False) -> None:
    if path == "" and allow_empty:
        return
    if path == "" or path.startswith("/") or path.endswith("/") or "\0" in path or "//" in path:
        raise InvalidActionResult(
            f"{what} path {path[:200]!r} must be a non-empty relative '/'-separated path without a trailing slash"
        )


class _References:
    """The blobs an ActionResult names, gathered in order without duplicates."""

    def __init__(self) -> None:
        self.direct: dict[Digest, None] = {}  # output files, stdout, stderr: must be present
        self.trees: dict[Digest, None] = {}  # Tree blobs: must be present and are read for their files
        self.roots: dict[Digest, None] = {}  # root Directory blobs of DIRECTORY_ONLY outputs

    def add(self, digest: Digest | None) -> None:
        if digest is not None:
            self.direct.setdefault(digest)


def _collect(result: re_pb2.ActionResult, function: DigestFunction) -> _References:
    """Parse and validate every digest and path of `result` (InvalidDigest / InvalidActionResult)."""
    refs = _References()
    for output_file in result.output_files:
        _check_path(output_file.path, "output file")
        try:
            refs.add(Digest.from_proto(output_file.digest, function))
        except InvalidDigest as e:
            raise InvalidDigest(f"output file {output_file.path[:200]!r}: {e}") from None
    for output in result.output_directories:
        _check_path(output.path, "output directory", allow_empty=True)
        has_tree = output.HasField("tree_digest") and output.tree_digest.hash != ""
        has_root = output.HasField("root_directory_digest") and output.root_directory_digest.hash != ""
        if not has_tree and not has_root:
            raise InvalidActionResult(
                f"output directory {output.path[:200]!r} has neither tree_digest nor root_directory_digest"
            )
        try:
            if has_tree:
                refs.trees.setdefault(Digest.from_proto(output.tree_digest, function))
            if has_root:
                refs.roots.setdefault(Digest.from_proto(output.root_directory_digest, function))
        except InvalidDigest as e:
            raise InvalidDigest(f"output directory {output.path[:200]!r}: {e}") from None
    for symlinks, what in (
        (result.output_symlinks, "output symlink"),
        (result.output_file_symlinks, "output file symlink"),
        (result.output_directory_symlinks, "output directory symlink"),
    ):
        for link in symlinks:
            _check_path(link.path, what)
            if link.target == "":
                raise InvalidActionResult(f"{what} {link.path[:200]!r} has an empty target")
    refs.add(_optional_digest(result.stdout_digest, result.HasField("stdout_digest"), function, "stdout_digest"))
    refs.add(_optional_digest(result.stderr_digest, result.HasField("stderr_digest"), function, "stderr_digest"))
    return refs


def _directory_files(directory: re_pb2.Directory, function: DigestFunction, into: dict[Digest, None]) -> None:
    for node in directory.files:
        into.setdefault(Digest.from_proto(node.digest, function))


class LookupRecorder(Protocol):
    """Where client lookups are counted (server/metrics.py's Metrics is one)."""

    def ac_lookup(self, protocol: str, hit: bool) -> None: ...


class ActionCache:
    """The ActionCache service's behaviour over a BlobStore (the CAS) and an ActionStore."""

    def __init__(
        self,
        blobs: BlobStore,
        actions: ActionStore,
        *,
        inline_budget: int = DEFAULT_INLINE_BUDGET,
        message_limit: int | None = None,
        recorder: LookupRecorder | None = None,
    ) -> None:
        self.blobs = blobs
        self.actions = actions
        self.recorder = recorder
        self.inline_budget = inline_budget
        # Responses must stay under the transport's message limit, inlined bytes included.
        self.message_limit = message_limit

    def _count(self, hit: bool) -> None:
        protocol = REQUEST_PROTOCOL.get()
        if self.recorder is not None and protocol is not None:
            self.recorder.ac_lookup(protocol, hit)

    # -- completeness -----------------------------------------------------------------

    async def missing_blobs(self, result: re_pb2.ActionResult, function: DigestFunction) -> list[Digest]:
        """Every blob `result` references that is not in the CAS (validating it on the way).

        Tree blobs are read to check the files inside them; a Tree that cannot be parsed is an
        InvalidActionResult.
        """
        refs = _collect(result, function)
        first = list(refs.direct) + [d for d in refs.trees if d not in refs.direct]
        missing = await self.blobs.find_missing(first) if first else []
        missing_set = set(missing)
        nested: dict[Digest, None] = {}
        present_trees = [d for d in refs.trees if d not in missing_set]
        trees = await asyncio.gather(*(self._read_tree(d) for d in present_trees)) if present_trees else []
        for tree in trees:
            try:
                _directory_files(tree.root, function, nested)
                for child in tree.children:
                    _directory_files(child, function, nested)
            except InvalidDigest as e:
                raise InvalidActionResult(f"output directory tree names a bad digest: {e}") from None
        for root in refs.roots:
            walk_missing = await self._walk_directories(root, function, nested)
            missing.extend(d for d in walk_missing if d not in missing_set)
            missing_set.update(walk_missing)
        if nested:
            check = [d for d in nested if d not in missing_set and d not in refs.direct]
            for digest in await self.blobs.find_missing(check) if check else []:
                missing.append(digest)
                missing_set.add(digest)
        return missing

    async def _read_tree(self, digest: Digest) -> re_pb2.Tree:
        data = await read_blob(self.blobs, digest, MAX_TREE_BYTES)
        try:
            return re_pb2.Tree.FromString(data)
        except DecodeError:
            raise InvalidActionResult(f"tree_digest {digest} does not name a Tree message") from None

    async def _walk_directories(
        self, root: Digest, function: DigestFunction, files: dict[Digest, None]
    ) -> list[Digest]:
        """Walk Directory blobs from `root`; return the missing Directory blobs, add files to `files`."""
        missing: list[Digest] = []
        seen: set[Digest] = {root}
        level = [root]
        while level:
            if len(seen) > MAX_WALK_DIRECTORIES:
                raise InvalidActionResult(f"output directory {root} has more than {MAX_WALK_DIRECTORIES} directories")
            absent = set(await self.blobs.find_missing(level))
            missing.extend(d for d in level if d in absent)
            present = [d for d in level if d not in absent]
            blobs = await asyncio.gather(*(read_blob(self.blobs, d, MAX_TREE_BYTES) for d in present))
            level = []
            for digest, data in zip(present, blobs, strict=True):
                try:
                    directory = re_pb2.Directory.FromString(data)
                    _directory_files(directory, function, files)
                    children = [Digest.from_proto(node.digest, function) for node in directory.directories]
                except (DecodeError, InvalidDigest) as e:
                    raise InvalidActionResult(f"directory {digest} is not a valid Directory message: {e}") from None
                for child in children:
                    if child not in seen:
                        seen.add(child)
                        level.append(child)
        return missing

    # -- entries as bytes (bazel-remote HTTP) ---------------------------------------------

    async def classify_entry(self, data: bytes, function: DigestFunction) -> EntryKind:
        """Whether `data` is a complete ActionResult, an incomplete one, or opaque bytes."""
        try:
            result = re_pb2.ActionResult.FromString(data)
        except Exception:  # DecodeError and friends: not an ActionResult
            return EntryKind.OPAQUE
        try:
            missing = await self.missing_blobs(result, function)
        except (InvalidActionResult, InvalidDigest):
            return EntryKind.OPAQUE
        return EntryKind.INCOMPLETE if missing else EntryKind.COMPLETE

    async def lookup_entry(self, instance_name: str, action_digest: Digest, *, counted: bool = False) -> bytes | None:
        """The stored bytes for `action_digest`: a complete real entry, else the raw entry, else None.

        A raw entry that is an ActionResult (PUT before its blobs) is served only once every
        blob it references is present, like a real one. `counted`: a client's lookup (a hit or
        a miss in the metrics)."""
        data = await self._lookup_entry(instance_name, action_digest)
        if counted:
            self._count(data is not None)
        return data

    async def _lookup_entry(self, instance_name: str, action_digest: Digest) -> bytes | None:
        function = action_digest.function
        try:
            data: bytes | None = await self.actions.get(ac_namespace(instance_name), action_digest)
        except NotFound:
            data = None
        if data is not None and await self.classify_entry(data, function) is EntryKind.COMPLETE:
            return data
        try:
            data = await self.actions.get(ac_namespace(instance_name, "raw"), action_digest)
        except NotFound:
            return None
        return None if await self.classify_entry(data, function) is EntryKind.INCOMPLETE else data

    async def store_entry(self, instance_name: str, action_digest: Digest, data: bytes) -> EntryKind:
        """Store `data` byte-for-byte: a complete ActionResult as a real entry, anything else as raw."""
        kind = await self.classify_entry(data, action_digest.function)
        namespace = ac_namespace(instance_name) if kind is EntryKind.COMPLETE else ac_namespace(instance_name, "raw")
        await self.actions.put(namespace, action_digest, data)
        return kind

    # -- GetActionResult ------------------------------------------------------------------

    async def get(
        self,
        instance_name: str,
        action_digest: Digest,
        *,
        inline_stdout: bool = False,
        inline_stderr: bool = False,
        inline_output_files: Iterable[str] = (),
        counted: bool = False,
    ) -> re_pb2.ActionResult:
        """The stored result, if complete; NotFound otherwise. `counted`: a client's lookup (a hit
        or a miss in the metrics)."""
        verify_instance_name(instance_name)
        try:
            data = await self.actions.get(ac_namespace(instance_name), action_digest)
            try:
                result = re_pb2.ActionResult.FromString(data)
            except DecodeError:
                raise NotFound(f"action result for {action_digest} is unreadable") from None
            function = action_digest.function
            try:
                missing = await self.missing_blobs(result, function)
            except (InvalidDigest, InvalidActionResult) as e:
                raise NotFound(f"action result for {action_digest} is not usable: {e}") from None
            if missing:
                raise NotFound(
                    f"action result for {action_digest} references {len(missing)} blob(s) no longer in the CAS, "
                    f"e.g. {missing[0]}"
                )
            await self._inline(result, function, inline_stdout, inline_stderr, frozenset(inline_output_files))
        except NotFound:
            if counted:
                self._count(False)
            raise
        if counted:
            self._count(True)
        return result

    async def _inline(
        self,
        result: re_pb2.ActionResult,
        function: DigestFunction,
        inline_stdout: bool,
        inline_stderr: bool,
        inline_files: frozenset[str],
    ) -> None:
        if not (inline_stdout or inline_stderr or inline_files):
            return
        budget = self.inline_budget
        if self.message_limit is not None:
            # Leave room for the result itself and the framing around each inlined field.
            budget = min(budget, self.message_limit - result.ByteSize() - 64 * 1024)
        wanted: list[tuple[object, str, Digest]] = []
        if inline_stdout:
            digest = _optional_digest(result.stdout_digest, result.HasField("stdout_digest"), function, "stdout")
            if digest is not None:
                wanted.append((result, "stdout_raw", digest))
        if inline_stderr:
            digest = _optional_digest(result.stderr_digest, result.HasField("stderr_digest"), function, "stderr")
            if digest is not None:
                wanted.append((result, "stderr_raw", digest))
        if inline_files:
            for output in result.output_files:
                if output.path in inline_files:
                    wanted.append((output, "contents", Digest.from_proto(output.digest, function)))
        chosen = []
        for target, field, digest in wanted:
            if digest.size_bytes + 16 <= budget:
                budget -= digest.size_bytes + 16
                chosen.append((target, field, digest))
        contents = await asyncio.gather(*(read_blob(self.blobs, digest) for _, _, digest in chosen))
        for (target, field, _), data in zip(chosen, contents, strict=True):
            setattr(target, field, data)

    # -- UpdateActionResult ---------------------------------------------------------------

    async def update(
        self, instance_name: str, action_digest: Digest, result: re_pb2.ActionResult
    ) -> re_pb2.ActionResult:
        """Validate, complete and store `result`; return what was stored."""
        verify_instance_name(instance_name)
        function = action_digest.function
        stored = re_pb2.ActionResult()
        stored.CopyFrom(result)
        await self._move_inline_bytes(stored, function)
        missing = await self.missing_blobs(stored, function)
        if missing:
            raise MissingBlobs(missing)
        await self.actions.put(
            ac_namespace(instance_name), action_digest, stored.SerializeToString(deterministic=True)
        )
        return stored

    async def _move_inline_bytes(self, result: re_pb2.ActionResult, function: DigestFunction) -> None:
        """Store inlined stdout/stderr/file contents in the CAS and keep only their digests."""
        uploads: dict[Digest, bytes] = {}

        def take(data: bytes, declared: re_pb2.Digest, has: bool, what: str) -> Digest:
            actual = Digest.of(data, function)
            if has and (declared.hash or declared.size_bytes):
                claimed = Digest.from_proto(declared, function)
                if claimed != actual:
                    raise InvalidActionResult(f"{what}: inlined bytes hash to {actual}, not the declared {claimed}")
            uploads[actual] = data
            return actual

        if result.stdout_raw:
            digest = take(result.stdout_raw, result.stdout_digest, result.HasField("stdout_digest"), "stdout_raw")
            result.stdout_digest.CopyFrom(digest.to_proto(re_pb2.Digest))
            result.ClearField("stdout_raw")
        if result.stderr_raw:
            digest = take(result.stderr_raw, result.stderr_digest, result.HasField("stderr_digest"), "stderr_raw")
            result.stderr_digest.CopyFrom(digest.to_proto(re_pb2.Digest))
            result.ClearField("stderr_raw")
        for output in result.output_files:
            if output.contents:
                what = f"output file {output.path[:200]!r}"
                digest = take(output.contents, output.digest, output.HasField("digest"), what)
                output.digest.CopyFrom(digest.to_proto(re_pb2.Digest))
                output.ClearField("contents")
        for digest, data in uploads.items():
            await self.blobs.write(digest, single_chunk(data))


def entry_is_intact(kind: str, data: bytes) -> bool:
    """Could this action entry have survived a power loss intact? The disk store's validator
    (DiskStorage.open(validate_entry=...)) for entries changed since its last sync point.

    Every kind: not empty and not zero-filled (what a torn write leaves). Kind "ac" must also
    parse as an ActionResult; other kinds ("raw": ccache's and other opaque HTTP entries) are
    not parsed."""
    if not data or not data.strip(b"\x00"):
        return False
    if kind not in ("ac", "asset"):  # Remote Asset entries are ActionResults too
        return True
    try:
        re_pb2.ActionResult.FromString(data)
    except DecodeError:
        return False
    return True
