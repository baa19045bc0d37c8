"""Request metadata and build events in SQLite: record, retain, query, explain a miss.

- `metadata.py`  the `requestmetadata-bin` header parsed (malformed headers are noted, never fatal)
- `store.py`     the database: schema, batched writes, retention by age and size, the read queries
- `recorder.py`  the server's side: records queued on the event loop, written by one thread
- `actions.py`   Action / Command / input trees read from the CAS, compared; a miss explained

Recording never fails or holds up a request: a full or broken database is logged and skipped.
"""

from buildvault.history.metadata import METADATA_KEY, Metadata, parse_metadata
from buildvault.history.recorder import Record, Recorder, history_path, recorder_from_settings

__all__ = [
    "METADATA_KEY",
    "Metadata",
    "Record",
    "Recorder",
    "history_path",
    "parse_metadata",
    "recorder_from_settings",
]
