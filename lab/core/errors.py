"""The one exception type for user mistakes.

The CLI turns a :class:`UserError` into exit code 2 and a single line on stderr; anything else is
a bug in shardlab and keeps its traceback.
"""


class UserError(ValueError):
    """Bad input from a user: the message names the bad value and what would be valid."""
