"""ActionCache over a real `buildvault serve`: completeness, inlining, validation, namespaces."""

from __future__ import annotations

import os

import grpc
import pytest
from reapi_client import BLAKE3, SHA256, batch_update, blob, digest, precondition_violations, rich_status, write

from buildvault.remote_apis import re_pb2


def action_digest(function: int = SHA256) -> re_pb2.Digest:
    return digest(re_pb2.Action(salt=os.urandom(16)).SerializeToString(), function)


async def get(stubs, action, instance="", function=SHA256, **inline):
    return await stubs.ac.GetActionResult(
        re_pb2.GetActionResultRequest(instance_name=instance, action_digest=action, digest_function=function, **inline)
    )


async def update(stubs, action, result, instance="", function=SHA256):
    return await stubs.ac.UpdateActionResult(
        re_pb2.UpdateActionResultRequest(
            instance_name=instance, action_digest=action, action_result=result, digest_function=function
        )
    )


def tree_with(files: dict[str, bytes]) -> re_pb2.Tree:
    child = re_pb2.Directory(
        files=[re_pb2.FileNode(name=n, digest=digest(d)) for n, d in sorted(files.items()) if n.startswith("sub_")]
    )
    root = re_pb2.Directory(
        files=[re_pb2.FileNode(name=n, digest=digest(d)) for n, d in sorted(files.items()) if not n.startswith("sub_")],
        directories=[re_pb2.DirectoryNode(name="sub", digest=digest(child.SerializeToString()))],
    )
    return re_pb2.Tree(root=root, children=[child])


async def test_roundtrip_and_miss(stubs):
    out, stdout = blob(1000), b"compiler says hi\n"
    await batch_update(stubs, [out, stdout])
    action = action_digest()
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await get(stubs, action)
    assert e.value.code() == grpc.StatusCode.NOT_FOUND
    result = re_pb2.ActionResult(
        output_files=[re_pb2.OutputFile(path="bazel-out/k8/bin/a.o", digest=digest(out), is_executable=True)],
        stdout_digest=digest(stdout),
        exit_code=0,
    )
    stored = await update(stubs, action, result)
    assert stored == result
    assert await get(stubs, action) == result


async def test_update_with_missing_blobs_is_failed_precondition(stubs):
    present, absent_file, absent_err = blob(10), blob(11), blob(12)
    await batch_update(stubs, [present])
    result = re_pb2.ActionResult(
        output_files=[
            re_pb2.OutputFile(path="a", digest=digest(present)),
            re_pb2.OutputFile(path="b", digest=digest(absent_file)),
        ],
        stderr_digest=digest(absent_err),
    )
    action = action_digest()
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await update(stubs, action, result)
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    violations = precondition_violations(e.value)
    assert sorted(violations) == sorted(
        ("MISSING", f"blobs/{d.hash}/{d.size_bytes}") for d in (digest(absent_file), digest(absent_err))
    )
    assert rich_status(e.value).code == grpc.StatusCode.FAILED_PRECONDITION.value[0]
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await get(stubs, action)
    assert e.value.code() == grpc.StatusCode.NOT_FOUND


async def test_missing_blake3_subject_names_the_function(stubs):
    absent = blob(5)
    result = re_pb2.ActionResult(output_files=[re_pb2.OutputFile(path="a", digest=digest(absent, BLAKE3))])
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await update(stubs, action_digest(BLAKE3), result, function=BLAKE3)
    d = digest(absent, BLAKE3)
    assert precondition_violations(e.value) == [("MISSING", f"blobs/blake3/{d.hash}/{d.size_bytes}")]


async def test_output_directory_completeness(stubs):
    files = {"a.h": blob(100), "sub_b.c": blob(200)}
    tree = tree_with(files)
    tree_bytes = tree.SerializeToString()
    action = action_digest()
    result = re_pb2.ActionResult(
        output_directories=[re_pb2.OutputDirectory(path="gen", tree_digest=digest(tree_bytes))]
    )
    # the tree blob itself is missing
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await update(stubs, action, result)
    assert ("MISSING", f"blobs/{digest(tree_bytes).hash}/{len(tree_bytes)}") in precondition_violations(e.value)
    # the tree is there but a file inside it is not
    await batch_update(stubs, [tree_bytes, files["a.h"]])
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await update(stubs, action, result)
    d = digest(files["sub_b.c"])
    assert precondition_violations(e.value) == [("MISSING", f"blobs/{d.hash}/{d.size_bytes}")]
    await batch_update(stubs, [files["sub_b.c"]])
    assert await update(stubs, action, result) == result
    assert await get(stubs, action) == result


async def test_output_directory_not_a_tree(stubs):
    junk = b"\xff\xff\xff not a protobuf"
    await batch_update(stubs, [junk])
    result = re_pb2.ActionResult(output_directories=[re_pb2.OutputDirectory(path="d", tree_digest=digest(junk))])
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await update(stubs, action_digest(), result)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT


async def test_root_directory_digest_completeness(stubs):
    leaf_file = blob(64)
    leaf = re_pb2.Directory(files=[re_pb2.FileNode(name="f", digest=digest(leaf_file))])
    root = re_pb2.Directory(directories=[re_pb2.DirectoryNode(name="leaf", digest=digest(leaf.SerializeToString()))])
    result = re_pb2.ActionResult(
        output_directories=[re_pb2.OutputDirectory(path="o", root_directory_digest=digest(root.SerializeToString()))]
    )
    await batch_update(stubs, [root.SerializeToString(), leaf.SerializeToString()])
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await update(stubs, action_digest(), result)
    assert precondition_violations(e.value) == [("MISSING", f"blobs/{digest(leaf_file).hash}/64")]
    await batch_update(stubs, [leaf_file])
    await update(stubs, action_digest(), result)


async def test_inline_outputs(stubs):
    out, small, stdout, stderr = blob(100_000), blob(10), b"out\n", b"err\n"
    await batch_update(stubs, [out, small, stdout, stderr])
    action = action_digest()
    result = re_pb2.ActionResult(
        output_files=[
            re_pb2.OutputFile(path="big", digest=digest(out)),
            re_pb2.OutputFile(path="small", digest=digest(small)),
        ],
        stdout_digest=digest(stdout),
        stderr_digest=digest(stderr),
    )
    await update(stubs, action, result)
    plain = await get(stubs, action)
    assert not plain.stdout_raw and not plain.stderr_raw and not any(f.contents for f in plain.output_files)
    inlined = await get(stubs, action, inline_stdout=True, inline_stderr=True, inline_output_files=["small", "big"])
    assert inlined.stdout_raw == stdout and inlined.stderr_raw == stderr
    assert [f.contents for f in inlined.output_files] == [out, small]
    assert inlined.stdout_digest == digest(stdout)  # digests stay
    only = await get(stubs, action, inline_output_files=["small"])
    assert [f.contents for f in only.output_files] == [b"", small] and not only.stdout_raw


async def test_inline_budget_skips_huge_files(stubs):
    huge = blob(6 << 20)
    await write(stubs, huge)
    action = action_digest()
    result = re_pb2.ActionResult(output_files=[re_pb2.OutputFile(path="huge", digest=digest(huge))])
    await update(stubs, action, result)
    got = await get(stubs, action, inline_output_files=["huge"])
    assert got.output_files[0].contents == b""  # over the inline budget: left out, not an error


async def test_update_moves_inline_bytes_to_the_cas(stubs):
    contents, stdout = blob(777), b"inline stdout"
    result = re_pb2.ActionResult(
        output_files=[re_pb2.OutputFile(path="x", contents=contents)],
        stdout_raw=stdout,
    )
    action = action_digest()
    stored = await update(stubs, action, result)
    assert stored.output_files[0].digest == digest(contents) and not stored.output_files[0].contents
    assert stored.stdout_digest == digest(stdout) and not stored.stdout_raw
    got = await get(stubs, action, inline_stdout=True, inline_output_files=["x"])
    assert got.stdout_raw == stdout and got.output_files[0].contents == contents


async def test_update_inline_bytes_must_match_their_digest(stubs):
    result = re_pb2.ActionResult(output_files=[re_pb2.OutputFile(path="x", contents=b"abc", digest=digest(b"abd"))])
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await update(stubs, action_digest(), result)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT


@pytest.mark.parametrize(
    "result",
    [
        re_pb2.ActionResult(output_files=[re_pb2.OutputFile(path="a", digest=re_pb2.Digest(hash="xyz", size_bytes=1))]),
        re_pb2.ActionResult(output_files=[re_pb2.OutputFile(path="a")]),
        re_pb2.ActionResult(output_files=[re_pb2.OutputFile(path="", digest=digest(b""))]),
        re_pb2.ActionResult(output_files=[re_pb2.OutputFile(path="/abs", digest=digest(b""))]),
        re_pb2.ActionResult(output_files=[re_pb2.OutputFile(path="trailing/", digest=digest(b""))]),
        re_pb2.ActionResult(output_directories=[re_pb2.OutputDirectory(path="d")]),
        re_pb2.ActionResult(stdout_digest=re_pb2.Digest(hash="a" * 64, size_bytes=-3)),
        re_pb2.ActionResult(output_symlinks=[re_pb2.OutputSymlink(path="l", target="")]),
    ],
)
async def test_update_invalid_results(stubs, result):
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await update(stubs, action_digest(), result)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, e.value.details()


@pytest.mark.parametrize(
    "action,instance",
    [
        (re_pb2.Digest(hash="nothex", size_bytes=1), ""),
        (re_pb2.Digest(), ""),
        (re_pb2.Digest(hash="a" * 64, size_bytes=-1), ""),
        (None, "../escape"),
        (None, "/abs"),
        (None, "a//b"),
        (None, "blobs"),
        (None, "x" * 300),
    ],
)
async def test_bad_action_digest_or_instance(stubs, action, instance):
    action = action or action_digest()
    for call in (
        get(stubs, action, instance),
        update(stubs, action, re_pb2.ActionResult(), instance),
    ):
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await call
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, e.value.details()


async def test_instances_are_separate(stubs):
    action = action_digest()
    result = re_pb2.ActionResult(exit_code=3)
    await update(stubs, action, result, instance="team-a")
    assert await get(stubs, action, instance="team-a") == result
    for other in ("", "team-b", "team-a/sub"):
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await get(stubs, action, instance=other)
        assert e.value.code() == grpc.StatusCode.NOT_FOUND
    # the same digest under BLAKE3 is another entry
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await get(stubs, re_pb2.Digest(hash=action.hash, size_bytes=action.size_bytes), "team-a", BLAKE3)
    assert e.value.code() == grpc.StatusCode.NOT_FOUND


async def test_symlinks_and_empty_outputs_are_fine(stubs):
    result = re_pb2.ActionResult(
        output_files=[re_pb2.OutputFile(path="empty", digest=digest(b""))],
        output_symlinks=[re_pb2.OutputSymlink(path="link", target="/usr/bin/gcc")],
        output_directories=[
            re_pb2.OutputDirectory(
                path="", tree_digest=digest(re_pb2.Tree(root=re_pb2.Directory()).SerializeToString())
            )
        ],
        exit_code=1,
    )
    tree = re_pb2.Tree(root=re_pb2.Directory()).SerializeToString()
    await batch_update(stubs, [tree] if tree else [])
    action = action_digest()
    assert await update(stubs, action, result) == result
    assert await get(stubs, action) == result
