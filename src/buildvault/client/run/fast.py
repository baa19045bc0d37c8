"""The fast front of `buildvault run`: hand the step to buildvault-cc's long-lived local agent.

Standard library only (no grpc, protobuf or asyncio): a hit costs a Python start-up, one round
trip over the agent's unix socket and the restore the agent does, instead of importing the
gRPC stack per step. The agent (agent.py, request {"op": "step"}, run/agent_step.py) computes
the key with its warm file-hash cache, looks it up and restores the outputs; this process then
replays the exit code and output and writes the status line and event as the in-process path
would. Everything else (a miss, a setup error, an agent that cannot start or answer) returns
None: the caller runs the in-process path (step.py), which behaves exactly as without an agent.
"""

from __future__ import annotations

from .. import launcher, protocol
from .report import StepReport, echo, warn_once
from .spec import StepSpec

TYPE_CHECKING = False  # no `import collections` at run time: the run front starts once per step
if TYPE_CHECKING:
    from collections.abc import Mapping

# BUILDVAULT_RUN_AGENT=0: never use the agent (every step in-process).
_OFF = ("0", "false", "no", "off")


def _agent_can_key(spec: StepSpec, env: Mapping[str, str]) -> bool:
    """The agent runs in `/` with the environment it was started with: use it only for a step
    whose cache configuration is that environment's and whose declared roots are absolute."""
    if env.get("BUILDVAULT_RUN_AGENT", "").lower() in _OFF:
        return False
    if spec.remote != env.get("BUILDVAULT_REMOTE", "") or spec.instance != env.get("BUILDVAULT_INSTANCE", ""):
        return False
    for item in env.get("BUILDVAULT_ROOTS", "").split(","):
        path = item.partition("=")[2] if "=" in item else item
        if path.strip() and not path.strip().startswith("/"):
            return False
    return True


# Set when the agent looked the step up and missed (see step.run_step's `looked_up`).
LOOKED_UP: list[bool] = []


def run_fast(spec: StepSpec, env: Mapping[str, str]) -> int | None:
    """The step's exit code when it was settled here (HIT, BYPASS); None: run it in-process."""
    report = StepReport(spec, env)
    if not spec.remote or spec.disabled:
        return report.bypass("no-remote" if not spec.remote else "disabled")
    if not _agent_can_key(spec, env):
        return None
    sock = launcher.connect_agent()
    if sock is None:
        return None
    try:
        protocol.send(sock, {"op": "step", "spec": spec.as_dict(), "env": dict(env)})
        reply = protocol.recv(sock)
    except (OSError, ValueError):
        return None
    finally:
        sock.close()
    if reply is None:
        return None
    op = reply.get("op")
    if op == "hit":
        echo(reply["stdout"], reply["stderr"])
        report.key_text = str(reply["key"])
        report.event.update(reply.get("event") or {})
        return report.finish("HIT", int(reply["exit"]), "hit")
    if op == "local":
        LOOKED_UP.append(True)  # the agent looked the step up: the in-process path need not record it again
    if op == "bypass" and reply.get("reason") == "remote-unavailable":
        warn_once(str(reply.get("warning") or "buildvault run: remote cache unavailable; running steps uncached"))
        return report.bypass("remote-unavailable")
    return None
