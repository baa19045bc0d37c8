"""Where a compile's outputs go: private temporary paths, then a checked move into place.

On a miss the compiler writes to temporary names the launcher owns (beside the real outputs,
so the move is a rename on the same filesystem); the agent reads those bytes for the cache and
then renames them into place. A concurrent compile writing the same output path can therefore
never change what is stored. An output path that is not a plain file path (a symlink, a device,
a directory, a hard link, or in a missing directory) is not cached at all: the compiler runs
untouched. A hit writes only over a regular file or nothing. Stdlib only.
"""

from __future__ import annotations

import contextlib
import os
import stat

from .compile_args import Compile


class OutputChanged(Exception):
    """An output path stopped being a plain file path while the compile ran."""


def unusable(path: str) -> str | None:
    """Why the launcher must not write `path` itself, or None when it may (absent or a lone regular file)."""
    if not os.path.isdir(os.path.dirname(path) or "."):
        return "output-dir-missing"
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    except OSError as e:
        return f"output-unreadable: {e.strerror}"
    if stat.S_ISLNK(st.st_mode):
        return "output-is-a-symlink"
    if not stat.S_ISREG(st.st_mode):
        return "output-not-a-regular-file"
    if st.st_nlink > 1:
        return "output-hard-linked"  # the compiler would write through to the other names
    return None


def temp_name(path: str, token: str) -> str:
    return os.path.join(os.path.dirname(path), f".{os.path.basename(path)}.bv-{token}.tmp")


def private_argv(
    c: Compile, outputs: list[tuple[str, str]], token: str, tmp_dir: str
) -> tuple[list[str], dict[str, str], str]:
    """The command line that writes every output of `c` to a temp name, {final path: temp path}, and
    where the dependency list will be (without a user dependency file, one is added in `tmp_dir`)."""
    temps = {path: temp_name(path, token) for path, _ in outputs}
    by_kind = {kind: path for path, kind in outputs}
    obj_tmp = temps[by_kind["obj"]]
    argv = [c.argv[0]]
    args = c.argv[1:]
    i = 0
    have_o = have_mf = False
    while i < len(args):
        arg = args[i]
        if arg in ("-o", "-MF") and i + 1 < len(args):
            if arg == "-o":
                argv += ["-o", obj_tmp]
                have_o = True
            else:
                argv += ["-MF", temps[by_kind["dep"]]]
                have_mf = True
            i += 2
            continue
        if arg.startswith("-o") and len(arg) > 2:
            argv.append("-o" + obj_tmp)
            have_o = True
        elif arg.startswith("-MF") and len(arg) > 3:
            argv.append("-MF" + temps[by_kind["dep"]])
            have_mf = True
        else:
            argv.append(arg)
        i += 1
    if not have_o:
        argv += ["-o", obj_tmp]
    if "dep" in by_kind:
        if not have_mf:
            argv += ["-MF", temps[by_kind["dep"]]]
        if not c.dep_target_given:
            argv += ["-MQ", c.output]  # the target the compiler would have named: the -o value
        return argv, temps, temps[by_kind["dep"]]
    depfile = os.path.join(tmp_dir, f"{token}.d")
    return [*argv, "-MD", "-MF", depfile], temps, depfile


def read_temps(temps: dict[str, str]) -> dict[str, bytes]:
    """{final path: bytes the compiler wrote to its temp name} (OSError if one is missing)."""
    out = {}
    for final, tmp in temps.items():
        with open(tmp, "rb") as f:
            out[final] = f.read()
    return out


def move_into_place(temps: dict[str, str]) -> None:
    """Rename every temp that exists onto its final path (as a failed compile leaves its depfile).

    Raises OutputChanged (and removes the temps) if a final path is no longer a plain file path."""
    if any(unusable(final) for final in temps):
        discard(temps)
        raise OutputChanged(", ".join(f"{final}: {unusable(final)}" for final in temps if unusable(final)))
    for final, tmp in temps.items():
        if os.path.lexists(tmp):
            os.replace(tmp, final)


def discard(temps: dict[str, str]) -> None:
    for tmp in temps.values():
        with contextlib.suppress(OSError):
            os.unlink(tmp)


def write_output(path: str, data: bytes, executable: bool, token: str) -> None:
    """Write a hit's output: atomically, only over a regular file or nothing, never creating a dir."""
    reason = unusable(path)
    if reason:
        raise OutputChanged(f"{path}: {reason}")
    tmp = temp_name(path, token)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o777 if executable else 0o666)
    try:
        view = memoryview(data)
        while view:
            n = os.write(fd, view)
            view = view[n:]
    except BaseException:
        os.close(fd)
        os.unlink(tmp)
        raise
    os.close(fd)
    os.replace(tmp, path)
