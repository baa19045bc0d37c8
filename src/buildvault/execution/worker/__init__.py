"""The worker side of remote execution: fetch an action's inputs through the server's CAS, run its
command in a sandbox, upload its outputs, and answer an ActionResult.

- inputs.py   the input root, materialised from Directory messages
- sandbox.py  bubblewrap (host filesystem read-only, no network) or a plain process group
- process.py  run the command with its exact environment; timeout and cancel kill the group
- outputs.py  output files, directories (as Tree blobs) and symlinks, old and new fields
- runner.py   one action from start to ActionResult
- main.py     a worker process: jobs arrive as frames on stdin (execution.wire)
"""
