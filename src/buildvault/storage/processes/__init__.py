"""Several server processes over one store (`--processes N`): the store's side.

The primary owns the store stack; each secondary process reaches it over a private Unix socket:

    wire          the frames: length-prefixed, digests by column, errors as the same classes
    client        RemoteStoreClient: a secondary's BlobStore / ActionStore, calls to the primary
    store_server  StoreServer: the primary's stack served to the secondaries

The process roles (starting and supervising the secondaries, a secondary's own main, its relayed
metrics) are the server's: buildvault.server.processes.
"""
