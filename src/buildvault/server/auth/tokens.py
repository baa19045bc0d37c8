"""`buildvault token add PRINCIPAL --token-file FILE`: make a token, keep only its hash.
`buildvault token ci`: the CI job's OIDC token (client/ci_token.py)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from buildvault.server.auth.credentials import CredentialsFileError, add_token

__all__ = ["add_token_command", "add_token_parser"]


def add_token_parser(commands: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    token = commands.add_parser("token", help="manage bearer tokens", description="Manage bearer tokens.")
    actions = token.add_subparsers(dest="token_command", metavar="ACTION", required=True)
    add = actions.add_parser(
        "add",
        help="create a random token for PRINCIPAL",
        description="Append a new random token's SHA-256 to FILE and print the token once, alone on the last "
        "line of stdout. The server reads the file at start-up and on SIGHUP.",
    )
    add.add_argument("principal", metavar="PRINCIPAL", help="the name grants and request logs use, e.g. ci")
    add.add_argument("--token-file", required=True, metavar="FILE", help="the server's --token-file")
    from buildvault.client.ci_token import add_ci_parser  # a CI job's own OIDC token (issue 36)

    add_ci_parser(actions)


def add_token_command(args: argparse.Namespace) -> int:
    if args.token_command == "ci":
        from buildvault.client.ci_token import ci_token_command

        return ci_token_command(args)
    path = Path(args.token_file)
    try:
        token = add_token(args.principal, path)
    except (CredentialsFileError, OSError) as e:
        print(f"buildvault: {e}", file=sys.stderr)
        return 1
    print(f"added a token for {args.principal} to {path} (send SIGHUP to a running server); the token:")
    print(token)
    return 0
