"""The documented examples of the analytic commands, rerun: ``scripts/gen_docs`` and ``tests/test_docs.py``.

A Markdown page marks an example it wants kept true with an HTML comment on the line just above a fenced
block whose first line is the command (``$ shardlab ...``, ``\\`` continues it) and whose other lines are its
output (stdout and stderr, as a terminal shows them)::

    <!-- example -->
    ```console
    $ shardlab hardware show v5e
    ...the output...
    ```

Options go after a colon, as ``key=value`` words (quote a value with spaces):

* ``lines=1..5,-4..`` keeps those output lines (1-based, inclusive; a negative number counts from the end, an
  open end runs to the first or last line); every run of left-out lines is shown as one ``...`` line.
* ``mask=REGEX`` (may repeat): text a line matches is not compared (timings such as ``searched in \\S+ \\S+``);
  the page keeps the value of the run that last wrote it.
* ``exit=N``: the exit status the command must end with (default 0; 2 for a user mistake).
* ``jax``: the command compiles JAX programs (``audit``, ``run --compile-only``, ``--target``): it is run in a
  fresh process on 8 emulated CPU devices with no other XLA flag, so its output is the same wherever it runs.
  Only commands whose output is deterministic are marked so (a compile, an audit, a cross-compile: nothing
  timed); mask their progress lines' clock. ``tests/test_docs.py`` checks these under ``slow``.

A block that starts with ``>>> `` instead is a Python session (``... `` continues a statement): each statement
runs in turn in one namespace, and what it prints (an expression's repr, as the interpreter shows it) is its
output; ``mask=`` applies, ``lines=`` and ``exit=`` do not.

``<!-- example-file: NAME -->`` above a fenced block writes that block as ``NAME`` in the folder the examples run
in, so an example can read a file the page shows. Examples run in a scratch folder that sees the repository's
``experiments/`` (charts they draw land there, not in ``runs/``) and no host calibration (``specs/cpu.json``
would change the ``cpu`` chip). A command that starts JAX is marked only with ``jax`` (above) and only when nothing
in its output is measured; runs that profile keep hand-trimmed real outputs with no marker.

``python -m lab.cli.doc_examples`` rewrites every marked block whose output no longer matches; ``--check`` only
lists them (exit 1 if any).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import re
import shlex
import sys
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from lab.cli.commands import JAX_COMMANDS

ROOT = Path(__file__).resolve().parents[2]
MARKER = re.compile(r"^<!--\s*example(?::\s*(?P<opts>.*?))?\s*-->\s*$")
FILE_MARKER = re.compile(r"^<!--\s*example-file:\s*(?P<name>[\w.-]+)\s*-->\s*$")
FENCE = re.compile(r"^```[\w-]*\s*$")
# Commands that compile or run JAX programs: their outputs are hand-trimmed real runs, never regenerated. ``plan``
# is one only with --validate (or its --target).
NOT_ANALYTIC = JAX_COMMANDS - {"plan"}
NOT_ANALYTIC_FLAGS = {"--validate", "--target"}
GAP = "..."
MASKED = "<masked>"


class DocError(ValueError):
    """A marker the pages cannot be read with, named by file and line."""


@dataclass(frozen=True)
class Example:
    """One marked example: where it sits, what it runs, and what the page shows."""

    path: Path
    line: int  # 1-based line of the ``$`` command
    command: str  # as written after ``$``, continuations joined
    argv: tuple[str, ...]  # what follows ``shardlab``
    lines: str | None
    masks: tuple[str, ...]
    exit: int
    out_start: int  # 0-based index of the first output line in the page
    out_end: int  # 0-based index of the closing fence
    documented: tuple[str, ...]
    python: bool = False  # a ``>>>`` session: ``documented`` is the whole block, prompts included
    jax: bool = False  # compiles JAX programs: run in a fresh process on 8 emulated devices

    @property
    def name(self) -> str:
        return f"{_rel(self.path)}:{self.line}"


@dataclass
class Page:
    path: Path
    text: list[str]
    examples: list[Example] = field(default_factory=list)
    files: dict[str, str] = field(default_factory=dict)


def default_pages(root: Path = ROOT) -> list[Path]:
    """README.md and every Markdown page under docs/."""
    return [root / "README.md", *sorted((root / "docs").rglob("*.md"))]


def _rel(path: Path) -> str:
    try:
        return str(path.resolve().relative_to(ROOT))
    except ValueError:
        return str(path)


def _block(text: list[str], fence_at: int, where: str) -> int:
    """The index of the fence that closes the block opened at ``fence_at``."""
    if fence_at >= len(text) or not FENCE.match(text[fence_at]):
        raise DocError(f"{where}: the marker must sit on the line just above a fenced block (```)")
    for i in range(fence_at + 1, len(text)):
        if text[i].strip() == "```":
            return i
    raise DocError(f"{where}: the fenced block under the marker is never closed")


def _options(raw: str, where: str) -> tuple[str | None, tuple[str, ...], int, bool]:
    lines, masks, code, jax = None, [], 0, False
    try:
        words = shlex.split(raw)
    except ValueError as exc:
        raise DocError(f"{where}: cannot read the marker's options {raw!r}: {exc}") from None
    for word in words:
        key, eq, value = word.partition("=")
        if word == "jax":
            jax = True
            continue
        if not eq or key not in ("lines", "mask", "exit"):
            raise DocError(f"{where}: unknown marker option {word!r}; valid: lines=1..20, mask=REGEX, exit=N, jax")
        if key == "lines":
            try:
                _select(value, 1)  # read now, so that a bad range is named by its place
            except DocError as exc:
                raise DocError(f"{where}: {exc}") from None
            lines = value
        elif key == "mask":
            try:
                re.compile(value)
            except re.error as exc:
                raise DocError(f"{where}: mask {value!r} is not a regular expression: {exc}") from None
            masks.append(value)
        else:
            if not value.isdigit():
                raise DocError(f"{where}: exit={value!r} must be a number")
            code = int(value)
    return lines, tuple(masks), code, jax


def _command(body: list[str], start: int, where: str) -> tuple[str, int]:
    """The command of a block (joined over ``\\`` continuations) and the index of its first output line."""
    if not body or not body[0].startswith("$ "):
        raise DocError(f"{where}: a marked block starts with the command, as '$ shardlab ...'")
    parts, i = [], 0
    while True:
        line = body[i][2:] if i == 0 else body[i].strip()
        parts.append(line.removesuffix("\\").strip())
        i += 1
        if not line.endswith("\\") or i == len(body):
            return " ".join(parts), start + i


def _argv(command: str, where: str, jax: bool = False) -> tuple[str, ...]:
    words = shlex.split(command, comments=True)
    if not words or words[0] != "shardlab":
        raise DocError(f"{where}: only shardlab commands can be marked, not {command!r}")
    argv = tuple(words[1:])
    first = next((w for w in argv if not w.startswith("-")), None)
    starts_jax = first in NOT_ANALYTIC or bool(NOT_ANALYTIC_FLAGS & set(argv))
    if starts_jax and not jax:
        raise DocError(
            f"{where}: {command!r} compiles or runs JAX programs; mark it `example: jax` if nothing in its output is "
            "measured, else keep its output hand-trimmed, without a marker"
        )
    if jax and first == "run" and "--compile-only" not in argv:
        raise DocError(f"{where}: {command!r} profiles a run, whose times differ every time: keep it hand-trimmed")
    return argv


def parse(path: Path) -> Page:
    """Read a page's examples and example files."""
    text = path.read_text(encoding="utf-8").split("\n")
    page = Page(path=path, text=text)
    i = 0
    while i < len(text):
        where = f"{_rel(path)}:{i + 1}"
        if m := FILE_MARKER.match(text[i]):
            end = _block(text, i + 1, where)
            if m["name"] in page.files:
                raise DocError(f"{where}: a second example file named {m['name']!r}")
            page.files[m["name"]] = "\n".join(text[i + 2 : end]) + "\n"
            i = end
        elif m := MARKER.match(text[i]):
            end = _block(text, i + 1, where)
            lines, masks, code, jax = _options(m["opts"] or "", where)
            if end > i + 2 and text[i + 2].startswith(">>> "):
                if lines or code or jax:
                    raise DocError(f"{where}: a Python session takes mask= only")
                page.examples.append(_session(path, i + 3, masks, text[i + 2 : end], i + 2))
                i = end + 1
                continue
            command, out_start = _command(text[i + 2 : end], i + 2, where)
            page.examples.append(
                Example(
                    path=path,
                    line=i + 3,
                    command=command,
                    argv=_argv(command, where, jax),
                    lines=lines,
                    masks=masks,
                    exit=code,
                    out_start=out_start,
                    out_end=end,
                    documented=tuple(text[out_start:end]),
                    jax=jax,
                )
            )
            i = end
        i += 1
    return page


def _session(path: Path, line: int, masks: tuple[str, ...], body: list[str], start: int) -> Example:
    return Example(
        path=path,
        line=line,
        command="a Python session",
        argv=(),
        lines=None,
        masks=masks,
        exit=0,
        out_start=start,
        out_end=start + len(body),
        documented=tuple(body),
        python=True,
    )


def _statements(body: Sequence[str]) -> list[list[str]]:
    """A session's statements, each its ``>>>`` line and the ``...`` lines right after it; output lines dropped."""
    out: list[list[str]] = []
    source = False  # whether the line before was source, so that a ``...`` line continues it
    for line in body:
        if line.startswith(">>> "):
            out.append([line])
            source = True
        elif source and (line == "..." or line.startswith("... ")):
            out[-1].append(line)
        else:
            source = False
    return out


def run_session(ex: Example) -> list[str]:
    """Run a documented Python session statement by statement; the block as it should read now."""
    namespace: dict[str, object] = {"__name__": "__doc_session__"}
    shown: list[str] = []
    for statement in _statements(ex.documented):
        source = "\n".join(line[4:] for line in statement) + "\n"
        buffer = io.StringIO()
        try:
            with contextlib.redirect_stdout(buffer):
                exec(compile(source, ex.name, "single"), namespace)
        except Exception as exc:
            raise DocError(f"{ex.name}: {statement[0]!r} raised {type(exc).__name__}: {exc}") from None
        printed = buffer.getvalue().rstrip("\n")
        shown += statement + ([line.rstrip() for line in printed.split("\n")] if printed else [])
    return shown


def _select(spec: str, n: int) -> set[int]:
    """The 1-based line numbers ``spec`` (``1..5,-4..,9``) keeps of ``n`` lines."""
    keep: set[int] = set()
    for item in spec.split(","):
        lo, dots, hi = item.strip().partition("..")
        try:
            a = int(lo) if lo else 1
            b = (int(hi) if hi else n) if dots else a
        except ValueError:
            hint = "write N, A..B, A.. or ..B (a negative number counts from the end)"
            raise DocError(f"bad lines= item {item!r}: {hint}") from None
        a, b = (x if x > 0 else n + 1 + x for x in (a, b))
        keep.update(range(max(a, 1), min(b, n) + 1))
    return keep


def trim(output: str, spec: str | None) -> list[str]:
    """The output as the page shows it: trailing spaces and blank lines dropped, ``lines=`` applied."""
    lines = [line.rstrip() for line in output.split("\n")]
    while lines and not lines[-1]:
        lines.pop()
    if spec is None:
        return lines
    keep, out, gap = _select(spec, len(lines)), [], False
    for number, line in enumerate(lines, start=1):
        if number in keep:
            out.append(line)
        elif not gap:
            out.append(GAP)
        gap = number not in keep
    return out


def masked(lines: Sequence[str], masks: Sequence[str]) -> list[str]:
    out = []
    for line in lines:
        for mask in masks:
            line = re.sub(mask, MASKED, line)
        out.append(line.rstrip())
    return out


def matches(example: Example, shown: Sequence[str]) -> bool:
    """Whether freshly trimmed output ``shown`` is what the page documents, masked parts aside."""
    return masked(shown, example.masks) == masked(example.documented, example.masks)


JAX_TIMEOUT_S = 600  # one compile of a documented example: the largest, a real-size cross-compile, takes about a minute


def run_jax(argv: Sequence[str]) -> tuple[int, str]:
    """Run one JAX command in a fresh process in the current folder (a :func:`sandbox`), on 8 emulated CPU devices
    and no other XLA flag (the caller's, a test session's included, would change what XLA emits): its exit status,
    and stdout and stderr as one text."""
    import subprocess

    env = dict(os.environ)
    env.update(JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=8")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    done = subprocess.run(
        [sys.executable, "-m", "lab", *argv],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=JAX_TIMEOUT_S,
    )
    return done.returncode, done.stdout


def run(argv: Sequence[str]) -> tuple[int, str]:
    """Run one command in this process: its exit status, and stdout and stderr as one text."""
    from lab.cli.main import main

    buffer = io.StringIO()
    with contextlib.redirect_stdout(buffer), contextlib.redirect_stderr(buffer):
        code = main(list(argv))
    return code, buffer.getvalue()


@contextlib.contextmanager
def sandbox(files: dict[str, str], root: Path = ROOT) -> Iterator[Path]:
    """A scratch working folder for the examples: ``experiments/`` of ``root``, the pages' example files, and an
    empty folder of calibrated specs; the working folder and ``$SHARDLAB_SPECS_DIR`` come back afterwards."""
    from lab.core.hardware import SPECS_DIR_ENV

    with tempfile.TemporaryDirectory(prefix="shardlab-docs-") as tmp:
        folder = Path(tmp)
        (folder / "experiments").symlink_to(root / "experiments", target_is_directory=True)
        (folder / "specs").mkdir()
        for name, content in files.items():
            (folder / name).write_text(content, encoding="utf-8")
        cwd, specs = os.getcwd(), os.environ.get(SPECS_DIR_ENV)
        os.environ[SPECS_DIR_ENV] = str(folder / "specs")
        os.chdir(folder)
        try:
            yield folder
        finally:
            os.chdir(cwd)
            if specs is None:
                os.environ.pop(SPECS_DIR_ENV, None)
            else:
                os.environ[SPECS_DIR_ENV] = specs


def example_files(pages: Sequence[Page]) -> dict[str, str]:
    """Every page's example files, for one sandbox; a name two pages define differently is an error."""
    files: dict[str, str] = {}
    for page in pages:
        for name, content in page.files.items():
            if files.setdefault(name, content) != content:
                raise DocError(f"{_rel(page.path)}: example file {name!r} differs from another page's")
    return files


def current(ex: Example) -> list[str]:
    """What the page should show under ``ex`` now: the command run here (in a :func:`sandbox`), trimmed. An exit
    status other than the marker's is an error."""
    if ex.python:
        return run_session(ex)
    code, output = (run_jax if ex.jax else run)(ex.argv)
    if code != ex.exit:
        raise DocError(f"{ex.name}: `{ex.command}` exited {code}, the marker expects {ex.exit}:\n{output}")
    shown = trim(output, ex.lines)
    if any(line.startswith("```") for line in shown):
        raise DocError(f"{ex.name}: the output has a line starting with ``` that would end the block")
    return shown


def regenerate(pages: Sequence[Page], write: bool = True) -> list[str]:
    """Rerun every example, in page order; rewrite (or, ``write=False``, only name) those whose output no longer
    matches. Returns one line per such example."""
    changed = []
    with sandbox(example_files(pages)):
        for page in pages:
            stale = []
            for ex in page.examples:
                shown = current(ex)
                if not matches(ex, shown):
                    stale.append((ex, shown))
                    changed.append(f"{ex.name}: {ex.command}")
            text = list(page.text)
            for ex, shown in reversed(stale):  # from the bottom, so earlier indices stay valid
                text[ex.out_start : ex.out_end] = shown
            if write and stale:
                page.path.write_text("\n".join(text), encoding="utf-8")
    return changed


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="gen_docs", description="Rewrite the output of every marked example in README.md and docs/."
    )
    p.add_argument("pages", nargs="*", type=Path, help="Markdown pages (default: README.md and docs/**/*.md)")
    p.add_argument("--check", action="store_true", help="change nothing; exit 1 if an example is out of date")
    args = p.parse_args(argv)
    try:
        pages = [parse(path.resolve()) for path in (args.pages or default_pages())]
        changed = regenerate(pages, write=not args.check)
    except (DocError, OSError) as exc:
        print(f"gen_docs: error: {exc}", file=sys.stderr)
        return 2
    total = sum(len(page.examples) for page in pages)
    verb = "out of date" if args.check else "rewritten"
    for line in changed:
        print(f"{verb}: {line}")
    print(f"{len(changed)} of {total} examples {verb} in {len(pages)} pages")
    return 1 if args.check and changed else 0


if __name__ == "__main__":
    raise SystemExit(main())
