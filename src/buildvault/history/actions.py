"""Actions as the build pages show them: the Action, Command and input tree read from the CAS,
two actions compared, and a cache miss explained.

Nothing here knows HTTP: the pages (server/http/build_pages.py) render what these functions
return. Every message comes from the CAS through `BlobStore.read_blobs` (a level of an input
tree at a time), so a tree of thousands of files costs a few store calls; identical
subdirectories (same digest) are never opened.

The explanation of a miss, after the question every cache user asks: the closest earlier action
that was *the same step* (the same output paths in its Command, which a `--copt` does not
change; else the same target and mnemonic from the RequestMetadata), compared with the missed one.
"""

from __future__ import annotations

import difflib
import fnmatch
from collections.abc import Sequence
from dataclasses import dataclass, field

from google.protobuf.message import DecodeError

from buildvault.digest import Digest, DigestFunction, InvalidDigest
from buildvault.history.store import HistoryStore, Row
from buildvault.remote_apis import re_pb2
from buildvault.storage import BlobStore

__all__ = [
    "ActionView",
    "Explanation",
    "InputDiff",
    "compare_actions",
    "diff_inputs",
    "explain_miss",
    "is_secret",
    "list_directory",
    "load_actions",
    "parse_digest",
]

# The largest message read to show (an Action, Command or Directory).
MESSAGE_LIMIT = 16 << 20
# How many earlier actions are read to find one with the same output paths.
SEARCH_LIMIT = 300


def parse_digest(text: str) -> Digest:
    """`hash/size` or `hash-size` (the pages' URL form) -> a SHA-256 Digest; InvalidDigest otherwise."""
    hash_, sep, size = text.replace("-", "/", 1).partition("/")
    if not sep or not size.isdigit() or len(size) > 18:
        raise InvalidDigest(f"invalid action digest {text[:100]!r}: want <sha256>-<size>")
    return Digest.parse(hash_, int(size), DigestFunction.SHA256)


def digest_key(digest: Digest) -> str:
    """The history's form of a digest (`hash/size`)."""
    return f"{digest.hash}/{digest.size_bytes}"


def _proto_digest(message: re_pb2.Digest) -> Digest | None:
    """`Digest.from_proto`, None for a malformed digest (a page shows what it can)."""
    try:
        return Digest.from_proto(message)
    except InvalidDigest:
        return None


@dataclass
class ActionView:
    """An action as far as the CAS has it: `action` None when the client never uploaded it,
    `command` None when its Command is missing."""

    digest: Digest
    action: re_pb2.Action | None = None
    command: re_pb2.Command | None = None

    @property
    def input_root(self) -> Digest | None:
        return _proto_digest(self.action.input_root_digest) if self.action is not None else None

    @property
    def outputs(self) -> tuple[str, ...]:
        c = self.command
        if c is None:
            return ()
        if c.output_paths:
            return tuple(sorted(c.output_paths))
        return tuple(sorted([*c.output_files, *c.output_directories]))

    @property
    def arguments(self) -> list[str]:
        return list(self.command.arguments) if self.command is not None else []

    @property
    def environment(self) -> dict[str, str]:
        c = self.command
        return {v.name: v.value for v in c.environment_variables} if c is not None else {}

    @property
    def platform(self) -> dict[str, str]:
        """Command.platform, overridden by Action.platform (REAPI v2.2: the Action's wins)."""
        merged: dict[str, str] = {}
        if self.command is not None:
            merged.update((p.name, p.value) for p in self.command.platform.properties)
        if self.action is not None:
            merged.update((p.name, p.value) for p in self.action.platform.properties)
        return merged


async def _read_messages(blobs: BlobStore, digests: Sequence[Digest | None], kind: type) -> list[object | None]:
    """Messages of `kind` for `digests` (None where absent, too large or not parseable)."""
    wanted = [d for d in digests if d is not None and d.size_bytes <= MESSAGE_LIMIT]
    found: dict[Digest, object] = {}
    if wanted:
        unique = list(dict.fromkeys(wanted))
        for digest, data in zip(unique, await blobs.read_blobs(unique), strict=True):
            if isinstance(data, Exception):
                continue
            try:
                found[digest] = kind.FromString(data)  # type: ignore[attr-defined]
            except (DecodeError, ValueError):
                continue
    return [found.get(d) if d is not None else None for d in digests]


async def load_actions(blobs: BlobStore, digests: Sequence[Digest]) -> list[ActionView]:
    """The views of `digests`: two batched reads (the Actions, then their Commands)."""
    # A size of 0 is HTTP's "size unknown" (history rows of bazel-remote's protocol), never an Action.
    actions = await _read_messages(blobs, [d if d.size_bytes else None for d in digests], re_pb2.Action)
    command_digests = [_proto_digest(a.command_digest) if isinstance(a, re_pb2.Action) else None for a in actions]
    commands = await _read_messages(blobs, command_digests, re_pb2.Command)
    return [
        ActionView(d, a if isinstance(a, re_pb2.Action) else None, c if isinstance(c, re_pb2.Command) else None)
        for d, a, c in zip(digests, actions, commands, strict=True)
    ]


# -- input trees -------------------------------------------------------------------------------


@dataclass
class InputDiff:
    """Inputs by path: `changed` (path, digest before, digest after), `added` / `removed`
    (path, digest); `unavailable` (directory path, which side: "earlier", "this" or "both")
    where a Directory was never uploaded, so what lies under it cannot be compared."""

    changed: list[tuple[str, Digest, Digest]] = field(default_factory=list)
    added: list[tuple[str, Digest]] = field(default_factory=list)
    removed: list[tuple[str, Digest]] = field(default_factory=list)
    unavailable: list[tuple[str, str]] = field(default_factory=list)
    same_files: int = 0

    @property
    def empty(self) -> bool:
        return not (self.changed or self.added or self.removed or self.unavailable)


def _join(path: str, name: str) -> str:
    return f"{path}/{name}" if path else name


def _entries(directory: re_pb2.Directory) -> tuple[dict[str, tuple[str, Digest | None]], dict[str, Digest | None]]:
    """files (and symlinks, as `->target`) by name: (identity, digest); subdirectories by name."""
    files: dict[str, tuple[str, Digest | None]] = {}
    for f in directory.files:
        d = _proto_digest(f.digest)
        files[f.name] = (f"{f.digest.hash}/{f.digest.size_bytes}/{'x' if f.is_executable else ''}", d)
    for s in directory.symlinks:
        files[s.name] = (f"->{s.target}", None)
    dirs = {d.name: _proto_digest(d.digest) for d in directory.directories}
    return files, dirs


_EMPTY = Digest("0" * 64, 0, DigestFunction.SHA256)


async def diff_inputs(blobs: BlobStore, before: Digest | None, after: Digest | None) -> InputDiff:
    """What differs between two input roots, by path; only differing subtrees are read."""
    result = InputDiff()
    # (path, directory digest before, after); None on a side: absent on that side.
    level: list[tuple[str, Digest | None, Digest | None]] = [("", before, after)]
    while level:
        wanted = [d for _, a, b in level for d in (a, b) if d is not None]
        read = await _read_messages(blobs, wanted, re_pb2.Directory)
        directories = {d: m for d, m in zip(wanted, read, strict=True) if isinstance(m, re_pb2.Directory)}
        following: list[tuple[str, Digest | None, Digest | None]] = []
        for path, a, b in level:
            da = directories.get(a) if a is not None else re_pb2.Directory()
            db = directories.get(b) if b is not None else re_pb2.Directory()
            if da is None or db is None:
                side = "both" if da is None and db is None else "earlier" if da is None else "this"
                result.unavailable.append((path or ".", side))
                continue
            files_a, dirs_a = _entries(da)
            files_b, dirs_b = _entries(db)
            for name, (ident, digest) in files_a.items():
                other = files_b.get(name)
                if other is None:
                    result.removed.append((_join(path, name), digest or _EMPTY))
                elif other[0] != ident:
                    result.changed.append((_join(path, name), digest or _EMPTY, other[1] or _EMPTY))
                else:
                    result.same_files += 1
            for name, (_, digest) in files_b.items():
                if name not in files_a:
                    result.added.append((_join(path, name), digest or _EMPTY))
            for name in dirs_a.keys() | dirs_b.keys():
                sub_a, sub_b = dirs_a.get(name), dirs_b.get(name)
                if sub_a is not None and sub_a == sub_b:
                    continue  # the same subtree: nothing under it differs
                following.append((_join(path, name), sub_a, sub_b))
        level = following
    for items in (result.changed, result.added, result.removed, result.unavailable):
        items.sort(key=lambda item: item[0])
    return result


async def list_directory(blobs: BlobStore, root: Digest, path: str) -> re_pb2.Directory | None:
    """The Directory at `path` (`a/b`) under `root`; None when it or a parent is not in the CAS
    or the path names no directory."""
    current = root
    parts = [p for p in path.split("/") if p]
    for depth in range(len(parts) + 1):
        message = (await _read_messages(blobs, [current], re_pb2.Directory))[0]
        if not isinstance(message, re_pb2.Directory):
            return None
        if depth == len(parts):
            return message
        child = next((d for d in message.directories if d.name == parts[depth]), None)
        if child is None:
            return None
        next_digest = _proto_digest(child.digest)
        if next_digest is None:
            return None
        current = next_digest
    return None


# -- comparison --------------------------------------------------------------------------------


def is_secret(name: str, patterns: Sequence[str]) -> bool:
    """An environment variable whose value the pages mask (shell patterns, any case)."""
    upper = name.upper()
    return any(fnmatch.fnmatchcase(upper, p.strip().upper()) for p in patterns if p.strip())


def _quote(text: str) -> str:
    return f"`{text}`"


def _argument_findings(before: list[str], after: list[str]) -> list[str]:
    findings: list[str] = []
    matcher = difflib.SequenceMatcher(None, before, after, autojunk=False)
    for op, i1, i2, j1, j2 in matcher.get_opcodes():
        if op == "equal":
            continue
        old, new = before[i1:i2], after[j1:j2]
        if op == "replace" and len(old) == len(new):
            findings.extend(f"the argument {_quote(a)} became {_quote(b)}" for a, b in zip(old, new, strict=True))
        elif op == "replace":
            findings.append(f"the arguments {_quote(' '.join(old))} became {_quote(' '.join(new))}")
        elif op == "delete":
            findings.extend(f"the argument {_quote(a)} was removed" for a in old)
        else:
            findings.extend(f"the argument {_quote(b)} was added" for b in new)
    return findings


def _mapping_findings(what: str, before: dict[str, str], after: dict[str, str]) -> list[str]:
    findings = []
    for name in sorted(before.keys() | after.keys()):
        if name not in after:
            findings.append(f"the {what} {_quote(name)} was removed")
        elif name not in before:
            findings.append(f"the {what} {_quote(name)} was added")
        elif before[name] != after[name]:
            findings.append(f"the {what} {_quote(name)} changed")
    return findings


@dataclass
class Comparison:
    """What differs between an earlier action and this one; `findings` are sentences, most
    telling first (inputs, then arguments, environment, platform, the rest)."""

    earlier: ActionView
    this: ActionView
    inputs: InputDiff | None
    findings: list[str]
    arguments: Sequence[tuple[str, int, int, int, int]]  # difflib opcodes over the two argument lists


INPUT_FINDING_LIMIT = 50


def _input_findings(earlier: ActionView, this: ActionView, inputs: InputDiff | None) -> list[str]:
    if inputs is None:
        return []
    findings = [f"input {_quote(p)} changed" for p, _, _ in inputs.changed]
    findings += [f"input {_quote(p)} was added" for p, _ in inputs.added]
    findings += [f"input {_quote(p)} was removed" for p, _ in inputs.removed]
    if len(findings) > INPUT_FINDING_LIMIT:
        findings = findings[:INPUT_FINDING_LIMIT] + [f"and {len(findings) - INPUT_FINDING_LIMIT} more input changes"]
    for path, side in inputs.unavailable:
        who = {"earlier": "the earlier action's", "this": "this action's", "both": "either action's"}[side]
        where = "the input root" if path == "." else f"the input directory {_quote(path)}"
        findings.append(
            f"{where} differs, and the client did not upload {who} input tree there, so the changed files "
            "cannot be named (Bazel with --remote_cache alone uploads the Action and Command, not the inputs)"
        )
    return findings


async def compare_actions(blobs: BlobStore, earlier: ActionView, this: ActionView) -> Comparison:
    """Everything that differs between two actions."""
    findings: list[str] = []
    inputs: InputDiff | None = None
    if earlier.action is None or this.action is None:
        missing = "this action" if this.action is None else "the earlier action"
        findings.append(f"the client never uploaded {missing} (its Action is not in the CAS), so it cannot be compared")
        return Comparison(earlier, this, None, findings, [])
    if earlier.input_root != this.input_root:
        inputs = await diff_inputs(blobs, earlier.input_root, this.input_root)
        findings += _input_findings(earlier, this, inputs)
    if earlier.command is None or this.command is None:
        missing = "this action's" if this.command is None else "the earlier action's"
        findings.append(f"the client never uploaded {missing} Command, so arguments and environment cannot be compared")
    matcher = difflib.SequenceMatcher(None, earlier.arguments, this.arguments, autojunk=False)
    opcodes = [op for op in matcher.get_opcodes() if op[0] != "equal"]
    findings += _argument_findings(earlier.arguments, this.arguments)
    findings += _mapping_findings("environment variable", earlier.environment, this.environment)
    findings += _mapping_findings("platform property", earlier.platform, this.platform)
    if earlier.outputs != this.outputs and earlier.command is not None and this.command is not None:
        findings.append("the output paths changed")
    both = earlier.command is not None and this.command is not None
    if both and earlier.command.working_directory != this.command.working_directory:  # type: ignore[union-attr]
        findings.append("the working directory changed")
    a, b = earlier.action, this.action
    if a.timeout.ToTimedelta() != b.timeout.ToTimedelta():
        findings.append("the timeout changed")
    if a.do_not_cache != b.do_not_cache:
        findings.append("do_not_cache changed")
    if a.salt != b.salt:
        findings.append("the salt changed")
    return Comparison(earlier, this, inputs, findings, opcodes)


# -- the explanation of a miss ---------------------------------------------------------------


@dataclass
class Explanation:
    missed: ActionView
    row: Row | None  # the recorded miss
    earlier: ActionView | None = None
    earlier_invocation: str = ""
    matched_by: str = ""  # "the same output paths" or "the same target and mnemonic"
    comparison: Comparison | None = None
    notes: list[str] = field(default_factory=list)


async def explain_miss(
    store: HistoryStore, blobs: BlobStore, instance: str, digest: Digest, invocation: str = ""
) -> Explanation:
    """Why `digest` missed (in `invocation`, or its latest recorded miss)."""
    key = digest_key(digest)
    rows = [r for r in store.requests_for(key, limit=500) if r.instance == instance]
    misses = [r for r in rows if r.outcome == "miss" and (not invocation or r.invocation == invocation)]
    row = misses[0] if misses else (rows[0] if rows else None)
    missed = (await load_actions(blobs, [digest]))[0]
    explanation = Explanation(missed, row)
    at = row.time if row is not None else float("inf")
    this_invocation = row.invocation if row is not None else invocation
    stored_before = [r for r in rows if r.time < at and r.outcome in ("upload", "hit", "executed")]
    if stored_before:
        explanation.notes.append(
            "this very action was stored before (invocation "
            f"{stored_before[0].invocation or 'unknown'}): its result was no longer available at this lookup "
            "(evicted, or an output it names was missing)"
        )
    if missed.action is None:
        explanation.notes.append(
            "the client never uploaded the missed action (its Action message is not in the CAS), so it cannot "
            "be compared with an earlier one"
        )
    target = row.target if row is not None else ""
    mnemonic = row.mnemonic if row is not None else ""
    if target:
        candidates = store.same_step(
            instance, target, mnemonic, at, exclude_digest=key, exclude_invocation=this_invocation, limit=SEARCH_LIMIT
        )
    else:
        candidates = []
    outputs = missed.outputs
    chosen: tuple[ActionView, str, str] | None = None
    if outputs:
        pool = candidates or store.recent_actions(
            instance, at, exclude_digest=key, exclude_invocation=this_invocation, limit=SEARCH_LIMIT
        )
        views = await load_actions(blobs, [parse_digest(d) for d, _, _ in pool])
        for view, (_, inv, _) in zip(views, pool, strict=True):
            if view.outputs == outputs:
                chosen = (view, inv, "the same output paths")
                break
    if chosen is None and candidates:
        first = candidates[0]
        chosen = ((await load_actions(blobs, [parse_digest(first[0])]))[0], first[1], "the same target and mnemonic")
    if chosen is None:
        step = f"target {_quote(target)}, mnemonic {_quote(mnemonic)}" if target else "the same output paths"
        explanation.notes.append(
            f"no earlier action of the same step ({step}) was recorded in another invocation: "
            "this is the first build of it the server saw"
        )
        return explanation
    explanation.earlier, explanation.earlier_invocation, explanation.matched_by = chosen
    explanation.comparison = await compare_actions(blobs, chosen[0], missed)
    return explanation
