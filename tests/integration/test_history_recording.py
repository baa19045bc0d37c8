"""Every ActionCache lookup and update and every ByteStream transfer is recorded with the caller's
RequestMetadata and its outcome; a malformed header is recorded as such and fails nothing."""

from __future__ import annotations

import grpc
import pytest
from reapi_client import digest, read, write

from buildvault.history.metadata import METADATA_KEY, metadata_header
from buildvault.remote_apis import re_pb2


def _header(invocation: str, target: str) -> list[tuple[str, bytes]]:
    return [metadata_header(tool="bazel", tool_version="4.2.3", invocation=invocation, target=target,
                            mnemonic="CppCompile", action_id="act", configuration="k8")]  # fmt: skip


async def test_action_cache_calls_and_transfers_are_recorded_with_their_metadata(app_server) -> None:
    stubs = app_server.stubs
    action = digest(b"the action")
    get = re_pb2.GetActionResultRequest(action_digest=action)
    meta = _header("inv-a", "//pkg:lib")
    with pytest.raises(grpc.aio.AioRpcError) as missed:
        await stubs.ac.GetActionResult(get, metadata=meta)
    assert missed.value.code() == grpc.StatusCode.NOT_FOUND
    await stubs.ac.UpdateActionResult(
        re_pb2.UpdateActionResultRequest(action_digest=action, action_result=re_pb2.ActionResult(exit_code=0)),
        metadata=meta,
    )
    await stubs.ac.GetActionResult(get, metadata=meta)
    data = b"x" * 5000
    await write(stubs, data)
    assert await read(stubs, digest(data)) == data
    # A header that is not a RequestMetadata message: the call is served as if none were sent.
    await stubs.ac.GetActionResult(get, metadata=[(METADATA_KEY, b"\xff\x00garbage")])

    recorder = app_server.app.services.history
    await recorder.flush()
    rows = recorder.store.requests_of("inv-a")
    assert [(r.method, r.outcome) for r in rows] == [("ac_get", "miss"), ("ac_update", "upload"), ("ac_get", "hit")]
    seen = {(r.target, r.mnemonic, r.tool, r.configuration) for r in rows}
    assert seen == {("//pkg:lib", "CppCompile", "bazel", "k8")}
    assert rows[0].digest == f"{action.hash}/{action.size_bytes}"
    summary = recorder.store.invocation("inv-a")
    assert summary is not None and (summary.hits, summary.misses, summary.uploads) == (1, 1, 1)
    transfers = recorder.store.requests_for(f"{digest(data).hash}/5000")
    assert sorted((r.method, r.outcome, r.bytes) for r in transfers) == [("read", "download", 5000),
                                                                       ("write", "upload", 5000)]  # fmt: skip
    malformed = [r for r in recorder.store.requests_for(rows[0].digest) if r.malformed]
    assert [(r.outcome, r.invocation) for r in malformed] == [("hit", "")]
