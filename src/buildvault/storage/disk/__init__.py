"""The local content-addressed store: the fast tier, with one LRU and one size cap for CAS and AC.

One process per root (an flock on root/LOCK). The modules, one concern each:

    layout       paths, namespaces, index-key encoding, which entries are records, listings
    records      small blobs and action entries as LMDB records: format, checks, charge
    index        the in-memory index: LRU order, space accounting, reservations, eviction
                 choice, action entries kept in memory, FindMissingBlobs
    core         the one owner of the shared state (the index, the pool and its coalescer,
                 renames and unlinks in flight, suspects): space, claims, publishes, eviction,
                 healing
    fileops      file operations run in the worker threads; temp files
    writes       receive, verify, publish; BatchUpdateBlobs
    reads        ranged reads, batches, lookup by hash, action entries; the chunk iterators
    snapshot     the index snapshot's format
    durability   sync points, the SYNC marker, crash re-verification
    startup      lock, temp clean-up, index rebuild, records reconciled and re-verified
    store        DiskStorage and its DiskBlobStore / DiskActionStore faces

The store parses no REAPI message: after an unclean shutdown it checks action entries with the
validator it was opened with (buildvault.actions.entry_is_intact in the server).
"""

from buildvault.storage.disk.index import DiskStats
from buildvault.storage.disk.store import DiskActionStore, DiskBlobStore, DiskStorage
from buildvault.storage.disk.writes import SMALL_OP, WRITE_BATCH

__all__ = ["SMALL_OP", "WRITE_BATCH", "DiskActionStore", "DiskBlobStore", "DiskStats", "DiskStorage"]
