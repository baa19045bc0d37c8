"""Generated protobuf package (see buildvault.remote_apis.regen)."""
