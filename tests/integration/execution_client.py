"""Build REAPI actions and run them through a server's Execution service (for the execution tests).

    spec = ActionSpec(["/bin/sh", "-c", "echo hi > out/x"], output_files=["out/x"])
    action_digest = await spec.upload(stubs)
    messages = await execute(channel, action_digest)        # every Operation the stream sent
    response = final_response(messages)                      # the ExecuteResponse of the last one
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from google.longrunning import operations_pb2, operations_pb2_grpc
from google.protobuf import duration_pb2
from reapi_client import batch_update, digest

from buildvault.remote_apis import re_grpc, re_pb2

PATH_ENV = {"PATH": "/usr/bin:/bin"}


def message_digest(message) -> tuple[re_pb2.Digest, bytes]:
    data = message.SerializeToString(deterministic=True)
    return re_pb2.Digest(hash=hashlib.sha256(data).hexdigest(), size_bytes=len(data)), data


@dataclass
class ActionSpec:
    arguments: list[str]
    env: dict[str, str] = field(default_factory=lambda: dict(PATH_ENV))
    inputs: dict[str, bytes] = field(default_factory=dict)  # path -> content, directories implied
    output_files: list[str] = field(default_factory=list)
    output_directories: list[str] = field(default_factory=list)
    output_paths: list[str] = field(default_factory=list)
    platform: dict[str, str] = field(default_factory=dict)
    command_platform: dict[str, str] = field(default_factory=dict)
    timeout: float | None = None
    do_not_cache: bool = False
    working_directory: str = ""
    salt: bytes = b""

    def command(self) -> re_pb2.Command:
        command = re_pb2.Command(
            arguments=self.arguments,
            environment_variables=[
                re_pb2.Command.EnvironmentVariable(name=k, value=v) for k, v in sorted(self.env.items())
            ],
            output_files=self.output_files,
            output_directories=self.output_directories,
            output_paths=self.output_paths,
            working_directory=self.working_directory,
        )
        if self.command_platform:
            command.platform.CopyFrom(_platform(self.command_platform))
        return command

    def input_tree(self) -> tuple[re_pb2.Digest, list[bytes]]:
        """The root Directory digest and every blob of the tree (Directories and files)."""
        blobs: list[bytes] = []

        def build(prefix: str) -> re_pb2.Directory:
            directory = re_pb2.Directory()
            names: dict[str, bool] = {}
            for path in self.inputs:
                if not path.startswith(prefix):
                    continue
                head, _, rest = path[len(prefix):].partition("/")
                names[head] = names.get(head, False) or bool(rest)
            for name in sorted(names):
                if names[name]:
                    child = build(prefix + name + "/")
                    child_digest, data = message_digest(child)
                    blobs.append(data)
                    directory.directories.add(name=name, digest=child_digest)
                else:
                    content = self.inputs[prefix + name]
                    blobs.append(content)
                    directory.files.add(name=name, digest=digest(content), is_executable=name.endswith(".sh"))
            return directory

        root_digest, data = message_digest(build(""))
        blobs.append(data)
        return root_digest, blobs

    def action(self) -> tuple[re_pb2.Action, list[bytes]]:
        command_digest, command_data = message_digest(self.command())
        root_digest, blobs = self.input_tree()
        action = re_pb2.Action(
            command_digest=command_digest,
            input_root_digest=root_digest,
            do_not_cache=self.do_not_cache,
            salt=self.salt,
        )
        if self.timeout is not None:
            action.timeout.CopyFrom(duration_pb2.Duration(seconds=int(self.timeout), nanos=int(self.timeout % 1 * 1e9)))
        if self.platform:
            action.platform.CopyFrom(_platform(self.platform))
        return action, [command_data, *blobs]

    async def upload(self, stubs, *, skip: tuple[str, ...] = ()) -> re_pb2.Digest:
        """Upload the Action, its Command and input tree (minus the kinds in `skip`: 'command',
        'inputs', 'action'); return the action digest."""
        action, blobs = self.action()
        action_digest, action_data = message_digest(action)
        command_data, tree = blobs[0], blobs[1:]
        wanted = []
        if "command" not in skip:
            wanted.append(command_data)
        if "inputs" not in skip:
            wanted.extend(b for b in tree if b)
        if "action" not in skip:
            wanted.append(action_data)
        if wanted:
            await batch_update(stubs, wanted)
        return action_digest


def _platform(props: dict[str, str]) -> re_pb2.Platform:
    return re_pb2.Platform(
        properties=[re_pb2.Platform.Property(name=k, value=v) for k, v in sorted(props.items())]
    )


def execution_stub(channel: grpc.aio.Channel) -> re_grpc.ExecutionStub:
    return re_grpc.ExecutionStub(channel)


def operations_stub(channel: grpc.aio.Channel) -> operations_pb2_grpc.OperationsStub:
    return operations_pb2_grpc.OperationsStub(channel)


async def execute(
    channel: grpc.aio.Channel,
    action_digest: re_pb2.Digest,
    *,
    skip_cache_lookup: bool = False,
    instance: str = "",
    priority: int = 0,
) -> list[operations_pb2.Operation]:
    """Every Operation of one Execute stream, through the one with `done`."""
    request = re_pb2.ExecuteRequest(
        instance_name=instance,
        action_digest=action_digest,
        skip_cache_lookup=skip_cache_lookup,
        execution_policy=re_pb2.ExecutionPolicy(priority=priority),
    )
    return [op async for op in execution_stub(channel).Execute(request)]


def stage(operation: operations_pb2.Operation) -> int:
    metadata = re_pb2.ExecuteOperationMetadata()
    assert operation.metadata.Unpack(metadata)
    return metadata.stage


def final_response(messages: list[operations_pb2.Operation]) -> re_pb2.ExecuteResponse:
    assert messages and messages[-1].done, messages
    assert not messages[-1].HasField("error"), messages[-1]
    response = re_pb2.ExecuteResponse()
    assert messages[-1].response.Unpack(response)
    return response


def response_of(operation: operations_pb2.Operation) -> re_pb2.ExecuteResponse:
    return final_response([operation])


def processes_with(marker: str) -> list[int]:
    """Pids whose command line contains `marker` (an action's own, unique argument)."""
    return [pid for pid, cmdline in _command_lines() if marker.encode() in cmdline]


def processes_running(argv: list[str]) -> list[int]:
    """Pids whose command line is exactly `argv`: the action's own program, not a wrapper naming it."""
    wanted = b"".join(arg.encode() + b"\0" for arg in argv)
    return [pid for pid, cmdline in _command_lines() if cmdline == wanted]


def _command_lines() -> list[tuple[int, bytes]]:
    lines = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            lines.append((int(entry), Path(f"/proc/{entry}/cmdline").read_bytes()))
        except OSError:
            continue
    return lines
