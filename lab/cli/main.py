"""``shardlab``: the command line, a thin layer over the lab's functions.

Every command takes ``--json`` and then prints exactly one JSON object (the function's dataclass,
serialized). User mistakes exit with code 2 and one line on stderr naming the bad value and a valid
alternative. Each command group lives in its own module; this one only assembles the parser.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from collections.abc import Sequence

from lab.cli.commands import COMMANDS, GROUPS, JAX_COMMANDS
from lab.core.errors import Interrupted, UserError, keep_interrupts


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
    """Run one command: exit 0, 2 for a user mistake, 130 on Ctrl-C, 1 for a bug (traceback with --debug).

    Called without ``argv`` (the ``shardlab`` script, ``python -m lab``) the process is the command's own."""
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv
    sys.unraisablehook = keep_interrupts  # a Ctrl-C inside a finalizer is kept, not printed and lost
    argv = [a for a in argv if a != "--debug"]
    chosen = _command(argv)
    if "jax" not in sys.modules and chosen in JAX_COMMANDS | {None}:  # libtpu on a host without TPUs: no screen
        from lab.compile.target import quiet_absent_tpu  # of its warnings (analytic commands never start JAX)

        quiet_absent_tpu()
    try:
        args = build_parser(argv).parse_args(argv)
        data, text = args.func(args)
        if args.json:
            from lab.core.table import dumps

            out = dumps(data)
        else:
            out = text
    except UserError as exc:
        print(f"shardlab: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as exc:  # Ctrl-C: what was kept, never a traceback
        kept = str(exc) if isinstance(exc, Interrupted) else "nothing was being written"
        print(f"shardlab: interrupted: {kept}", file=sys.stderr)
        return 130
    except Exception as exc:
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


__all__ = ["build_parser", "main"]
