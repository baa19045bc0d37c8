"""Remote Asset: external downloads (a URI and qualifiers -> a blob in the CAS), served from the cache.

- `request.py`: a Fetch or Push request checked and taken apart (URIs, `checksum.sri`, the
  qualifiers that are part of an asset's name, the credentials that are not);
- `index.py`: the asset index, entries kept where action entries live (ActionStore, kind `asset`);
- `origin.py`: downloads from the origin: the SSRF rules, bounds, checksum verification, the
  body streamed into the CAS;
- `locks.py`: one download of an asset across the server's processes (a lock file each);
- `service.py`: Fetch and Push behaviour (hit, download, dedup, who may download), knowing
  nothing of gRPC (server/grpc/fetch.py and push.py are its adapters).

docs/asset.md is the user's page.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from buildvault.assets.service import Assets, FetchRecorder
    from buildvault.config import Settings
    from buildvault.storage import ActionStore, BlobStore

SPOOL_DIR = "asset-downloads"  # under the data directory: a download not yet verified, the locks


def build_assets(
    settings: Settings,
    blobs: BlobStore,
    actions: ActionStore,
    recorder: FetchRecorder | None,
    *,
    primary: bool = True,
) -> Assets:
    """The Remote Asset service of a server process, from its settings (the one place it is
    assembled). The primary clears the spool directory of a crash's leftovers."""
    from buildvault.assets.index import AssetIndex
    from buildvault.assets.locks import DownloadLocks
    from buildvault.assets.origin import OriginFetcher, OriginRules
    from buildvault.assets.service import Assets

    fetcher = None
    if settings.asset_origins != "none":
        rules = OriginRules(
            settings.asset_origins, OriginRules.parse_hosts(settings.asset_allow_hosts), settings.asset_allow_private
        )
        fetcher = OriginFetcher(
            rules,
            blobs,
            Path(settings.dir) / SPOOL_DIR,
            max_size=settings.asset_max_size,
            connect_timeout=settings.asset_connect_timeout,
            total_timeout=settings.asset_timeout,
            max_downloads=settings.asset_max_downloads,
            recorder=recorder,
        )
        if primary:
            fetcher.clean_spool()
    return Assets(
        AssetIndex(actions, blobs),
        fetcher,
        reader_downloads=settings.asset_reader_downloads,
        recorder=recorder,
        locks=DownloadLocks(Path(settings.dir) / SPOOL_DIR) if fetcher is not None else None,
    )
