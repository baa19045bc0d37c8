"""Regenerate the committed protobuf/gRPC modules under ``buildvault.remote_apis``.

Usage::

    python -m buildvault.remote_apis.regen           # rewrite generated files in place
    python -m buildvault.remote_apis.regen --check   # exit 1 and list stale files

Generation uses ``grpc_tools.protoc`` (pinned in the ``dev`` extra) with
``proto_path = src`` so the generated imports read
``from buildvault.remote_apis.build.bazel.semver import semver_pb2``.

Include paths:

* ``src`` -- our own .proto files;
* ``grpc_tools/_proto`` -- ``google/protobuf/*.proto`` well-known types;
* a temporary directory holding the googleapis protos we depend on
  (``google/longrunning``, ``google/rpc``, ``google/api``), copied out of the
  installed ``googleapis-common-protos`` wheel.  That wheel ships the
  long-running-operations schema as ``google/longrunning/operations_proto.proto``
  (its *registered* name is still ``google/longrunning/operations.proto``), so
  it is staged under the canonical name that our import statement uses.

protoc output depends only on the inputs and the protoc version, so the result
is byte-for-byte reproducible for a given ``grpcio-tools`` release.
"""

from __future__ import annotations

import argparse
import filecmp
import importlib.util
import re
import shutil
import sys
import tempfile
from pathlib import Path

if __name__ == "__main__" and not __package__:
    # Run as a plain script (bootstrap path): Python put this directory first on
    # sys.path, and its ``google``/``build`` sub-packages would shadow the real
    # top-level ``google`` namespace package.
    _HERE = Path(__file__).resolve().parent
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]

#: ``src`` directory (the proto_path root of our own files).
SRC_ROOT = Path(__file__).resolve().parents[2]

#: Our .proto files, relative to :data:`SRC_ROOT`.
PROTOS: tuple[str, ...] = (
    "buildvault/remote_apis/build/bazel/semver/semver.proto",
    "buildvault/remote_apis/build/bazel/remote/execution/v2/remote_execution.proto",
    "buildvault/remote_apis/build/bazel/remote/asset/v1/remote_asset.proto",
    "buildvault/remote_apis/google/bytestream/bytestream.proto",
    "buildvault/remote_apis/google/devtools/build/v1/build_status.proto",
    "buildvault/remote_apis/google/devtools/build/v1/build_events.proto",
    "buildvault/remote_apis/google/devtools/build/v1/publish_build_event.proto",
    "buildvault/remote_apis/build_event_stream/build_event_stream.proto",
)

#: Suffixes protoc emits for each .proto (python, pyi stub, grpc plugin).
GENERATED_SUFFIXES: tuple[str, ...] = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")

#: googleapis protos imported directly by our files.
_GOOGLEAPIS_ROOTS: tuple[str, ...] = (
    "google/longrunning/operations.proto",
    "google/rpc/status.proto",
)

#: Alternative on-disk names used by googleapis-common-protos.
_GOOGLEAPIS_ALIASES: dict[str, tuple[str, ...]] = {
    "google/longrunning/operations.proto": ("operations_proto.proto",),
}

_IMPORT_RE = re.compile(r'^\s*import\s+(?:public\s+|weak\s+)?"([^"]+)"\s*;', re.MULTILINE)


class RegenError(RuntimeError):
    """Generation could not run (missing tool or proto, protoc failure)."""


def generated_files() -> list[Path]:
    """Paths (relative to ``src``) of every file the generator owns."""
    out: list[Path] = []
    for proto in PROTOS:
        stem = proto[: -len(".proto")]
        out.extend(Path(stem + suffix) for suffix in GENERATED_SUFFIXES)
    return out


def _grpc_tools_include() -> Path:
    try:
        import grpc_tools  # optional dev dependency: imported only when regenerating
    except ImportError as exc:  # pragma: no cover - environment problem
        raise RegenError(
            "grpc_tools is not installed; install the 'dev' extra "
            "(pip install -e '.[dev]')"
        ) from exc
    include = Path(grpc_tools.__file__).resolve().parent / "_proto"
    if not (include / "google/protobuf/descriptor.proto").is_file():
        raise RegenError(f"grpc_tools well-known protos not found under {include}")
    return include


def _package_dirs(package: str) -> list[Path]:
    try:
        spec = importlib.util.find_spec(package)
    except ModuleNotFoundError:
        return []
    if spec is None or not spec.submodule_search_locations:
        return []
    return [Path(p) for p in spec.submodule_search_locations]


def _locate_googleapis_proto(rel: str) -> Path:
    """Find ``rel`` (e.g. ``google/api/http.proto``) in googleapis-common-protos."""
    rel_path = Path(rel)
    package = ".".join(rel_path.parent.parts)
    names = (rel_path.name, *_GOOGLEAPIS_ALIASES.get(rel, ()))
    for directory in _package_dirs(package):
        for name in names:
            candidate = directory / name
            if candidate.is_file():
                return candidate
    raise RegenError(
        f"cannot find {rel} (looked for {', '.join(names)} in package {package}); "
        "is googleapis-common-protos installed?"
    )


def _stage_googleapis(dest: Path) -> None:
    """Copy the transitive googleapis proto deps into ``dest`` under canonical names."""
    pending = list(_GOOGLEAPIS_ROOTS)
    seen: set[str] = set()
    while pending:
        rel = pending.pop()
        if rel in seen:
            continue
        seen.add(rel)
        source = _locate_googleapis_proto(rel)
        target = dest / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(source, target)
        for dep in _IMPORT_RE.findall(source.read_text(encoding="utf-8")):
            if not dep.startswith("google/protobuf/"):
                pending.append(dep)


def generate(out_dir: Path) -> None:
    """Run protoc for all of :data:`PROTOS`, writing into ``out_dir``."""
    for proto in PROTOS:
        if not (SRC_ROOT / proto).is_file():
            raise RegenError(f"missing proto source {SRC_ROOT / proto}")
    wkt_include = _grpc_tools_include()
    from grpc_tools import protoc

    with tempfile.TemporaryDirectory(prefix="buildvault-googleapis-") as staging:
        staging_dir = Path(staging)
        _stage_googleapis(staging_dir)
        args = [
            "grpc_tools.protoc",
            f"--proto_path={SRC_ROOT}",
            f"--proto_path={staging_dir}",
            f"--proto_path={wkt_include}",
            f"--python_out={out_dir}",
            f"--pyi_out={out_dir}",
            f"--grpc_python_out={out_dir}",
            *PROTOS,
        ]
        rc = protoc.main(args)
    if rc != 0:
        raise RegenError(f"protoc failed with exit code {rc}")
    missing = [str(p) for p in generated_files() if not (out_dir / p).is_file()]
    if missing:
        raise RegenError(f"protoc did not produce: {', '.join(missing)}")


def stale_files() -> list[Path]:
    """Generate into a temp dir; return committed files that differ or are absent."""
    with tempfile.TemporaryDirectory(prefix="buildvault-regen-") as tmp:
        tmp_dir = Path(tmp)
        generate(tmp_dir)
        stale: list[Path] = []
        for rel in generated_files():
            committed = SRC_ROOT / rel
            if not committed.is_file() or not filecmp.cmp(committed, tmp_dir / rel, shallow=False):
                stale.append(rel)
        return stale


def regenerate() -> list[Path]:
    """Regenerate in place; return the files whose contents changed."""
    with tempfile.TemporaryDirectory(prefix="buildvault-regen-") as tmp:
        tmp_dir = Path(tmp)
        generate(tmp_dir)
        changed: list[Path] = []
        for rel in generated_files():
            fresh = tmp_dir / rel
            target = SRC_ROOT / rel
            if target.is_file() and filecmp.cmp(target, fresh, shallow=False):
                continue
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(fresh, target)
            changed.append(rel)
        return changed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m buildvault.remote_apis.regen",
        description="Regenerate buildvault's REAPI / ByteStream protobuf modules.",
    )
    parser.add_argument(
        "--check",
        action="store_true",
        help="generate into a temporary directory and fail if committed files are stale",
    )
    args = parser.parse_args(argv)
    try:
        if args.check:
            stale = stale_files()
            if stale:
                print("stale generated files (run python -m buildvault.remote_apis.regen):")
                for rel in stale:
                    print(f"  src/{rel.as_posix()}")
                return 1
            print(f"{len(generated_files())} generated files are up to date")
            return 0
        changed = regenerate()
    except RegenError as exc:
        print(f"regen: error: {exc}", file=sys.stderr)
        return 2
    for rel in changed:
        print(f"wrote src/{rel.as_posix()}")
    if not changed:
        print("generated files already up to date")
    return 0


if __name__ == "__main__":
    sys.exit(main())
