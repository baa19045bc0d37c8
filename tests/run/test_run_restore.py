"""restore() in-process: what a cached ActionResult may name, and atomicity of a refused one."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from pathlib import Path

import pytest

from buildvault.client.roots import Roots
from buildvault.client.run.outputs import UnusableResult, clean_relative, collect, restore
from buildvault.digest import Digest
from buildvault.remote_apis import re_pb2


def fetch_from(blobs: dict[Digest, bytes]) -> Callable[[Iterable[Digest]], dict[Digest, bytes]]:
    return lambda digests: {d: blobs[d] for d in digests if d in blobs}


def file_result(path: str, data: bytes) -> tuple[re_pb2.ActionResult, dict[Digest, bytes]]:
    d = Digest.of(data)
    result = re_pb2.ActionResult(output_files=[re_pb2.OutputFile(path=path, digest=d.to_proto(re_pb2.Digest))])
    return result, {d: data}


@pytest.mark.parametrize("path", ["/etc/x", "../x", "a/../../x", "a//b", "./a", "", "a/\0"])
def test_unclean_paths(path: str) -> None:
    assert not clean_relative(path)


@pytest.mark.parametrize("path", ["/abs/out", "../out", "out/../../x"])
def test_absolute_or_escaping_output_is_refused(tmp_path: Path, path: str) -> None:
    work = tmp_path / "work"
    work.mkdir()
    result, blobs = file_result(path, b"evil")
    with pytest.raises(UnusableResult):
        restore(result, str(work), [path], None, Roots([]), fetch_from(blobs))
    assert list(tmp_path.rglob("*")) == [work]


def test_nothing_written_when_one_blob_is_wrong(tmp_path: Path) -> None:
    good, bad = b"good", b"bad!"
    dg, db = Digest.of(good), Digest.of(bad)
    result = re_pb2.ActionResult(output_files=[
        re_pb2.OutputFile(path="a", digest=dg.to_proto(re_pb2.Digest)),
        re_pb2.OutputFile(path="b", digest=db.to_proto(re_pb2.Digest)),
    ])
    with pytest.raises(UnusableResult):
        restore(result, str(tmp_path), ["a", "b"], None, Roots([]), fetch_from({dg: good, db: b"BAD!"}))
    assert list(tmp_path.iterdir()) == []


def test_symlinked_parent_leading_outside_is_refused(tmp_path: Path) -> None:
    work, outside = tmp_path / "work", tmp_path / "outside"
    work.mkdir()
    outside.mkdir()
    (work / "out").symlink_to(outside)
    result, blobs = file_result("out/f", b"data")
    with pytest.raises(UnusableResult):
        restore(result, str(work), ["out/f"], None, Roots([]), fetch_from(blobs))
    assert list(outside.iterdir()) == []


def test_collect_then_restore_round_trip(tmp_path: Path) -> None:
    src, dst = tmp_path / "src", tmp_path / "dst"
    (src / "d" / "e").mkdir(parents=True)
    (src / "d" / "e" / "f").write_bytes(b"\x00\x01")
    (src / "d" / "run.sh").write_text("#!/bin/sh\n")
    (src / "d" / "run.sh").chmod(0o755)
    (src / "d" / "l").symlink_to("e/f")
    (src / "top").write_text("t")
    collected = collect(str(src), ["d", "top"], Roots([]))
    dst.mkdir()
    count = restore(collected.result, str(dst), ["d", "top"], None, Roots([]), fetch_from(collected.blobs))
    assert count == 4
    assert (dst / "d" / "e" / "f").read_bytes() == b"\x00\x01"
    assert (dst / "d" / "run.sh").stat().st_mode & 0o111
    assert (dst / "d" / "l").readlink() == Path("e/f")
    assert (dst / "top").read_text() == "t"
