"""``shardlab ARGV`` run inside the test process, for tests of the command line that need no fresh interpreter."""

from __future__ import annotations

import contextlib
import io

from lab.cli.main import main


def run_cli(argv: list[str]) -> tuple[int, str, str]:
    """``main(argv)`` in-process: (exit code, stdout, stderr); argparse's SystemExit is an exit code too."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(list(argv))
        except SystemExit as exc:
            code = exc.code
    return code, out.getvalue(), err.getvalue()
