"""The subcommands of ``fluxora-webhooks``, one module each.

Every module here has the same shape::

    NAME = "status"                     # the subcommand
    HELP = "one line for --help"
    DESCRIPTION = "..."                 # optional: the subcommand's own --help text
    def configure(parser) -> None: ...  # add its options (and sub-actions) to its parser
    def run(args, env) -> int: ...      # do the work; the exit code

``cli.py`` builds the parser from :data:`COMMANDS`, translates errors into messages and
exit codes, and nothing more. Commands share what they need through :mod:`.common`; none
imports ``cli``.
"""

from __future__ import annotations

# In the order --help lists them.
COMMANDS = (
    "migrate",
    "run",
    "endpoints",
    "dlq",
    "recover",
    "status",
    "send",
    "tail",
    "api",
    "tokens",
    "secrets",
    "prune",
    "inbox",
    "demo",
    "bench",
)
