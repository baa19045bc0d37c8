"""`buildvault token ci`: the CI job's own identity token (OIDC), written where the clients read it.

- GitHub Actions (`permissions: id-token: write`): GET `$ACTIONS_ID_TOKEN_REQUEST_URL&audience=AUD`
  with `Authorization: Bearer $ACTIONS_ID_TOKEN_REQUEST_TOKEN`; the answer's `value` is the token.
- GitLab CI: the job declares `id_tokens: { BUILDVAULT_ID_TOKEN: { aud: AUD } }` and GitLab puts
  the token in that variable (`--variable` names another).

The token goes to `-o FILE` (default `$BUILDVAULT_TOKEN_FILE`; `-` is stdout), written to a
temporary file and renamed over it (mode 0600), so buildvault-cc, `buildvault run` and
`buildvault artifact`, which read the file again whenever it changes, never see half a token.
`--every SECONDS` keeps fetching a fresh one (run it in the background for a long job: CI tokens
live minutes).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request

__all__ = ["CiTokenError", "add_ci_parser", "ci_token_command", "fetch_ci_token", "write_token_file"]

GITLAB_VARIABLE = "BUILDVAULT_ID_TOKEN"
_MAX_TOKEN = 16 * 1024


class CiTokenError(Exception):
    """No CI identity token could be obtained; the message says what is missing."""


def fetch_ci_token(audience: str | None, variable: str = GITLAB_VARIABLE, env: dict[str, str] | None = None) -> str:
    """The job's token from the CI system it runs in (GitHub Actions, else GitLab's variable)."""
    env = dict(os.environ) if env is None else env
    url, request_token = env.get("ACTIONS_ID_TOKEN_REQUEST_URL"), env.get("ACTIONS_ID_TOKEN_REQUEST_TOKEN")
    if url and request_token:
        if audience:
            url += ("&" if "?" in url else "?") + "audience=" + urllib.parse.quote(audience, safe="")
        request = urllib.request.Request(
            url, headers={"Authorization": f"Bearer {request_token}", "Accept": "application/json"}
        )
        try:
            with urllib.request.urlopen(request, timeout=30) as response:
                body = response.read(_MAX_TOKEN * 2)
        except urllib.error.HTTPError as e:
            raise CiTokenError(f"GitHub Actions refused the token request: HTTP {e.code}") from None
        except (urllib.error.URLError, OSError) as e:
            raise CiTokenError(f"GitHub Actions token request failed: {e}") from None
        try:
            value = json.loads(body)["value"]
        except (ValueError, KeyError, TypeError):
            raise CiTokenError("GitHub Actions answered the token request without a 'value'") from None
        return _checked(value, "GitHub Actions")
    if url or request_token:
        raise CiTokenError("ACTIONS_ID_TOKEN_REQUEST_URL and _TOKEN: give the job `permissions: id-token: write`")
    if env.get(variable):
        return _checked(env[variable], f"${variable}")
    if env.get("GITLAB_CI") == "true":
        raise CiTokenError(f"${variable} is not set: declare it under the job's `id_tokens:` with `aud: AUDIENCE`")
    if env.get("GITHUB_ACTIONS") == "true":
        raise CiTokenError("no ACTIONS_ID_TOKEN_REQUEST_URL: give the job `permissions: id-token: write`")
    raise CiTokenError(f"not in a CI job that hands out identity tokens (GitHub Actions, or GitLab's ${variable})")


def _checked(value: object, source: str) -> str:
    if not isinstance(value, str) or not value.strip() or len(value) > _MAX_TOKEN or value.count(".") != 2:
        raise CiTokenError(f"{source} did not give a JWT")
    return value.strip()


def write_token_file(path: str, token: str) -> None:
    """Replace `path` whole (temporary file in the same directory, 0600, rename)."""
    directory = os.path.dirname(os.path.abspath(path))
    fd, temp = tempfile.mkstemp(prefix=".token-", dir=directory)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(token + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(temp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temp)
        raise


def add_ci_parser(actions: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    ci = actions.add_parser(
        "ci",
        help="write this CI job's OIDC identity token where the clients read it",
        description="Obtain the job's identity token from GitHub Actions (ACTIONS_ID_TOKEN_REQUEST_URL/_TOKEN) "
        f"or GitLab CI (an id_tokens variable, default {GITLAB_VARIABLE}) and write it to FILE.",
    )
    ci.add_argument("--audience", metavar="AUD", help="the server's --oidc-audience (GitHub: asked for; GitLab: "
                    "set in the job's id_tokens)")  # fmt: skip
    ci.add_argument(
        "-o", "--output", metavar="FILE", help="where to write it (default $BUILDVAULT_TOKEN_FILE; '-': stdout)"
    )
    ci.add_argument("--variable", default=GITLAB_VARIABLE, help="GitLab: the id_tokens variable (default %(default)s)")
    ci.add_argument("--every", type=float, metavar="SECONDS", help="keep fetching a fresh token this often")


def ci_token_command(args: argparse.Namespace) -> int:
    output = args.output or os.environ.get("BUILDVAULT_TOKEN_FILE", "")
    if not output:
        print("buildvault: token ci: give -o FILE (or set BUILDVAULT_TOKEN_FILE)", file=sys.stderr)
        return 2
    while True:
        try:
            token = fetch_ci_token(args.audience, args.variable)
            if output == "-":
                print(token)
            else:
                write_token_file(output, token)
                print(f"buildvault: wrote the job's identity token to {output}", file=sys.stderr)
        except (CiTokenError, OSError) as e:
            print(f"buildvault: token ci: {e}", file=sys.stderr)
            if not args.every:
                return 1
        if not args.every:
            return 0
        time.sleep(max(args.every, 1.0))
