"""Subcommands beyond the core ones, each a module with ``command(args, env) -> int``."""
