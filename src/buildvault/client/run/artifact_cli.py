"""The `buildvault artifact` argument parser (argparse only: `buildvault --help` stays light)."""

from __future__ import annotations

import argparse


def add_artifact_parser(commands: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    parser = commands.add_parser("artifact", help="whole-build artifacts under an exact key; golden versions")
    sub = parser.add_subparsers(dest="artifact_command", metavar="ACTION", required=True)

    def common(p: argparse.ArgumentParser, keyed: bool) -> None:
        p.add_argument("--remote", default=None, help="grpc://host:port (default: BUILDVAULT_REMOTE)")
        p.add_argument("--instance", default=None, help="REAPI instance name (default: BUILDVAULT_INSTANCE)")
        p.add_argument("--writer", action="store_true", help="write permission (default: BUILDVAULT_WRITER=1)")
        if keyed:
            p.add_argument("name", help="artifact name")
            p.add_argument(
                "--key-tree",
                action="append",
                default=[],
                metavar="DIR",
                help="tree hashed into the key (git ls-files in a git checkout)",
            )
            p.add_argument("--key-value", action="append", default=[], metavar="K=V", help="a value in the key")
            p.add_argument(
                "--platform",
                action="append",
                default=[],
                metavar="NAME=VALUE,...",
                help="platform properties (arch, toolchain image, ...)",
            )

    p = sub.add_parser("push", help="store PATHS under the exact key")
    common(p, True)
    p.add_argument("--base", default=".", help="PATHS are stored relative to this directory (default: .)")
    p.add_argument("--pin", default=None, metavar="LABEL", help="also pin this version as LABEL")
    p.add_argument("paths", nargs="+", metavar="PATH")
    p = sub.add_parser("pull", help="restore into --dest: exit 0 on a hit, 3 on a miss")
    common(p, True)
    p.add_argument("--dest", required=True, metavar="DIR", help="absent or empty directory")
    p.add_argument("--pinned", default=None, metavar="LABEL", help="restore the version pinned as LABEL")
    p = sub.add_parser("pin", help="pin the artifact with KEY as LABEL (a golden version)")
    common(p, False)
    p.add_argument("name")
    p.add_argument("key", help="HASH/SIZE as push prints it")
    p.add_argument("label")
    p = sub.add_parser("unpin", help="remove pin LABEL")
    common(p, False)
    p.add_argument("name")
    p.add_argument("label")
    p = sub.add_parser("pins", help="list pins: NAME, LABEL, KEY")
    common(p, False)
