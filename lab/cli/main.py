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

from lab import __version__
from lab.cli import analytic, audit, infer, run, train
from lab.cli.args import Parser, common_parent, hardware_parent, with_chip
from lab.core.errors import Interrupted, UserError, keep_interrupts
from lab.core.table import dumps


def build_parser() -> argparse.ArgumentParser:
    common, hw = common_parent(), hardware_parent()
    p = Parser(prog="shardlab", description="Predict, compile and measure sharded JAX Transformer workloads.")
    p.add_argument("--version", action="version", version=f"shardlab {__version__}")
    p.add_argument(
        "--debug", action="store_true", help="show the traceback of an internal error (anywhere on the line)"
    )
    sub = p.add_subparsers(dest="command", required=True, parser_class=Parser, metavar="COMMAND")
    analytic.register(sub, common, hw)
    train.register(sub, common, hw, with_chip)
    infer.register(sub, common, hw, with_chip)
    audit.register(sub, common)
    run.register(sub, common)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command: exit 0, 2 for a user mistake, 130 on Ctrl-C, 1 for a bug (traceback with --debug)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv
    sys.unraisablehook = keep_interrupts  # a Ctrl-C inside a finalizer is kept, not printed and lost
    argv = [a for a in argv if a != "--debug"]
    try:
        args = build_parser().parse_args(argv)
        data, text = args.func(args)
        out = dumps(data) if args.json else text
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
