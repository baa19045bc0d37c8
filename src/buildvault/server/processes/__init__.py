"""Several server processes (`--processes N`): the roles. The store they share is
buildvault.storage.processes (wire, client, the primary's store server).

    supervisor  process_count and Secondaries: the primary starts, restarts and stops them
    secondary   a secondary's main (`python -m buildvault.server.processes.secondary`): the gRPC
                cache services on the primary's port, over the primary's store
    relay       a secondary's RPC observations sent to the primary's /metrics, and counted there
"""
