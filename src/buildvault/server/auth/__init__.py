"""Access control and TLS for both front ends (issue 11).

- credentials.py: htpasswd (bcrypt, apr1) and token files; parsing an `authorization` value
- grants.py: the TOML access file: read/write/execute on instance-name prefixes
- policy.py: the one rule engine both protocols ask (authenticate, then authorize)
- runtime.py: `Auth`, the state built from Settings, reloaded on SIGHUP, refusal counting
- grpc_auth.py: the check wrapped on each gRPC method handler; health.py: grpc.health.v1.Health, always open
- http_auth.py: the aiohttp middleware and `/healthz`
- tls.py: server TLS for gRPC (dynamic credentials) and HTTP (stdlib ssl), reloadable
- tokens.py: `buildvault token add`
"""

from buildvault.server.auth.policy import Policy, Refusal
from buildvault.server.auth.runtime import Auth, AuthStartupError

__all__ = ["Auth", "AuthStartupError", "Policy", "Refusal"]
