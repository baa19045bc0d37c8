"""OIDC tokens against static tokens: FindMissingBlobs and GetActionResult at 16 callers.

    .venv/bin/python bench/oidc_auth_bench.py [--rounds 4] [--scenarios fmb_c16,ac_get_c16]

Each round starts two fresh servers (one process each), one after the other, and runs the
harness against each:
`--token-file` with a static bearer token, and `--oidc-issuer` with a JWT signed by an RS256 key
of the issuer (keys from `--oidc-jwks-file`, so no network; the verification path is the one a
fetched key set takes). Both have an access file granting the caller read and write. Prints
calls/s and the server's CPU per call (harness detail `server_cpu_us_per_op`), medians over the
rounds, and OIDC over static. Issue 36's target: at most 5 % slower.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import jwt
from cryptography.hazmat.primitives.asymmetric import rsa
from jwt.algorithms import RSAAlgorithm
from servers import ROOT, start_buildvault, stop

ISSUER = "https://ci.example.internal"
AUDIENCE = "buildvault-bench"


def oidc_files(directory: Path) -> tuple[list[str], str]:
    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    jwk = dict(RSAAlgorithm.to_jwk(key.public_key(), as_dict=True), kid="bench-1", alg="RS256", use="sig")
    (directory / "jwks.json").write_text(json.dumps({"keys": [jwk]}))
    (directory / "oidc-access.toml").write_text(
        f'[[grant]]\nissuer = "{ISSUER}"\nclaims = {{ repository = "org/vllm-ascend", ref = "refs/heads/main" }}\n'
        'permissions = ["read", "write"]\n'
    )
    now = int(time.time())
    claims = {
        "iss": ISSUER, "aud": AUDIENCE, "iat": now, "nbf": now, "exp": now + 6 * 3600,
        "sub": "repo:org/vllm-ascend:ref:refs/heads/main", "repository": "org/vllm-ascend",
        "ref": "refs/heads/main", "event_name": "push", "run_id": "1234567890",
    }  # fmt: skip
    token = jwt.encode(claims, key, algorithm="RS256", headers={"kid": "bench-1"})
    args = [
        "--oidc-issuer", ISSUER, "--oidc-audience", AUDIENCE, "--oidc-jwks-file", str(directory / "jwks.json"),
        "--access-file", str(directory / "oidc-access.toml"),
    ]  # fmt: skip
    return args, token


def static_files(directory: Path) -> tuple[list[str], str]:
    tokens = directory / "tokens"
    done = subprocess.run(
        [sys.executable, "-m", "buildvault.cli", "token", "add", "ci", "--token-file", str(tokens)],
        check=True, capture_output=True, text=True,
    )  # fmt: skip
    (directory / "static-access.toml").write_text('[[grant]]\nprincipal = "ci"\npermissions = ["read", "write"]\n')
    args = ["--token-file", str(tokens), "--access-file", str(directory / "static-access.toml")]
    return args, done.stdout.split()[-1]


def run_harness(server_address: str, pid: int, token: str, scenarios: str, out: Path) -> dict[str, dict]:
    subprocess.run(
        [sys.executable, str(ROOT / "bench" / "harness.py"), "--target", server_address, "--scenarios", scenarios,
         "--authorization", f"Bearer {token}", "--server-pid", str(pid), "--warmup", "--json-out", str(out)],
        check=True, capture_output=True, text=True,
    )  # fmt: skip
    return {record["scenario"]: record for record in json.loads(out.read_text())["results"]}


def check_cost(directory: Path, rounds: int = 5, calls: int = 100_000) -> None:
    """The access check alone, in this process (authenticate + authorize of a remembered
    credential, a fresh header string per call as gRPC hands it): microseconds per call."""
    import asyncio

    from buildvault.config import load_settings
    from buildvault.server.auth.grants import Permission
    from buildvault.server.auth.runtime import Auth

    async def per_call(args: list[str], token: str) -> float:
        flags = dict(zip((a.lstrip("-").replace("-", "_") for a in args[::2]), args[1::2], strict=True))
        flags["oidc_issuer"] = [flags["oidc_issuer"]] if "oidc_issuer" in flags else None  # type: ignore[assignment]
        auth = Auth.from_settings(load_settings(flags, env={}))
        policy, value = auth.policy, f"Bearer {token}"
        caller = await policy.authenticate(value, None)  # the first call verifies; the rest remember
        policy.authorize(caller, Permission.READ, "")
        started = time.perf_counter()
        for _ in range(calls):
            caller = await policy.authenticate(value[:1] + value[1:], None)
            policy.authorize(caller, Permission.READ, "")
        return (time.perf_counter() - started) / calls * 1e6

    kinds = {"static": static_files(directory), "oidc": oidc_files(directory)}
    found: dict[str, list[float]] = {"static": [], "oidc": []}
    for _ in range(rounds):
        for kind, (args, token) in kinds.items():
            found[kind].append(asyncio.run(per_call(args, token)))
    static, oidc = statistics.median(found["static"]), statistics.median(found["oidc"])
    print(f"access check in process: static token {static:.2f} us/call, OIDC token {oidc:.2f} us/call")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--scenarios", default="fmb_c16,ac_get_c16")
    parser.add_argument("--check-only", action="store_true", help="only the in-process cost of the check")
    args = parser.parse_args()
    if args.check_only:
        with tempfile.TemporaryDirectory(prefix="oidc-bench-") as tmp:
            check_cost(Path(tmp))
        return 0
    samples: dict[tuple[str, str], list[tuple[float, float]]] = {}
    with tempfile.TemporaryDirectory(prefix="oidc-bench-") as tmp:
        root = Path(tmp)
        kinds = {"static": static_files(root), "oidc": oidc_files(root)}
        for round_ in range(args.rounds):
            order = ["static", "oidc"] if round_ % 2 == 0 else ["oidc", "static"]
            for kind in order:
                extra, token = kinds[kind]
                data = root / f"{kind}-{round_}"
                # One process: with several, the harness's one connection lands on the primary or
                # on a secondary (whose store is behind a socket) at random, which swamps the check.
                options = ["--local-workers", "0", "--processes", "1", *extra]
                server = start_buildvault(data, root / f"{kind}-{round_}.log", options)
                try:
                    results = run_harness(server.address, server.pid, token, args.scenarios, root / f"{kind}.json")
                finally:
                    stop(server)
                for name, record in results.items():
                    if not record.get("ok", True):
                        raise SystemExit(f"{kind} {name}: {record.get('error')}")
                    cpu = float(record.get("detail", {}).get("server_cpu_us_per_op") or 0.0)
                    samples.setdefault((name, kind), []).append((float(record["value"]), cpu))
    print("| scenario | static calls/s | OIDC calls/s | OIDC/static | static server CPU us/call | OIDC | OIDC/static |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for name in args.scenarios.split(","):
        static = samples[(name, "static")]
        oidc = samples[(name, "oidc")]
        s_rate, o_rate = statistics.median(v for v, _ in static), statistics.median(v for v, _ in oidc)
        s_cpu, o_cpu = statistics.median(c for _, c in static), statistics.median(c for _, c in oidc)
        print(
            f"| {name} | {s_rate:.0f} | {o_rate:.0f} | {o_rate / s_rate:.3f} | {s_cpu:.0f} | {o_cpu:.0f} | "
            f"{o_cpu / s_cpu if s_cpu else float('nan'):.3f} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
