"""Operator commands run beside the server: `healthcheck`, `status`, `verify`, `gc`.

Each command is a module with a `run(args) -> int` entry point; cli.py only wires the flags.
Exit codes: 0 success, 1 the check failed or found problems, 2 bad input (a message names the
setting).
"""
