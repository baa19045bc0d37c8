"""The agent's half of a `buildvault run` hit (request {"op": "step"}, see protocol.py).

The agent computes the step's key with its warm file-hash cache and its open channel, looks it
up and restores a usable result into the workdir. Anything but a hit is handed back: "local"
makes the front run the whole in-process path (lock, run, store; it looks up once more, which
also gives every setup error its usual message), "bypass" runs the command uncached.
"""

from __future__ import annotations

from typing import Any

from ..keys import FileHasher
from ..remote import Remote, RemoteError
from .key import step_key
from .spec import SpecError, StepSpec
from .step import Step, key_text, step_metadata

Reply = dict[str, Any]


def lookup_step(req: Reply, remote: Remote, hasher: FileHasher) -> Reply:
    """HIT: {"op": "hit", "exit", "stdout", "stderr", "key", "event"} with the outputs already in
    place; {"op": "bypass", "reason", "warning"} when the cache did not answer; else {"op": "local"}."""
    spec = StepSpec(**req["spec"])
    step = Step(spec, req["env"])
    try:
        key = step_key(spec, step.run_env, hasher)
    except (SpecError, OSError, ValueError) as e:
        return {"op": "local", "reason": f"key: {e}"}
    try:
        with step_metadata(spec, step.run_env, req.get("peer_pid")):  # the lookup the history records
            restored = step.restore_cached(key, remote)
    except RemoteError as e:
        return {"op": "bypass", "reason": "remote-unavailable",
                "warning": f"buildvault run: remote cache unavailable ({e}); running steps uncached"}
    if restored is None:
        return {"op": "local", "reason": step.event["reason"]}
    extra = {name: step.event[name] for name in ("outputs", "saved") if name in step.event}
    return {"op": "hit", "exit": restored.exit, "stdout": restored.stdout, "stderr": restored.stderr,
            "key": key_text(key), "event": extra}
