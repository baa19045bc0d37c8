"""The build pages in a real browser (Debian's chromium, headless, through Selenium): from the
invocation list to an invocation, its miss, the explanation, the comparison, the action and an
output download. Screenshots of each page are kept beside the test's temporary files."""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
from action_builder import build_action, digest_of, upload
from reapi_client import CLIENT_OPTIONS, make_stubs

from buildvault.history.metadata import metadata_header
from buildvault.remote_apis import re_pb2

OUT = "bazel-out/k8-fastbuild/bin/csrc/ops/_objs/moe/moe_gating.o"
SOURCES = {
    "csrc/ops/moe/moe_gating.cc": b'#include "csrc/ops/moe/moe_gating.h"\n',
    "csrc/ops/moe/moe_gating.h": b"#define TOPK 2\n",
    "csrc/ops/<b onclick=x>odd.h": b"// a name with markup\n",
}
ARGS = ["/usr/bin/g++", "-O2", "-c", "csrc/ops/moe/moe_gating.cc", "-o", OUT]


async def _build(address: str, invocation: str, files: dict[str, bytes], args: list[str], output: bytes) -> None:
    async with grpc.aio.insecure_channel(address, options=CLIENT_OPTIONS) as channel:
        stubs = make_stubs(channel)
        built = build_action(files, args, [OUT], env={"CANN_VERSION": "8.0", "HF_TOKEN": "hf_secret_value"},
                             platform={"soc": "ascend910b"})  # fmt: skip
        meta = [metadata_header(tool="bazel", tool_version="4.2.3", invocation=invocation,
                                target="//csrc/ops:moe", mnemonic="CppCompile")]  # fmt: skip
        try:
            await stubs.ac.GetActionResult(re_pb2.GetActionResultRequest(action_digest=built.action), metadata=meta)
        except grpc.aio.AioRpcError as missed:
            assert missed.code() == grpc.StatusCode.NOT_FOUND
        await upload(stubs, {**built.blobs, digest_of(output).hash: output})
        result = re_pb2.ActionResult(exit_code=0)
        result.output_files.add(path=OUT, digest=digest_of(output))
        await stubs.ac.UpdateActionResult(
            re_pb2.UpdateActionResultRequest(action_digest=built.action, action_result=result), metadata=meta
        )


def test_from_the_invocation_list_to_a_miss_its_explanation_and_an_output(server, browser, tmp_path: Path) -> None:
    from selenium.webdriver.common.by import By

    asyncio.run(_build(server.grpc_address, "build-one", SOURCES, ARGS, b"object one\n"))
    changed = {**SOURCES, "csrc/ops/moe/moe_gating.h": b"#define TOPK 4\n"}
    asyncio.run(_build(server.grpc_address, "build-two", changed, [ARGS[0], "-O3", *ARGS[2:]], b"object two\n"))
    shots = tmp_path / "screenshots"
    shots.mkdir()
    base = f"http://{server.http_address}"

    def shot(name: str) -> str:
        browser.save_screenshot(str(shots / f"{name}.png"))  # type: ignore[attr-defined]
        return str(browser.find_element(By.TAG_NAME, "body").text)  # type: ignore[attr-defined]

    browser.get(base + "/")  # type: ignore[attr-defined]
    browser.find_element(By.LINK_TEXT, "Invocations").click()  # type: ignore[attr-defined]
    listing = shot("1-invocations")
    assert "build-one" in listing and "build-two" in listing

    browser.find_element(By.LINK_TEXT, "build-two").click()  # type: ignore[attr-defined]
    invocation = shot("2-invocation")
    assert "Invocation build-two" in invocation
    assert browser.find_element(By.ID, "misses").text == "1"  # type: ignore[attr-defined]

    browser.find_element(By.CSS_SELECTOR, "a.why").click()  # type: ignore[attr-defined]
    explanation = shot("3-explanation")
    assert "Why did it miss?" in explanation
    assert "input csrc/ops/moe/moe_gating.h changed" in explanation
    assert "the argument -O2 became -O3" in explanation
    assert "build-one" in explanation

    browser.find_element(By.LINK_TEXT, "the full comparison").click()  # type: ignore[attr-defined]
    comparison = shot("4-compare")
    assert "csrc/ops/moe/moe_gating.h" in comparison and "hf_secret_value" not in comparison

    browser.back()  # type: ignore[attr-defined]
    links = browser.find_elements(By.CSS_SELECTOR, "a[href^='/action/']")  # type: ignore[attr-defined]
    links[0].click()  # the missed action
    action = shot("5-action")
    assert "HF_TOKEN" in action and "hf_secret_value" not in action and "CANN_VERSION" in action
    assert "csrc/" in action and "ascend910b" in action

    browser.find_element(By.LINK_TEXT, "csrc/").click()  # type: ignore[attr-defined]
    browser.find_element(By.LINK_TEXT, "ops/").click()  # type: ignore[attr-defined]
    tree = shot("6-tree")
    assert "Input tree: csrc/ops" in tree, tree[tree.find("Input tree"):][:500]
    assert "<b onclick=x>odd.h" in tree  # the markup is text, not markup

    browser.back()  # type: ignore[attr-defined]
    browser.back()  # type: ignore[attr-defined]
    browser.find_element(By.PARTIAL_LINK_TEXT, "moe_gating.o").click()  # type: ignore[attr-defined]
    download = shot("7-download")
    assert download.strip() == "object two"
    assert len(list(shots.glob("*.png"))) == 7
