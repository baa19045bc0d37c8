"""Real Bazel 4.2.3 and two buildvault servers sharing one S3 bucket (a moto_server subprocess).

Server A (its own --dir) takes a cold build and uploads it to the bucket through its journal;
once the journal has drained A is stopped. Server B, with another, empty --dir on the same
bucket, then serves a full warm rebuild after `bazel clean`: every compile and link action is a
remote cache hit, read through B from the bucket, and the binary runs. Over gRPC (REAPI) and
over bazel-remote's HTTP protocol.
"""

from __future__ import annotations

import pytest
from bazel_harness import ALL_HITS, CACHEABLE_SPAWNS, EXPECTED_OUTPUT
from s3_server import bucket_keys, create_bucket, metric, s3_requests, scrape, tier_args, wait_drained
from server_process import ServerProcess

pytestmark = pytest.mark.timeout(900)


def url(server: ServerProcess, protocol: str) -> str:
    return f"grpc://{server.grpc_address}" if protocol == "grpc" else f"http://{server.http_address}"


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_bazel_warm_rebuild_from_the_bucket_through_a_second_server(bazel_workspace_factory, servers, s3, protocol):
    bucket = create_bucket(s3.endpoint)
    a = servers("a", *tier_args(s3.endpoint, bucket))
    ws = bazel_workspace_factory("ws")

    build = ws.build(remote_cache=url(a, protocol), check=True)
    cold = build.processes
    assert cold.executed == CACHEABLE_SPAWNS and cold.cache_hits == 0, cold.line
    assert "Remote Cache" not in build.output, build.output  # no failed uploads
    wait_drained(a.http_address)
    uploaded = metric(a.http_address, "buildvault_object_store_uploads_total", result="ok")
    assert uploaded > CACHEABLE_SPAWNS, (uploaded, scrape(a.http_address), a.output())
    keys = bucket_keys(s3.endpoint, bucket)
    assert sum(key.startswith("ac/ac/sha256/") for key in keys) == CACHEABLE_SPAWNS, sorted(keys)
    a.stop()  # B must not need A: everything comes from the bucket

    b = servers("b", *tier_args(s3.endpoint, bucket))
    ws.clean()
    warm = ws.build(remote_cache=url(b, protocol), check=True).processes
    assert warm.as_dict() == ALL_HITS, warm.line
    assert ws.run_binary().stdout == EXPECTED_OUTPUT + "\n"

    events = {
        (store, event): metric(b.http_address, "buildvault_object_tier_events_total", store=store, event=event)
        for store in ("cas", "ac")
        for event in ("slow_hits", "misses")
    }
    assert events[("ac", "slow_hits")] == CACHEABLE_SPAWNS and events[("ac", "misses")] == 0, events
    assert events[("cas", "slow_hits")] > 0 and events[("cas", "misses")] == 0, events
    assert s3_requests(b.http_address)["put"] == 0  # a reader here: nothing to upload
    assert bucket_keys(s3.endpoint, bucket) == keys
    output = a.output() + b.output()
    assert '"code":"INTERNAL"' not in output and '"code":"UNKNOWN"' not in output and "Traceback" not in output
