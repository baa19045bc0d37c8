"""ActionCache semantics (buildvault.actions) over the memory stores."""

from __future__ import annotations

import pytest

from buildvault.actions import (
    ActionCache,
    EntryKind,
    InvalidActionResult,
    MissingBlobs,
    read_blob,
)
from buildvault.digest import Digest, DigestFunction, InvalidDigest
from buildvault.remote_apis import re_pb2
from buildvault.storage import REQUEST_PROTOCOL, EmptyBlobStore, NotFound, ac_namespace, is_empty_blob
from buildvault.storage.memory import MemoryActionStore, MemoryBlobStore

B3 = DigestFunction.BLAKE3


async def chunks(data: bytes):
    yield data


def pd(data: bytes, function: DigestFunction = DigestFunction.SHA256) -> re_pb2.Digest:
    d = Digest.of(data, function)
    return re_pb2.Digest(hash=d.hash, size_bytes=d.size_bytes)


@pytest.fixture
def stores():
    return MemoryBlobStore(), MemoryActionStore()


def over_stack(blobs: MemoryBlobStore) -> EmptyBlobStore:
    """The CAS as the server's stack hands it to the ActionCache: with the empty-blob rule."""
    return EmptyBlobStore(blobs)


@pytest.fixture
def cache(stores):
    blobs, actions = stores
    return ActionCache(over_stack(blobs), actions)


async def put(blobs: MemoryBlobStore, *items: bytes, function=DigestFunction.SHA256) -> None:
    for item in items:
        await blobs.write(Digest.of(item, function), chunks(item))


def drop(blobs: MemoryBlobStore, data: bytes, function=DigestFunction.SHA256) -> None:
    assert blobs.evict([Digest.of(data, function)]) == 1


ACTION = Digest.of(b"some action")


async def test_update_then_get(cache, stores):
    blobs, _ = stores
    await put(blobs, b"out", b"stdout")
    result = re_pb2.ActionResult(
        output_files=[re_pb2.OutputFile(path="a/out", digest=pd(b"out"))], stdout_digest=pd(b"stdout"), exit_code=2
    )
    assert await cache.update("", ACTION, result) == result
    assert await cache.get("", ACTION) == result


async def test_get_missing_entry(cache):
    with pytest.raises(NotFound):
        await cache.get("", ACTION)


async def test_update_reports_every_missing_blob(cache, stores):
    blobs, actions = stores
    await put(blobs, b"here")
    result = re_pb2.ActionResult(
        output_files=[
            re_pb2.OutputFile(path="here", digest=pd(b"here")),
            re_pb2.OutputFile(path="gone1", digest=pd(b"gone1")),
            re_pb2.OutputFile(path="gone1-again", digest=pd(b"gone1")),
        ],
        stderr_digest=pd(b"gone2"),
    )
    with pytest.raises(MissingBlobs) as e:
        await cache.update("", ACTION, result)
    assert e.value.digests == [Digest.of(b"gone1"), Digest.of(b"gone2")]
    with pytest.raises(NotFound):
        await actions.get(ac_namespace(""), ACTION)  # nothing stored


async def test_get_hides_results_whose_blobs_vanished(cache, stores):
    blobs, _ = stores
    await put(blobs, b"out", b"err")
    result = re_pb2.ActionResult(
        output_files=[re_pb2.OutputFile(path="o", digest=pd(b"out"))], stderr_digest=pd(b"err")
    )
    await cache.update("", ACTION, result)
    drop(blobs, b"err")
    with pytest.raises(NotFound):
        await cache.get("", ACTION)
    await put(blobs, b"err")
    assert await cache.get("", ACTION) == result


def _tree(files: dict[str, bytes], nested: dict[str, bytes]) -> re_pb2.Tree:
    child = re_pb2.Directory(files=[re_pb2.FileNode(name=n, digest=pd(d)) for n, d in nested.items()])
    root = re_pb2.Directory(
        files=[re_pb2.FileNode(name=n, digest=pd(d)) for n, d in files.items()],
        directories=[re_pb2.DirectoryNode(name="child", digest=pd(child.SerializeToString()))],
    )
    return re_pb2.Tree(root=root, children=[child])


async def test_tree_files_are_checked(cache, stores):
    blobs, _ = stores
    tree = _tree({"a": b"A"}, {"b": b"B"})
    tree_bytes = tree.SerializeToString()
    result = re_pb2.ActionResult(output_directories=[re_pb2.OutputDirectory(path="out", tree_digest=pd(tree_bytes))])
    with pytest.raises(MissingBlobs) as e:
        await cache.update("", ACTION, result)
    assert e.value.digests == [Digest.of(tree_bytes)]  # files are only known once the tree is there
    await put(blobs, tree_bytes, b"A")
    with pytest.raises(MissingBlobs) as e:
        await cache.update("", ACTION, result)
    assert e.value.digests == [Digest.of(b"B")]
    await put(blobs, b"B")
    await cache.update("", ACTION, result)
    assert await cache.get("", ACTION) == result
    drop(blobs, b"B")  # a file deep inside a tree vanishes: the result is not served
    with pytest.raises(NotFound):
        await cache.get("", ACTION)
    await put(blobs, b"B")
    drop(blobs, tree_bytes)
    with pytest.raises(NotFound):
        await cache.get("", ACTION)


async def test_tree_that_is_not_a_tree(cache, stores):
    blobs, _ = stores
    junk = b"\xff\xfe not a tree"
    await put(blobs, junk)
    result = re_pb2.ActionResult(output_directories=[re_pb2.OutputDirectory(path="o", tree_digest=pd(junk))])
    with pytest.raises(InvalidActionResult):
        await cache.update("", ACTION, result)


async def test_tree_with_bad_file_digest(cache, stores):
    blobs, _ = stores
    bad_file = re_pb2.FileNode(name="f", digest=re_pb2.Digest(hash="x", size_bytes=1))
    tree = re_pb2.Tree(root=re_pb2.Directory(files=[bad_file]))
    await put(blobs, tree.SerializeToString())
    result = re_pb2.ActionResult(
        output_directories=[re_pb2.OutputDirectory(path="o", tree_digest=pd(tree.SerializeToString()))]
    )
    with pytest.raises(InvalidActionResult):
        await cache.update("", ACTION, result)


async def test_root_directory_digest_walk(cache, stores):
    blobs, _ = stores
    leaf = re_pb2.Directory(files=[re_pb2.FileNode(name="f", digest=pd(b"F"))])
    mid = re_pb2.Directory(directories=[re_pb2.DirectoryNode(name="leaf", digest=pd(leaf.SerializeToString()))])
    root = re_pb2.Directory(
        directories=[
            re_pb2.DirectoryNode(name="m1", digest=pd(mid.SerializeToString())),
            re_pb2.DirectoryNode(name="m2", digest=pd(mid.SerializeToString())),
        ]
    )
    result = re_pb2.ActionResult(
        output_directories=[re_pb2.OutputDirectory(path="o", root_directory_digest=pd(root.SerializeToString()))]
    )
    await put(blobs, root.SerializeToString())
    with pytest.raises(MissingBlobs) as e:
        await cache.update("", ACTION, result)
    assert e.value.digests == [Digest.of(mid.SerializeToString())]
    await put(blobs, mid.SerializeToString(), leaf.SerializeToString())
    with pytest.raises(MissingBlobs) as e:
        await cache.update("", ACTION, result)
    assert e.value.digests == [Digest.of(b"F")]
    await put(blobs, b"F")
    await cache.update("", ACTION, result)
    assert await cache.get("", ACTION) == result


async def test_inlining_and_budget(stores):
    blobs, _ = stores
    cache = ActionCache(over_stack(stores[0]), stores[1], inline_budget=160)  # each inlined field costs its size + 16
    big, small = b"b" * 100, b"s" * 10
    await put(blobs, big, small, b"out!", b"err!")
    result = re_pb2.ActionResult(
        output_files=[re_pb2.OutputFile(path="big", digest=pd(big)), re_pb2.OutputFile(path="small", digest=pd(small))],
        stdout_digest=pd(b"out!"),
        stderr_digest=pd(b"err!"),
    )
    await cache.update("", ACTION, result)
    got = await cache.get("", ACTION, inline_stdout=True, inline_stderr=True, inline_output_files=["big", "small"])
    assert got.stdout_raw == b"out!" and got.stderr_raw == b"err!"
    assert got.output_files[0].contents == big and got.output_files[1].contents == b""  # over budget
    got = await cache.get("", ACTION, inline_output_files=["small", "nonexistent"])
    assert [f.contents for f in got.output_files] == [b"", small] and not got.stdout_raw


async def test_message_limit_caps_inlining(stores):
    blobs, _ = stores
    cache = ActionCache(over_stack(stores[0]), stores[1], inline_budget=1 << 30, message_limit=100_000)
    data = b"x" * 90_000
    await put(blobs, data)
    await cache.update("", ACTION, re_pb2.ActionResult(output_files=[re_pb2.OutputFile(path="f", digest=pd(data))]))
    got = await cache.get("", ACTION, inline_output_files=["f"])
    assert got.output_files[0].contents == b""


async def test_update_moves_raw_bytes_into_the_cas(cache, stores):
    blobs, _ = stores
    result = re_pb2.ActionResult(
        output_files=[re_pb2.OutputFile(path="f", contents=b"file"), re_pb2.OutputFile(path="g", contents=b"")],
        stdout_raw=b"out",
        stderr_raw=b"err",
        stderr_digest=pd(b"err"),
    )
    result.output_files[1].digest.CopyFrom(pd(b""))
    stored = await cache.update("", ACTION, result)
    assert not stored.stdout_raw and not stored.stderr_raw and not stored.output_files[0].contents
    assert stored.output_files[0].digest == pd(b"file") and stored.stdout_digest == pd(b"out")
    assert await blobs.find_missing([Digest.of(b"file"), Digest.of(b"out"), Digest.of(b"err")]) == []
    assert result.stdout_raw == b"out"  # the caller's message is not modified


@pytest.mark.parametrize(
    "result,error",
    [
        (re_pb2.ActionResult(stdout_raw=b"abc", stdout_digest=pd(b"abd")), InvalidActionResult),
        (
            re_pb2.ActionResult(output_files=[re_pb2.OutputFile(path="f", contents=b"a", digest=pd(b"b"))]),
            InvalidActionResult,
        ),
        (re_pb2.ActionResult(output_files=[re_pb2.OutputFile(path="f")]), InvalidDigest),
        (
            re_pb2.ActionResult(output_files=[re_pb2.OutputFile(path="f", digest=re_pb2.Digest(hash="z" * 64))]),
            InvalidDigest,
        ),
        (re_pb2.ActionResult(output_files=[re_pb2.OutputFile(path="/abs", digest=pd(b""))]), InvalidActionResult),
        (re_pb2.ActionResult(output_files=[re_pb2.OutputFile(path="a//b", digest=pd(b""))]), InvalidActionResult),
        (re_pb2.ActionResult(output_files=[re_pb2.OutputFile(path="a/", digest=pd(b""))]), InvalidActionResult),
        (re_pb2.ActionResult(output_directories=[re_pb2.OutputDirectory(path="d")]), InvalidActionResult),
        (re_pb2.ActionResult(output_symlinks=[re_pb2.OutputSymlink(path="l")]), InvalidActionResult),
        (re_pb2.ActionResult(output_file_symlinks=[re_pb2.OutputSymlink(path="", target="t")]), InvalidActionResult),
        (re_pb2.ActionResult(stderr_digest=re_pb2.Digest(hash="a" * 64, size_bytes=-2)), InvalidDigest),
    ],
)
async def test_update_validation(cache, result, error):
    with pytest.raises(error):
        await cache.update("", ACTION, result)


async def test_instances_and_functions_are_separate(cache):
    result = re_pb2.ActionResult(exit_code=7)
    await cache.update("a", ACTION, result)
    assert await cache.get("a", ACTION) == result
    for instance in ("", "b", "a/b"):
        with pytest.raises(NotFound):
            await cache.get(instance, ACTION)
    blake = Digest(ACTION.hash, ACTION.size_bytes, B3)
    with pytest.raises(NotFound):
        await cache.get("a", blake)


@pytest.mark.parametrize("instance", ["../x", "a//b", "/a", "blobs", "a/uploads", "x" * 300, "a b"])
async def test_bad_instance_names(cache, instance):
    with pytest.raises(InvalidDigest):
        await cache.get(instance, ACTION)
    with pytest.raises(InvalidDigest):
        await cache.update(instance, ACTION, re_pb2.ActionResult())


async def test_blake3_results(cache, stores):
    blobs, _ = stores
    await put(blobs, b"out", function=B3)
    action = Digest.of(b"action", B3)
    result = re_pb2.ActionResult(output_files=[re_pb2.OutputFile(path="o", digest=pd(b"out", B3))])
    await cache.update("", action, result)
    assert await cache.get("", action) == result
    sha_result = re_pb2.ActionResult(output_files=[re_pb2.OutputFile(path="o", digest=pd(b"out"))])
    with pytest.raises(MissingBlobs):
        await cache.update("", Digest.of(b"action"), sha_result)


async def test_corrupt_entry_is_a_miss(cache, stores):
    _, actions = stores
    await actions.put(ac_namespace(""), ACTION, b"\xff\xff\xff\xff")
    with pytest.raises(NotFound):
        await cache.get("", ACTION)


async def test_empty_blobs_are_always_present(cache, stores):
    """The empty-blob rule is the stack's (storage.EmptyBlobStore); the ActionCache relies on it."""
    blobs = over_stack(stores[0])
    empty = Digest.of(b"")
    assert is_empty_blob(empty) and is_empty_blob(Digest.of(b"", B3))
    assert not is_empty_blob(Digest("0" * 64, 0))
    assert await blobs.find_missing([empty]) == []
    assert await read_blob(blobs, empty) == b""
    result = re_pb2.ActionResult(output_files=[re_pb2.OutputFile(path="e", digest=pd(b""))], stdout_digest=pd(b""))
    await cache.update("", ACTION, result)
    assert await cache.get("", ACTION, inline_stdout=True) == result


async def test_read_blob_guards_size(stores):
    blobs, _ = stores
    await put(blobs, b"x" * 100)
    with pytest.raises(InvalidActionResult):
        await read_blob(blobs, Digest.of(b"x" * 100), max_size=10)
    assert await read_blob(blobs, Digest.of(b"x" * 100), max_size=100) == b"x" * 100


def test_missing_blobs_message():
    error = MissingBlobs([Digest.of(bytes([i])) for i in range(5)])
    assert "5 referenced blob(s)" in str(error) and "and 2 more" in str(error)


# -- entries as bytes (bazel-remote HTTP PUT/GET /ac/) ----------------------------------------------

SHA = DigestFunction.SHA256


def result_bytes(*outputs: bytes) -> bytes:
    result = re_pb2.ActionResult(
        output_files=[re_pb2.OutputFile(path=f"out{i}", digest=pd(data)) for i, data in enumerate(outputs)]
    )
    return result.SerializeToString()


async def test_classify_entry(cache, stores):
    blobs, _ = stores
    await put(blobs, b"present")
    assert await cache.classify_entry(result_bytes(b"present"), SHA) is EntryKind.COMPLETE
    assert await cache.classify_entry(result_bytes(b"present", b"absent"), SHA) is EntryKind.INCOMPLETE
    assert await cache.classify_entry(b"\xff\xfe not a protobuf", SHA) is EntryKind.OPAQUE
    bad_path = re_pb2.ActionResult(output_files=[re_pb2.OutputFile(path="/abs", digest=pd(b"present"))])
    assert await cache.classify_entry(bad_path.SerializeToString(), SHA) is EntryKind.OPAQUE
    bad_digest = re_pb2.ActionResult(output_files=[re_pb2.OutputFile(path="x", digest=re_pb2.Digest(hash="zz"))])
    assert await cache.classify_entry(bad_digest.SerializeToString(), SHA) is EntryKind.OPAQUE


async def test_store_entry_puts_complete_results_where_grpc_reads_them(cache, stores):
    blobs, actions = stores
    await put(blobs, b"present")
    complete = result_bytes(b"present")
    assert await cache.store_entry("i", ACTION, complete) is EntryKind.COMPLETE
    assert await actions.get(ac_namespace("i"), ACTION) == complete  # byte-for-byte
    assert (await cache.get("i", ACTION)).output_files[0].path == "out0"  # what GetActionResult serves
    with pytest.raises(NotFound):
        await actions.get(ac_namespace("i", "raw"), ACTION)


@pytest.mark.parametrize("kind", ["opaque", "incomplete"])
async def test_store_entry_keeps_everything_else_raw(cache, stores, kind):
    _, actions = stores
    data = b"\xff\xfe a ccache entry" if kind == "opaque" else result_bytes(b"not uploaded yet")
    assert (await cache.store_entry("i", ACTION, data)).value == kind
    assert await actions.get(ac_namespace("i", "raw"), ACTION) == data
    with pytest.raises(NotFound):
        await actions.get(ac_namespace("i"), ACTION)
    with pytest.raises(NotFound):
        await cache.get("i", ACTION)  # gRPC never sees raw entries


async def test_lookup_entry(cache, stores):
    blobs, _ = stores
    assert await cache.lookup_entry("i", ACTION) is None
    await cache.store_entry("i", ACTION, b"\xff raw bytes")
    assert await cache.lookup_entry("i", ACTION) == b"\xff raw bytes"
    assert await cache.lookup_entry("other", ACTION) is None  # instances are apart
    early = result_bytes(b"late blob")
    await cache.store_entry("i", ACTION, early)  # raw: its blob is not there yet
    assert await cache.lookup_entry("i", ACTION) is None  # never served incomplete
    await put(blobs, b"late blob")
    assert await cache.lookup_entry("i", ACTION) == early  # complete now


async def test_lookup_entry_prefers_a_complete_real_entry_and_hides_a_broken_one(cache, stores):
    blobs, _ = stores
    await put(blobs, b"out")
    real = result_bytes(b"out")
    await cache.store_entry("i", ACTION, real)
    assert await cache.lookup_entry("i", ACTION) == real
    drop(blobs, b"out")
    assert await cache.lookup_entry("i", ACTION) is None  # its blob is gone: a miss
    await cache.store_entry("i", ACTION, b"\xff opaque replacement")  # lands in raw
    assert await cache.lookup_entry("i", ACTION) == b"\xff opaque replacement"


class Lookups:
    """A LookupRecorder that keeps what it is told."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, bool]] = []

    def ac_lookup(self, protocol: str, hit: bool) -> None:
        self.seen.append((protocol, hit))


async def test_client_lookups_are_counted_once_by_protocol(stores):
    blobs, actions = stores
    lookups = Lookups()
    cache = ActionCache(over_stack(blobs), actions, recorder=lookups)
    await put(blobs, b"out")
    result = re_pb2.ActionResult(output_files=[re_pb2.OutputFile(path="out", digest=pd(b"out"))])
    await cache.update("", ACTION, result)
    await actions.put(ac_namespace("", "raw"), Digest.of(b"raw key"), b"ccache entry")
    token = REQUEST_PROTOCOL.set("grpc")
    try:
        assert await cache.get("", ACTION, counted=True) == result  # hit
        with pytest.raises(NotFound):
            await cache.get("", Digest.of(b"absent"), counted=True)  # miss
        await cache.get("", ACTION)  # Execute's own cache check: not a client's lookup
        drop(blobs, b"out")
        with pytest.raises(NotFound):
            await cache.get("", ACTION, counted=True)  # incomplete: a miss
        with pytest.raises(InvalidDigest):
            await cache.get("../x", ACTION, counted=True)  # a bad request: neither
    finally:
        REQUEST_PROTOCOL.reset(token)
    token = REQUEST_PROTOCOL.set("http")
    try:
        assert await cache.lookup_entry("", Digest.of(b"raw key"), counted=True) == b"ccache entry"
        assert await cache.lookup_entry("", Digest.of(b"absent"), counted=True) is None
        assert await cache.lookup_entry("", Digest.of(b"raw key")) == b"ccache entry"  # HEAD: not counted
    finally:
        REQUEST_PROTOCOL.reset(token)
    assert await cache.lookup_entry("", Digest.of(b"raw key"), counted=True) == b"ccache entry"  # no front end
    assert lookups.seen == [("grpc", True), ("grpc", False), ("grpc", False), ("http", True), ("http", False)]
