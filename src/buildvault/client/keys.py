"""The cache key of one compile: a real REAPI Action (Command + input root + platform).

- Command: the compiler argv with root paths replaced by placeholders, the allow-listed
  environment, the working directory inside the input root, the declared outputs.
- Input root: every file the compile read (from the compiler's own dependency output),
  text files under a root hashed with the roots normalized, everything else byte-exact.
- Platform: compiler identity (hash of the resolved binary + its --version), OS/arch, and the
  BUILDVAULT_PLATFORM properties (SOC, CANN version, ...) that this compile mentions.
"""

from __future__ import annotations

import os
import platform as platform_mod
import stat
import threading
import time
from dataclasses import dataclass

from google.protobuf.message import Message

from buildvault.digest import Digest
from buildvault.remote_apis import re_pb2

from .compile_args import ENV_ALLOW, PATH_FLAGS, SEPARATE_VALUE, Compile
from .includes import Directives, scan_directives
from .roots import Roots

# /2: manifests record the state of every include-search candidate; toolchain identity covers cc1/as.
KEY_VERSION = "buildvault-cc/2"
# A file modified this recently is hashed again on every use (its mtime may not move on the next edit).
RACY_SECONDS = 2.0
_TIME_MACROS = (b"__DATE__", b"__TIME__")


class Uncacheable(Exception):
    """This compile cannot be cached (reason in the message)."""


def serialize(message: Message) -> bytes:
    """A message's bytes as its digest is taken (deterministic: the same message, the same key)."""
    return message.SerializeToString(deterministic=True)


def action_blobs(
    command: re_pb2.Command, root: Digest, platform: re_pb2.Platform
) -> tuple[Digest, dict[Digest, bytes]]:
    """The Action of `command` over the input root `root` on `platform`: its digest, and the
    Command and Action blobs by digest (what a client uploads beside the input tree)."""
    command_data = serialize(command)
    command_digest = Digest.of(command_data)
    action = re_pb2.Action(
        command_digest=command_digest.to_proto(re_pb2.Digest),
        input_root_digest=root.to_proto(re_pb2.Digest),
        platform=platform,
    )
    action_data = serialize(action)
    digest = Digest.of(action_data)
    return digest, {command_digest: command_data, digest: action_data}


@dataclass(frozen=True)
class FileInfo:
    digest: Digest  # of the (normalized) content
    executable: bool
    time_macros: bool
    timestamp_macro: bool
    mtime: float = 0.0  # seconds since the epoch
    directives: Directives = Directives((), (), (), False, None)  # what it asks the include search for


class FileHasher:
    """Content digests cached by (path, roots) and validated by inode/size/mtime/ctime."""

    def __init__(self) -> None:
        self._cache: dict[tuple[str, tuple[tuple[str, str], ...]], tuple[tuple[int, ...], FileInfo]] = {}
        self._lock = threading.Lock()

    @staticmethod
    def _signature(st: os.stat_result) -> tuple[int, ...]:
        return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_mode)

    def info(self, path: str, roots: Roots) -> FileInfo:
        """Digest and scan of `path`; raises Uncacheable for anything but a regular file."""
        st = os.stat(path)
        if not stat.S_ISREG(st.st_mode):
            raise Uncacheable(f"input is not a regular file: {path}")
        sig = self._signature(st)
        key = (path, roots.key)
        cached = self._cache.get(key)
        if cached is not None and cached[0] == sig:
            return cached[1]
        with open(path, "rb") as f:
            raw = f.read()
        data = self._normalized(path, raw, roots)
        info = FileInfo(
            digest=Digest.of(data),
            executable=bool(st.st_mode & 0o111),
            time_macros=any(m in data for m in _TIME_MACROS),
            timestamp_macro=b"__TIMESTAMP__" in data,
            mtime=st.st_mtime,
            directives=scan_directives(raw),
        )
        if time.time() - st.st_mtime > RACY_SECONDS:
            with self._lock:
                self._cache[key] = (sig, info)
                if len(self._cache) > 500_000:
                    self._cache.clear()
        return info

    @staticmethod
    def _normalized(path: str, data: bytes, roots: Roots) -> bytes:
        if roots and roots.locate(path) is not None and b"\0" not in data:
            return roots.normalize_bytes(data)
        return data

    @classmethod
    def _content(cls, path: str, roots: Roots) -> bytes:
        with open(path, "rb") as f:
            return cls._normalized(path, f.read(), roots)

    def content(self, path: str, roots: Roots, expect: Digest) -> bytes:
        """The blob for `path` as hashed; raises Uncacheable if it changed since."""
        data = self._content(path, roots)
        if Digest.of(data) != expect:
            raise Uncacheable(f"input changed during the build: {path}")
        return data


def os_arch() -> tuple[str, str]:
    return platform_mod.system().lower(), platform_mod.machine().lower()


def parse_platform(spec: str) -> list[tuple[str, str, bool]]:
    """`soc=ascend910b1,cann=8.0.RC3` -> [(name, value, always)]; `name=value!` applies to every compile."""
    out = []
    for item in spec.split(","):
        item = item.strip()
        if not item or "=" not in item:
            continue
        name, value = (s.strip() for s in item.split("=", 1))
        always = value.endswith("!")
        out.append((name, value.rstrip("!"), always))
    return out


@dataclass
class Prepared:
    """A compile with everything known before it runs."""

    compile: Compile
    cwd: str
    roots: Roots
    argv_norm: list[str]  # normalized (placeholders) argv
    argv_exact: list[str]  # argv with relative paths as given (exact mode)
    env_norm: list[tuple[str, str]]
    env_exact: list[tuple[str, str]]
    wd_layout: str  # working directory inside the input root (normalized)
    outputs: list[tuple[str, str]]  # (absolute path, kind) kind in {"obj", "dep"}
    compiler_id: str
    platform_spec: list[tuple[str, str, bool]]
    rewritten: list[str]  # original relative path tokens that normalization rewrote
    source_abs: str
    compiler_path: str = ""  # the resolved compiler binary


def _norm_path_value(value: str, cwd: str, cwd_root: str | None, roots: Roots, rewritten: list[str]) -> str:
    if os.path.isabs(value):
        return roots.normalize(value)
    absolute = os.path.normpath(os.path.join(cwd, value))
    where = roots.locate(absolute)
    if where is not None and where[0] == cwd_root:
        return value  # stays inside the working directory's root: invariant under moves
    rewritten.append(value)
    return roots.path_token(absolute)


_ATTACHED_PATH_FLAGS = ("--sysroot=", "-include", "-imacros", "-isysroot", "-isystem", "-idirafter", "-iquote", "-MF",
                        "-I", "-o")


def normalize_argv(argv: list[str], cwd: str, roots: Roots, rewritten: list[str]) -> list[str]:
    """argv with root paths as placeholders; relative paths that leave the working directory's
    root are made absolute (and remembered in `rewritten`, to check outputs for them)."""
    where = roots.locate(cwd)
    cwd_root = where[0] if where else None

    def value(v: str) -> str:
        return _norm_path_value(v, cwd, cwd_root, roots, rewritten)

    first = argv[0]
    out: list[str] = [value(first) if "/" in first else first]
    args = argv[1:]
    i = 0
    while i < len(args):
        arg = args[i]
        if arg in PATH_FLAGS and i + 1 < len(args):
            out += [arg, value(args[i + 1])]
            i += 2
            continue
        if arg in SEPARATE_VALUE and i + 1 < len(args):
            out += [arg, roots.normalize(args[i + 1])]
            i += 2
            continue
        i += 1
        if not arg.startswith("-"):
            out.append(value(arg))  # the source file
            continue
        for flag in _ATTACHED_PATH_FLAGS:
            if arg.startswith(flag) and len(arg) > len(flag):
                out.append(flag + value(arg[len(flag):]))
                break
        else:
            out.append(roots.normalize(arg))
    return out


def prepare(c: Compile, cwd: str, env: dict[str, str], roots: Roots, compiler_id: str,
            platform_spec: list[tuple[str, str, bool]], compiler_path: str = "") -> Prepared:
    rewritten: list[str] = []
    argv_norm = normalize_argv(c.argv, cwd, roots, rewritten)
    env_norm = sorted((k, roots.normalize(env[k])) for k in ENV_ALLOW if k in env)
    env_exact = sorted((k, env[k]) for k in ENV_ALLOW if k in env)
    outputs = [(os.path.normpath(os.path.join(cwd, c.output)), "obj")]
    if c.depfile:
        outputs.append((os.path.normpath(os.path.join(cwd, c.depfile)), "dep"))
    return Prepared(
        compile=c,
        cwd=cwd,
        roots=roots,
        argv_norm=argv_norm,
        argv_exact=list(c.argv),
        env_norm=env_norm,
        env_exact=env_exact,
        wd_layout=roots.layout(cwd),
        outputs=outputs,
        compiler_id=compiler_id,
        platform_spec=platform_spec,
        rewritten=rewritten,
        source_abs=os.path.normpath(os.path.join(cwd, c.source)),
        compiler_path=compiler_path,
    )


EXACT = Roots([])


class ActionKey:
    """The serialized Action, Command and input-root Directory messages of one key."""

    def __init__(self, action_digest: Digest, blobs: dict[Digest, bytes], command: re_pb2.Command,
                 output_rel: list[str]) -> None:
        self.digest = action_digest
        self.blobs = blobs  # Action, Command, Directory messages by digest
        self.command = command
        self.output_rel = output_rel


def _platform(p: Prepared, mode_exact: bool, argv: list[str], input_layouts: list[str]) -> re_pb2.Platform:
    system, machine = os_arch()
    props = {"OSFamily": system, "arch": machine, "compiler": p.compiler_id, "key": KEY_VERSION}
    if mode_exact:
        props["paths"] = "exact"
    haystack = "\0".join(argv + input_layouts).lower()
    for name, value, always in p.platform_spec:
        if always or value.lower() in haystack:
            props[name] = value
    return re_pb2.Platform(properties=[re_pb2.Platform.Property(name=k, value=v) for k, v in sorted(props.items())])


def build_tree(files: dict[str, tuple[Digest, bool]]) -> tuple[Digest, dict[Digest, bytes]]:
    """Merkle tree of Directory messages for {layout path: (digest, executable)}."""
    blobs: dict[Digest, bytes] = {}

    def build(entries: dict[str, tuple[Digest, bool]]) -> Digest:
        here: list[tuple[str, Digest, bool]] = []
        subdirs: dict[str, dict[str, tuple[Digest, bool]]] = {}
        for path, value in entries.items():
            head, sep, rest = path.partition("/")
            if sep:
                subdirs.setdefault(head, {})[rest] = value
            else:
                here.append((head, value[0], value[1]))
        d = re_pb2.Directory(
            files=[
                re_pb2.FileNode(name=n, digest=dg.to_proto(re_pb2.Digest), is_executable=x)
                for n, dg, x in sorted(here)
            ],
            directories=[
                re_pb2.DirectoryNode(name=n, digest=dg.to_proto(re_pb2.Digest))
                for n, dg in sorted((n, build(sub)) for n, sub in subdirs.items())
            ],
        )
        data = serialize(d)
        dg = Digest.of(data)
        blobs[dg] = data
        return dg

    root = build(files)
    return root, blobs


def action_key(
    p: Prepared,
    inputs: dict[str, tuple[Digest, bool]],
    exact: bool,
    manifest: bool = False,
) -> ActionKey:
    """The Action for `p` with `inputs` ({layout path: (digest, executable)})."""
    roots = EXACT if exact else p.roots
    argv = p.argv_exact if exact else p.argv_norm
    env = p.env_exact if exact else p.env_norm
    wd = roots.layout(p.cwd)
    output_rel = sorted(os.path.relpath(path, p.cwd) for path, _ in p.outputs)
    if manifest:
        argv = [KEY_VERSION + "/manifest"] + argv
        output_rel = ["manifest.json"]
    command = re_pb2.Command(
        arguments=argv,
        environment_variables=[re_pb2.Command.EnvironmentVariable(name=k, value=v) for k, v in env],
        working_directory=wd,
        output_paths=output_rel,
    )
    plat = _platform(p, exact, argv, sorted(inputs))
    command.platform.CopyFrom(plat)
    root, blobs = build_tree(inputs)
    action_digest, action_and_command = action_blobs(command, root, plat)
    blobs.update(action_and_command)
    return ActionKey(action_digest, blobs, command, output_rel)
