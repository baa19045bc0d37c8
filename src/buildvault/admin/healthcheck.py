"""`buildvault healthcheck`: exit 0 when the local server's `GET /healthz` answers 200.

Used by the container's HEALTHCHECK (the slim base image has no curl). The address comes from
the same settings as `serve` (BUILDVAULT_HTTP_ADDRESS), with a wildcard host mapped to loopback.
"""

from __future__ import annotations

import sys
import urllib.error
import urllib.request

WILDCARD_HOSTS = {"0.0.0.0": "127.0.0.1", "[::]": "[::1]", "": "127.0.0.1"}


def health_url(http_address: str) -> str:
    """The /healthz URL for a server listening on `http_address` (host:port)."""
    host, _, port = http_address.rpartition(":")
    host = WILDCARD_HOSTS.get(host, host)
    return f"http://{host}:{port}/healthz"


def check(http_address: str, timeout: float = 4.0) -> tuple[bool, str]:
    """(healthy, what was seen) for the server at `http_address`."""
    if not http_address:
        return False, "http_address is empty: the HTTP listener is off, /healthz has nothing to answer"
    url = health_url(http_address)
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return response.status == 200, f"{url}: {response.status}"
    except urllib.error.HTTPError as e:
        return False, f"{url}: {e.code}"
    except (urllib.error.URLError, OSError) as e:
        return False, f"{url}: {getattr(e, 'reason', e)}"


def run(http_address: str) -> int:
    healthy, seen = check(http_address)
    print(("healthy: " if healthy else "unhealthy: ") + seen, file=sys.stdout if healthy else sys.stderr)
    return 0 if healthy else 1
