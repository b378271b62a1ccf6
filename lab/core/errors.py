"""The exception types the command line turns into exit codes.

* :class:`UserError`: a user mistake; exit 2 and one line on stderr naming the bad value and what is valid.
* :class:`Interrupted`: Ctrl-C during a run; exit 130 and one line saying what was kept and how to resume.

Anything else is a bug in shardlab: one line saying so (exit 1), and the traceback under ``--debug``.
"""


class UserError(ValueError):
    """Bad input from a user: the message names the bad value and what would be valid."""


class Interrupted(KeyboardInterrupt):
    """Ctrl-C, with what was kept: the message says which results are complete and how to go on."""


# Ctrl-C can land while Python runs a callback that cannot raise (a weakref's or a finalizer's): Python then
# prints "Exception ignored in ..." and carries on, and the interrupt is lost. The command line installs
# :func:`keep_interrupts` as ``sys.unraisablehook``; the run checks :func:`raise_if_interrupted` between phases.
_swallowed = {"interrupt": False}


def keep_interrupts(unraisable) -> None:
    """``sys.unraisablehook``: remember a swallowed Ctrl-C (quietly); anything else as Python reports it."""
    import sys

    if isinstance(unraisable.exc_value, KeyboardInterrupt):
        _swallowed["interrupt"] = True
        return
    sys.__unraisablehook__(unraisable)


def raise_if_interrupted() -> None:
    """Raise the KeyboardInterrupt a callback swallowed, now that it can be handled."""
    if _swallowed["interrupt"]:
        _swallowed["interrupt"] = False
        raise KeyboardInterrupt
