"""The exception types the command line turns into exit codes.

* :class:`UserError`: a user mistake; exit 2 and one line on stderr naming the bad value and what is valid.
* :class:`Interrupted`: Ctrl-C during a run; exit 130 and one line saying what was kept and how to resume.

Anything else is a bug in shardlab: one line saying so (exit 1), and the traceback under ``--debug``.
"""


class UserError(ValueError):
    """Bad input from a user: the message names the bad value and what would be valid."""


class Interrupted(KeyboardInterrupt):
    """Ctrl-C, with what was kept: the message says which results are complete and how to go on."""
