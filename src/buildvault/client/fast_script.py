"""Scripts that start a client command as `python -IS`: without site-packages processing, which
is about a third of a short Python process's start-up. The fronts of buildvault-cc and
`buildvault run` need only the standard library on their fast paths; whatever needs
site-packages enters it itself (`site.main()`).
"""

from __future__ import annotations

import os
import sys

SCRIPT = """#!{python} -IS
# {name}: started without site-packages processing (written by `{writer}`).
import sys
sys.path.insert(0, {path!r})
{entry}
"""


def install(name: str, writer: str, entry: str, directory: str | None) -> int:
    """Write DIR/NAME (default: beside this command) running `entry`, print its path; 0, or 1 on failure."""
    package_parent = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    directory = directory or os.path.dirname(os.path.abspath(sys.argv[0]))
    target = os.path.join(directory, name)
    text = SCRIPT.format(python=sys.executable, name=name, writer=writer, path=package_parent, entry=entry)
    try:
        with open(target) as f:
            if f.read() == text:
                print(target)
                return 0
    except OSError:
        pass
    tmp = f"{target}.{os.getpid()}.tmp"
    try:
        os.makedirs(directory, exist_ok=True)
        with open(tmp, "w") as f:
            f.write(text)
        os.chmod(tmp, 0o755)
        os.replace(tmp, target)
    except OSError as e:
        print(f"{writer}: cannot write {target}: {e}", file=sys.stderr)
        return 1
    print(target)
    return 0
