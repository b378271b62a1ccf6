"""``shardlab``: the command line, a thin layer over the lab's functions.

Every command takes ``--json`` and then prints exactly one JSON object (the function's dataclass,
serialized). User mistakes exit with code 2 and one line on stderr naming the bad value and a valid
alternative. Each command group lives in its own module; this one only assembles the parser.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import sys
from collections.abc import Sequence

from lab.cli.commands import COMMANDS, GROUPS, JAX_COMMANDS
from lab.core.errors import (
    Interrupted,
    UserError,
    interrupt_in,
    keep_interrupts,
    keep_terminations,
    release_terminations,
    terminated,
)


def build_parser(argv: Sequence[str] | None = None) -> argparse.ArgumentParser:
    """The ``shardlab`` parser. Given the command line, only its command's group is built and imported (the
    others are listed by name and help, from :mod:`lab.cli.commands`); without one, every group is."""
    import importlib

    from lab import __version__
    from lab.cli.args import Parser, common_parent, hardware_parent, with_chip

    chosen = _command(argv)
    groups = {COMMANDS[chosen][0]} if chosen else set(GROUPS)
    common, hw = common_parent(), hardware_parent()
    p = Parser(prog="shardlab", description="Predict, compile and measure sharded JAX Transformer workloads.")
    p.add_argument("--version", action="version", version=f"shardlab {__version__}")
    p.add_argument(
        "--debug", action="store_true", help="show the traceback of an internal error (anywhere on the line)"
    )
    sub = p.add_subparsers(dest="command", required=True, parser_class=Parser, metavar="COMMAND")
    for group in GROUPS:
        if group not in groups:  # listed, never parsed: its command would have chosen its group
            for name, (module, text) in COMMANDS.items():
                if module == group:
                    sub.add_parser(name, help=text)
            continue
        module = importlib.import_module(f"lab.cli.{group}")
        if group in ("analytic",):
            module.register(sub, common, hw)
        elif group in ("train", "model", "infer", "plan", "study", "validate"):
            module.register(sub, common, hw, with_chip)
        else:
            module.register(sub, common)
    if not chosen or {"-h", "--help"} & set(argv or ()):  # help is printed: every flag says its unit and default
        from lab.cli.flag_help import document

        document(p)
    return p


def _command(argv: Sequence[str] | None) -> str | None:
    """The command a command line names (its first word that is not an option), if it is one."""
    for word in argv or ():
        if not word.startswith("-"):
            return word if word in COMMANDS else None
    return None


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command: exit 0, 2 for a user mistake, 130 on Ctrl-C (143 on SIGTERM), 1 for a bug (traceback with
    --debug).

    Called without ``argv`` (the ``shardlab`` script, ``python -m lab``) the process is the command's own."""
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv
    sys.unraisablehook = keep_interrupts  # a Ctrl-C inside a finalizer is kept, not printed and lost
    argv = [a for a in argv if a != "--debug"]
    chosen = _command(argv)
    if "jax" not in sys.modules and chosen in JAX_COMMANDS | {None}:  # libtpu on a host without TPUs: no screen
        from lab.compile.target import quiet_absent_tpu  # of its warnings (analytic commands never start JAX)

        quiet_absent_tpu()
    if chosen not in JAX_COMMANDS:
        return _run(argv, chosen, debug)
    keep_terminations(start=True)  # SIGTERM as Ctrl-C while the command runs
    try:
        return _run(argv, chosen, debug)
    finally:
        release_terminations()


def _interrupted(exc: KeyboardInterrupt) -> int:
    """Ctrl-C's (or SIGTERM's) one line, what was kept, and its exit code."""
    kept = str(exc) if isinstance(exc, Interrupted) else "nothing was being written"
    if terminated():
        print(f"shardlab: terminated: {kept}", file=sys.stderr)
        return 143
    print(f"shardlab: interrupted: {kept}", file=sys.stderr)
    return 130


def _run(argv: list[str], chosen: str | None, debug: bool) -> int:
    """The command, its output, and its exit code (see :func:`main`)."""
    try:
        if chosen in JAX_COMMANDS:  # JAX_PLATFORMS and XLA_FLAGS, before JAX reads them
            from lab.run.preflight import check_environment

            check_environment()
        parser = build_parser(argv)
        args = parser.parse_args(argv)
        from lab.cli.args import check_outputs

        check_outputs(parser, args)  # every path it will write, before any work
        data, text = args.func(args)
        if args.json:
            from lab.core.table import dumps

            out = dumps(data)
        else:
            out = text
    except UserError as exc:
        print(f"shardlab: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as exc:  # Ctrl-C or SIGTERM: what was kept, never a traceback
        return _interrupted(exc)
    except Exception as exc:
        if (interrupt := interrupt_in(exc)) is not None and not debug:  # an error the interrupt caused
            return _interrupted(interrupt)
        said = _environment_error(exc)
        if said is not None and not debug:
            print(f"shardlab: error: {said}", file=sys.stderr)
            return 2
        if debug:
            raise
        print(
            f"shardlab: internal error: {type(exc).__name__}: {exc} (a bug in shardlab; rerun with --debug for the "
            "traceback and report it)",
            file=sys.stderr,
        )
        return 1
    with contextlib.suppress(BrokenPipeError):  # `shardlab ... | head`
        print(out)
    return getattr(args, "_exit_code", 0)


def _environment_error(exc: BaseException) -> str | None:
    """A JAX backend that would not start (a platform that is not here, more devices than the host runs), or a
    path with a name too long for the file system (given anywhere: a positional, a file's entry): the user's
    environment, not a bug."""
    if isinstance(exc, OSError) and exc.errno == errno.ENAMETOOLONG:
        return f"{str(exc.filename)[:60]!r}...: a name in the path is too long for the file system; give a shorter one"
    if "jax" not in sys.modules:
        return None
    from lab.run.preflight import backend_error

    said = backend_error(exc)
    return None if said is None else str(said)


__all__ = ["build_parser", "main"]
