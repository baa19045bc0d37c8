"""Remote Execution API v2, Remote Asset API v1, SemVer and ByteStream protobuf/gRPC modules.

The ``.proto`` sources live next to their generated ``*_pb2.py`` /
``*_pb2.pyi`` / ``*_pb2_grpc.py`` modules; regenerate with
``python -m buildvault.remote_apis.regen`` (or, if the generated modules are
missing or broken, ``python src/buildvault/remote_apis/regen.py``).

Short aliases (bes: the Build Event Service; bep: Bazel's build event payloads)::

    from buildvault.remote_apis import re_pb2, re_grpc, ra_pb2, ra_grpc, bs_pb2, bs_grpc, semver_pb2
"""

from .build.bazel.remote.asset.v1 import remote_asset_pb2 as ra_pb2
from .build.bazel.remote.asset.v1 import remote_asset_pb2_grpc as ra_grpc
from .build.bazel.remote.execution.v2 import remote_execution_pb2 as re_pb2
from .build.bazel.remote.execution.v2 import remote_execution_pb2_grpc as re_grpc
from .build.bazel.semver import semver_pb2
from .build_event_stream import build_event_stream_pb2 as bep_pb2
from .google.bytestream import bytestream_pb2 as bs_pb2
from .google.bytestream import bytestream_pb2_grpc as bs_grpc
from .google.devtools.build.v1 import build_events_pb2 as build_events_pb2
from .google.devtools.build.v1 import publish_build_event_pb2 as bes_pb2
from .google.devtools.build.v1 import publish_build_event_pb2_grpc as bes_grpc

__all__ = [
    "bep_pb2",
    "bes_grpc",
    "bes_pb2",
    "bs_grpc",
    "bs_pb2",
    "build_events_pb2",
    "ra_grpc",
    "ra_pb2",
    "re_grpc",
    "re_pb2",
    "semver_pb2",
]
