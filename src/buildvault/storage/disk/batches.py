"""BatchUpdateBlobs on the disk store: whole blobs, the common ones in one coalesced operation.

The common case (small, new, room without evicting, no other write of the same blob in flight)
is reserved and claimed on the event loop and written in one operation per layout: the records
in one LMDB transaction (records.put_many), the files in one trip (fileops.write_many); any
other blob goes the one-by-one way (Writer.write).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import TYPE_CHECKING

from buildvault.digest import Digest, InvalidDigest
from buildvault.storage import StorageError, single_chunk
from buildvault.storage.disk import fileops, healing, records
from buildvault.storage.disk.core import SMALL_OP, Core
from buildvault.storage.disk.index import Reservation
from buildvault.storage.disk.layout import cas_key
from buildvault.storage.disk.records import held

if TYPE_CHECKING:
    from buildvault.storage.disk.writes import Writer

_Claim = tuple[int, bytes, int, Reservation, "asyncio.Future[None]"]  # item, key, size, reservation, done


async def write_blobs(writer: Writer, items: Sequence[tuple[Digest, bytes]]) -> list[Exception | None]:
    """Whole blobs (BatchUpdateBlobs). The common case (small, new, room without evicting,
    no other write of the same blob in flight) is reserved and claimed here and written in one
    coalesced operation; any other goes the one-by-one way. Like _store_small, a submitted
    write completes and is indexed even if the caller is cancelled."""
    core = writer.core
    core.check_open()
    if core.suspects:
        await healing.recheck(core, healing.named(core, (digest for digest, _ in items)))
    index = core.index
    entries = index.entries
    publishing = core.publishing
    outcomes: list[Exception | None] = [None] * len(items)
    batch: list[tuple[str, str, bytes, Digest | None]] = []
    claimed: list[_Claim] = []
    record_batch: list[records.PutItem] = []
    record_claimed: list[_Claim] = []
    limit = index.limit
    others: list[int] = []
    contended: set[int] = set()
    loop = asyncio.get_running_loop()
    tmp_dir, path = core.layout.tmp_dir, core.layout.path
    for i, (digest, data) in enumerate(items):
        size = digest.size_bytes
        try:
            key = cas_key(digest)
        except InvalidDigest as e:
            outcomes[i] = e
            continue
        if key in entries:
            index.touch(key)  # stored and verified already: the bytes need not be read
            continue
        if key in publishing or key in core.deleting:
            contended.add(i)  # e.g. the same blob twice in one batch: these bytes get checked too
            others.append(i)
            continue
        record = size <= limit and held(limit, key, size)
        cost = records.charge(key, size) if record else size
        if len(data) != size or size > SMALL_OP or index.used + index.reserved + cost > index.max_size:
            others.append(i)
            continue
        reservation = Reservation(index, cost)
        done: asyncio.Future[None] = loop.create_future()
        publishing[key] = done
        if record:
            record_batch.append((key, bytes(data), digest))
            record_claimed.append((i, key, size, reservation, done))
        else:
            batch.append((tmp_dir, path(key), bytes(data), digest))
            claimed.append((i, key, size, reservation, done))
    futures = []
    if record_batch:
        nbytes = sum(len(item[1]) for item in record_batch)
        future = core.ops.submit(records.put_many, (core.records, record_batch), nbytes)
        futures.append(settle_group(core, future, record_claimed, outcomes))
    if batch:
        future = core.ops.submit(fileops.write_many, (batch,), sum(len(item[2]) for item in batch))
        futures.append(settle_group(core, future, claimed, outcomes))
    if futures:
        await asyncio.shield(asyncio.gather(*futures, return_exceptions=True))
        for i, *_rest in [*record_claimed, *claimed]:
            error = outcomes[i]
            if isinstance(error, OSError):
                outcomes[i] = fileops.storage_error(error, f"writing {items[i][0]}")
    if others:

        async def one(i: int) -> Exception | None:
            digest, data = items[i]
            try:
                if i in contended and len(data) == digest.size_bytes <= SMALL_OP:
                    await core.ops.submit(fileops.check_hash, (bytes(data), digest))
                await writer.write(digest, single_chunk(data))
                return None
            except Exception as e:  # that blob's outcome
                return e

        for i, outcome in zip(others, await asyncio.gather(*(one(i) for i in others)), strict=True):
            outcomes[i] = outcome
    return outcomes


def settle_group(
    core: Core, future: asyncio.Future[list[Exception | None]], claimed: list[_Claim], outcomes: list[Exception | None]
) -> asyncio.Future[list[Exception | None]]:
    """When one coalesced write of several entries is done: index each written one, record the
    others' errors in `outcomes`, release the claims (runs even if the caller is cancelled)."""
    index = core.index
    publishing = core.publishing

    def finished(future: asyncio.Future[list[Exception | None]]) -> None:
        results = None if future.cancelled() else (future.exception() or future.result())
        for n, (i, key, size, reservation, done) in enumerate(claimed):
            error = results if isinstance(results, BaseException) else None if results is None else results[n]
            try:
                if results is not None and error is None:
                    index.indexed(key, reservation, size)
                else:
                    outcomes[i] = error if isinstance(error, Exception) else StorageError("write abandoned")
            finally:
                reservation.release()
                del publishing[key]
                done.set_result(None)

    future.add_done_callback(finished)
    return future
