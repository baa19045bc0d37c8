"""The local content-addressed store: the fast tier, with one LRU and one size cap for CAS and AC.

One process per root (an flock on root/LOCK). The modules, one concern each:

    layout       the on-disk layout and index-key format (constants), namespaces, listings
                 read back into keys
    records      small blobs and action entries as LMDB records: format, checks, charge
    core         the one owner of the shared state: the in-memory index (LRU order, space,
                 reservations, eviction choice, action entries in memory, FindMissingBlobs)
                 and what is in flight; claims, publishes, eviction, healing; the keys and
                 paths of entries, which entries are records; the worker pool and its
                 coalescer (one trip per event-loop iteration for small operations)
    fileops      file operations run in the worker threads; temp files
    writes       the write path: receive, verify, publish; BatchUpdateBlobs
    reads        the two faces (DiskBlobStore, DiskActionStore), where a request enters; ranged
                 reads, batches, lookup by hash, action entries; the chunk iterators
    snapshot     the index snapshot's format
    durability   sync points, the SYNC marker, crash re-verification
    startup      lock, temp clean-up, index rebuild, records reconciled and re-verified
    store        DiskStorage: open, close, checkpoints, sync points, observables

The store parses no REAPI message: after an unclean shutdown it checks action entries with the
validator it was opened with (buildvault.actions.entry_is_intact in the server).
"""

from buildvault.storage.disk.core import DiskStats
from buildvault.storage.disk.reads import DiskActionStore, DiskBlobStore
from buildvault.storage.disk.store import DiskStorage
from buildvault.storage.disk.writes import SMALL_OP, WRITE_BATCH

__all__ = ["SMALL_OP", "WRITE_BATCH", "DiskActionStore", "DiskBlobStore", "DiskStats", "DiskStorage"]
