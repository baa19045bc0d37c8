"""`buildvault-cc --install-native [DIR]`: compile native_launcher.c into DIR/buildvault-cc-native.

The native launcher serves a hit without starting Python: it asks this configuration's agent
and, for anything but a hit, execs buildvault-cc with the same arguments (native_launcher.c).
It must find the agent exactly as launcher.py does, so the values that name the agent's
socket (this Python, the client's directory and its agent modules) are compiled into it; a
reinstalled or upgraded buildvault needs `--install-native` again (until then the old binary
finds no agent of its code and hands every compile to buildvault-cc: slower, never wrong).
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
import tempfile

from .protocol import AGENT_MODULES

NAME = "buildvault-cc-native"


def c_string(text: str) -> str:
    """A C string literal of `text`'s bytes (file system encoding), any byte escaped in octal."""
    out = []
    for byte in os.fsencode(text):
        char = chr(byte)
        out.append(char if 0x20 <= byte < 0x7F and char not in '"\\?' else f"\\{byte:03o}")
    return '"' + "".join(out) + '"'


def config_header(python: str, client_dir: str, modules: tuple[str, ...]) -> str:
    package_parent = os.path.dirname(os.path.dirname(client_dir))
    listed = ", ".join(c_string(m) for m in modules)
    return (
        "/* written by buildvault-cc --install-native */\n"
        f"#define BV_PYTHON {c_string(python)}\n"
        f"#define BV_CLIENT_DIR {c_string(client_dir)}\n"
        f"#define BV_PACKAGE_PARENT {c_string(package_parent)}\n"
        f"static const char *const BV_MODULES[] = {{{listed}, 0}};\n"
    )


def install(directory: str | None) -> int:
    """Build DIR/buildvault-cc-native (default: beside this command) and print its path; 0, or 1."""
    client_dir = os.path.dirname(os.path.abspath(__file__))
    directory = directory or os.path.dirname(os.path.abspath(sys.argv[0]))
    target = os.path.join(directory, NAME)
    compiler = shlex.split(os.environ.get("CC", "")) or [shutil.which("cc") or shutil.which("gcc") or "cc"]
    with tempfile.TemporaryDirectory(prefix="buildvault-native-") as scratch:
        with open(os.path.join(scratch, "bv_config.h"), "w") as f:
            f.write(config_header(sys.executable, client_dir, AGENT_MODULES))
        built = os.path.join(scratch, NAME)
        source = os.path.join(client_dir, "native_launcher.c")
        command = [*compiler, "-O2", "-Wall", "-Wextra", "-I", scratch, "-o", built, source]
        try:
            done = subprocess.run(command, capture_output=True, text=True, check=False)
        except OSError as e:
            print(f"buildvault-cc --install-native: cannot run {compiler[0]}: {e} (set CC)", file=sys.stderr)
            return 1
        if done.returncode != 0:
            print(f"buildvault-cc --install-native: {shlex.join(command)} failed:\n{done.stderr}", file=sys.stderr)
            return 1
        try:
            os.makedirs(directory, exist_ok=True)
            shutil.move(built, target + ".tmp")
            os.replace(target + ".tmp", target)
        except OSError as e:
            print(f"buildvault-cc --install-native: cannot write {target}: {e}", file=sys.stderr)
            return 1
    print(target)
    return 0
