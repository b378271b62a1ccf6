"""The exception types the command line turns into exit codes.

* :class:`UserError`: a user mistake; exit 2 and one line on stderr naming the bad value and what is valid.
* :class:`Interrupted`: Ctrl-C during a run; exit 130 and one line saying what was kept and how to resume
  (SIGTERM the same, exit 143).

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


# SIGTERM (a scheduler's or `kill`'s) is Ctrl-C too: the same finished results kept, the same one line, exit 143.
# libtpu installs a failure handler for it when JAX's backend starts (it prints a stack dump and dies), so the lab's
# is installed while a command runs and again once devices exist (kernels.mesh.make_mesh, lab.run.environment).
_terminate = {"wanted": False, "signal": None, "previous": None}


def keep_terminations(start: bool = False) -> None:
    """Route SIGTERM to the Ctrl-C path: ``start`` (the command line, as a command begins) turns it on; later
    calls, once a backend has started, put the handler back where libtpu replaced it. Main thread only."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        return
    if start:
        _terminate.update(wanted=True, signal=None, previous=signal.getsignal(signal.SIGTERM))
    if _terminate["wanted"]:
        signal.signal(signal.SIGTERM, _on_terminate)


def release_terminations() -> None:
    """The command ended: SIGTERM back to what it was before."""
    import signal
    import threading

    if _terminate["wanted"] and threading.current_thread() is threading.main_thread():
        previous = _terminate["previous"]
        signal.signal(signal.SIGTERM, previous if previous is not None else signal.SIG_DFL)
    _terminate["wanted"] = False


def terminated() -> bool:
    """The interrupt being handled came from SIGTERM."""
    return _terminate["signal"] is not None


def _on_terminate(signum, _frame) -> None:
    _terminate["signal"] = signum
    raise KeyboardInterrupt


def interrupt_in(exc: BaseException) -> KeyboardInterrupt | None:
    """The Ctrl-C (or SIGTERM) behind ``exc``: itself, or the one being handled when ``exc`` was raised.

    Python's own threading code can turn an interrupt into another error: on 3.11 a signal landing inside a lock's
    bookkeeping (``Condition.wait``, ``Thread.join``) makes its cleanup release the lock twice, and
    ``RuntimeError: release unlocked lock`` escapes with the KeyboardInterrupt as its context (once in about 1,700
    interrupted heartbeats here; a CI run met it). Such an error is the interrupt, not a bug."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, KeyboardInterrupt):
            return exc
        seen.add(id(exc))
        exc = exc.__context__
    return None


def raise_if_interrupted() -> None:
    """Raise the KeyboardInterrupt a callback swallowed, now that it can be handled."""
    if _swallowed["interrupt"]:
        _swallowed["interrupt"] = False
        raise KeyboardInterrupt
