"""The bazel-remote HTTP protocol, /status and /metrics, on aiohttp in the server's event loop.

Endpoints (see docs/http.md): `GET|HEAD|PUT /{instance…}/cas/{sha256}` (CAS blobs),
`GET|HEAD|PUT /{instance…}/ac/{sha256}` and ccache's `layout=subdirs`/`layout=flat` paths
(action entries), `GET /status` (JSON), `GET /` and `/status.html` (HTML), `GET /metrics`.

The package, by job:

- handlers.py   GET/HEAD/PUT of /ac/ and /cas/, and the HTTP-level rules they parse with: the
                URL grammar (CachePath, ccache keys), headers, body framing, errors as responses
- status.py     the status document, its HTML page, /metrics
- listener.py   the aiohttp app, its middleware, the App listener
"""

from buildvault.server.http.handlers import CachePath, ccache_key_to_hash, parse_cache_path
from buildvault.server.http.listener import HttpListener, create_app

__all__ = ["CachePath", "HttpListener", "ccache_key_to_hash", "create_app", "parse_cache_path"]
