"""The object-store tier: an S3-compatible bucket (Huawei OBS, AWS S3, MinIO, Ceph RGW) behind
the local disk, as the shared, durable second tier. One concern per module:

    store          ObjectStore: the bucket as a BlobStore / ActionStore (keys, verified reads)
    client         the boto3 client set-up (checksum headers, timeouts) and its thread pool
    errors         boto3 / botocore errors mapped to storage errors
    presence       ExistenceCache: the bucket's FindMissing answers, remembered (PresenceIndex)
    tiered         read-through with verified backfill, journaled write-back
    journal        the durable upload journal and its uploader
    journal_files  the journal's file format (batch names, lines, durable writes)
    last_use       served action entries' LastModified renewed, so `buildvault gc` keeps them
    tier           ObjectTier: the pieces assembled for one server (journal, uploader, health)

Nothing is imported here: `store` pulls in boto3, which a server without a bucket never loads.
"""
