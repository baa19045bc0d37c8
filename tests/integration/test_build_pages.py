"""The build pages over a server that recorded two invocations of a small build: the invocation
lists its misses, the explanation names what changed (a header, an argument, an environment
variable, a platform property), the action page shows the tree, the result and the downloads;
markup in names is escaped and secrets are masked."""

from __future__ import annotations

import re

import grpc
import pytest
from action_builder import build_action, digest_of, key, upload
from loopback_app import loopback_app
from reapi_client import make_stubs

from buildvault.history.metadata import metadata_header
from buildvault.remote_apis import re_pb2

EVIL = "<img src=x onerror=alert(1)>.h"
SOURCES = {
    "pkg/a.cc": b'#include "pkg/a.h"\nint a() { return A; }\n',
    "pkg/a.h": b"#define A 1\n",
    f"pkg/{EVIL}": b"// evil name\n",
}
ARGS = ["/usr/bin/gcc", "-O2", "-c", "pkg/a.cc", "-o", "bazel-out/k8-fastbuild/bin/pkg/_objs/a/a.o"]
OUT = ["bazel-out/k8-fastbuild/bin/pkg/_objs/a/a.o"]


@pytest.fixture
async def server(tmp_path):
    async with loopback_app(tmp_path) as (app, channel, http):
        yield app, make_stubs(channel), http


async def _run(stubs, built, invocation: str, target: str, output: bytes) -> None:
    """What Bazel with --remote_cache does for one action: look up (miss), run, upload, store."""
    meta = [metadata_header(tool="bazel", tool_version="4.2.3", invocation=invocation, target=target,
                            mnemonic="CppCompile", action_id=built.action.hash)]  # fmt: skip
    with pytest.raises(grpc.aio.AioRpcError) as missed:
        await stubs.ac.GetActionResult(re_pb2.GetActionResultRequest(action_digest=built.action), metadata=meta)
    assert missed.value.code() == grpc.StatusCode.NOT_FOUND
    await upload(stubs, {**built.blobs, digest_of(output).hash: output})
    result = re_pb2.ActionResult(exit_code=0, stdout_raw=b"compiled <ok>\n")
    result.output_files.add(path=OUT[0], digest=digest_of(output))
    result.execution_metadata.worker = "worker-<1>"
    await stubs.ac.UpdateActionResult(
        re_pb2.UpdateActionResultRequest(action_digest=built.action, action_result=result), metadata=meta
    )


async def _text(http, url: str, status: int = 200) -> str:
    async with http.get(url) as response:
        body = await response.text()
        assert response.status == status, body
        return body


async def test_an_invocation_lists_its_misses_and_each_explanation_names_the_change(server) -> None:
    app, stubs, http = server
    env = {"PATH": "/usr/bin", "API_TOKEN": "hunter2-secret"}
    first = build_action(SOURCES, ARGS, OUT, env=env, platform={"soc": "ascend910"})
    await _run(stubs, first, "inv-1", "//pkg:a", b"object one\n")
    changed = {**SOURCES, "pkg/a.h": b"#define A 2\n"}
    second = build_action(changed, [*ARGS[:1], "-O3", *ARGS[2:]], OUT,
                          env={**env, "CANN_VERSION": "8"}, platform={"soc": "ascend310"})  # fmt: skip
    await _run(stubs, second, "inv-2", "//pkg:a", b"object two\n")

    listing = await _text(http, "/invocations")
    assert "inv-1" in listing and "inv-2" in listing
    assert 'href="/invocations"' in await _text(http, "/")  # linked from the status page
    page = await _text(http, "/invocation/inv-2")
    assert re.search(r'id="misses">1<', page)
    why = re.search(r'class="why" href="([^"]+)"', page)
    assert why is not None
    explanation = await _text(http, why.group(1).replace("&amp;", "&"))
    assert "the same output paths" in explanation
    assert "input <code>pkg/a.h</code> changed" in explanation
    assert "the argument <code>-O2</code> became <code>-O3</code>" in explanation
    assert "the environment variable <code>CANN_VERSION</code> was added" in explanation
    assert "the platform property <code>soc</code> changed" in explanation
    assert "inv-1" in explanation

    action = await _text(http, f"/action/{key(second.action)}")
    assert "hunter2" not in action and "API_TOKEN" in action  # masked
    assert "worker-<1>" not in action
    assert "worker-&lt;1&gt;" in action and "compiled &lt;ok&gt;" in action
    tree = await _text(http, f"/action/{key(second.action)}?path=pkg")
    assert "&lt;img src=x onerror=alert(1)&gt;.h" in tree and "<img" not in tree
    assert "inv-2" in action
    download = re.search(r'href="(/blob/[^"]+)"><code>bazel-out', action)
    assert download is not None
    assert await _text(http, download.group(1).replace("&amp;", "&")) == "object two\n"

    compare = await _text(http, f"/compare/{key(first.action)}/{key(second.action)}")
    assert compare.index("pkg/a.h") < compare.index("Arguments")  # changed inputs first
    assert "hunter2" not in compare


async def test_cache_only_clients_get_told_the_inputs_were_not_uploaded(server) -> None:
    app, stubs, http = server
    first = build_action(SOURCES, ARGS, OUT, upload_tree=False)
    await _run(stubs, first, "inv-a", "//pkg:a", b"one\n")
    second = build_action({**SOURCES, "pkg/a.h": b"#define A 3\n"}, ARGS, OUT, upload_tree=False)
    await _run(stubs, second, "inv-b", "//pkg:a", b"two\n")
    explanation = await _text(http, f"/explain/{key(second.action)}?invocation=inv-b")
    assert "the input root differs, and the client did not upload" in explanation
    assert "argument" not in explanation.split("What changed")[1]


async def test_a_miss_of_an_action_never_uploaded_says_so(server) -> None:
    app, stubs, http = server
    built = build_action(SOURCES, ARGS, OUT)
    meta = [metadata_header(tool="bazel", invocation="inv-x", target="//pkg:a", mnemonic="CppCompile")]
    with pytest.raises(grpc.aio.AioRpcError):
        await stubs.ac.GetActionResult(re_pb2.GetActionResultRequest(action_digest=built.action), metadata=meta)
    explanation = await _text(http, f"/explain/{key(built.action)}?invocation=inv-x")
    assert "the client never uploaded the missed action" in explanation


@pytest.mark.parametrize(
    "url,status",
    [
        ("/action/not-a-digest", 400),
        ("/action/" + "a" * 64 + "-12", 404),
        ("/compare/zz-1/yy-2", 400),
        ("/invocation/nope", 404),
        ("/invocations?outcome=<b>", 400),
        ("/action/" + "a" * 64 + "-12?instance=../etc", 400),
        ("/blob/" + "b" * 64 + "-3/x.txt", 404),
    ],
)
async def test_bad_requests_get_precise_errors(server, url: str, status: int) -> None:
    _, _, http = server
    body = await _text(http, url, status)
    assert "<b>" not in body


async def test_http_action_cache_calls_are_recorded_without_metadata(server) -> None:
    app, stubs, http = server
    key = "c" * 64
    async with http.get(f"/ac/{key}") as response:
        assert response.status == 404
    body = re_pb2.ActionResult(exit_code=3).SerializeToString()
    async with http.put(f"/ac/{key}", data=body) as response:
        assert response.status == 200
    async with http.get(f"/ac/{key}") as response:
        assert response.status == 200
    await app.services.history.flush()
    rows = app.services.history.store.requests_for(f"{key}/0")
    assert sorted((r.protocol, r.method, r.outcome, r.invocation) for r in rows) == [
        ("http", "ac_get", "hit", ""), ("http", "ac_get", "miss", ""), ("http", "ac_update", "upload", "")]  # fmt: skip


async def test_secret_patterns_are_a_list_setting_spaces_after_commas_included(tmp_path) -> None:
    async with loopback_app(tmp_path, history_secret_patterns="*TOKEN*, MY_*") as (_, channel, http):
        env = {"MY_PASSPHRASE": "swordfish-value", "PLAIN": "shown-value"}
        built = build_action(SOURCES, ARGS, OUT, env=env)
        await _run(make_stubs(channel), built, "inv-s", "//pkg:a", b"object\n")
        action = await _text(http, f"/action/{key(built.action)}")
        assert "MY_PASSPHRASE" in action and "swordfish" not in action  # the pattern after ", "
        assert "shown-value" in action


async def test_markup_in_metadata_is_escaped_on_every_page(server) -> None:
    app, stubs, http = server
    built = build_action(SOURCES, ARGS, OUT)
    evil = "<img src=x onerror=alert(1)>"
    meta = [metadata_header(tool=f"bazel{evil}", invocation=f"inv{evil}", target=f"//pkg:{evil}",
                            mnemonic=f"Cpp{evil}")]  # fmt: skip
    with pytest.raises(grpc.aio.AioRpcError):
        await stubs.ac.GetActionResult(re_pb2.GetActionResultRequest(action_digest=built.action), metadata=meta)
    await upload(stubs, built.blobs)
    for url in ("/invocations", "/invocation/inv" + evil.replace(" ", "%20"), f"/action/{key(built.action)}",
                f"/explain/{key(built.action)}"):  # fmt: skip
        text = await _text(http, url)
        assert "<img" not in text, url
        assert "&lt;img src=x onerror=alert(1)&gt;" in text, url
