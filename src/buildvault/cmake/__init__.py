"""Package data: buildvault.cmake (`buildvault cmake-module-path` prints this directory)."""
