"""What every command group shares: the parser class, argument types, output paths and the chip from flags (the
model and the Plan from flags: :mod:`lab.cli.model_args`).

Each command module (``analytic``, ``train``, ``infer``, ``audit``, ``run``) imports from here, ``model_args`` and
``commands`` and from no other command module; ``main`` imports them all. So the command line has no import cycles.
"""

from __future__ import annotations

import argparse
import math
import os
import re
import sys
from collections.abc import Callable, Mapping
from pathlib import Path

from lab.core.errors import UserError
from lab.core.hardware import Chip, default_catalog, parse_scale, scale_chip
from lab.core.schema import (
    INT_LIMIT,
    parse_fraction,
    parse_nonneg_float,
    parse_nonneg_int,
    parse_positive_float,
    parse_positive_int,
    parse_positive_ints,
)
from lab.core.table import non_finite
from lab.core.units import canonical_dtype, dtype_bytes

TYPE_CHECKING = False  # typing is not imported at run time: annotations only
if TYPE_CHECKING:
    from typing import Any, NoReturn


def _columns() -> int:
    """The terminal's width as ``shutil.get_terminal_size`` reads it: ``COLUMNS``, else the terminal, else 80."""
    try:
        return int(os.environ.get("COLUMNS") or 0) or os.get_terminal_size(sys.__stdout__.fileno()).columns
    except (ValueError, OSError, AttributeError):
        return 80


class _Formatter(argparse.HelpFormatter):
    """argparse's help formatter, its width read from the terminal without ``shutil`` (which argparse imports for
    it, and with it three compression modules: a tenth of an analytic command's start-up). argparse makes one for
    every flag it adds, so the width is read once a process."""

    _width: int | None = None

    def __init__(self, prog: str, indent_increment: int = 2, max_help_position: int = 24, width: int | None = None):
        if width is None:
            if _Formatter._width is None:
                _Formatter._width = _columns() - 2
            width = _Formatter._width
        super().__init__(prog, indent_increment, max_help_position, width)


def _remember_catalog_lookups() -> None:
    """argparse passes every help string and label through gettext, which looks on disk for a message catalog each
    time (about 60 lookups and 350 ``stat`` calls for one command's parser); keep each answer for the process.
    Only lookups with the default languages (argparse's) are kept: the result depends on the environment alone."""
    import gettext

    if getattr(gettext.find, "remembered", False):
        return
    find, seen = gettext.find, {}

    def remembered(domain, localedir=None, languages=None, all=False):
        if languages is not None:
            return find(domain, localedir, languages, all)
        key = (domain, localedir, all)
        if key not in seen:
            seen[key] = find(domain, localedir, None, all)
        return seen[key]

    remembered.remembered = True
    gettext.find = remembered


NEGATIVE_NUMBER = re.compile(r"^-(\d[\d,]*|\d*\.\d+)([.\d]*)([eE][+-]?\d+)?$")


class Parser(argparse.ArgumentParser):
    """argparse, but a usage mistake is one line and exit code 2 (and its help laid out without ``shutil``)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        _remember_catalog_lookups()
        kwargs.setdefault("formatter_class", _Formatter)
        super().__init__(*args, **kwargs)
        # A negative number in any form is a flag's value, to be refused by its type with the value named (argparse
        # knows only -1 and -.5, and took --bytes -1e6 or --pp-split -1,17 for a missing value): no flag of the
        # lab's starts with a digit.
        self._negative_number_matcher = NEGATIVE_NUMBER

    def error(self, message: str) -> NoReturn:
        hint = ""
        if "invalid choice" in message or "required" in message:
            hint = f" (see: {self.prog} --help)"
        self.exit(2, f"{self.prog}: error: {message}{hint}\n")


def _arg_type(parse, what: str, kind: str, **kw):
    """An argparse ``type`` from a :mod:`lab.core.schema` parser: argparse names the flag, the message the rest.
    ``kind`` (the schema's name for what it accepts) lets the tests find every flag of a kind."""

    def conv(s: str):
        try:
            return parse(s, "", **kw)
        except UserError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    conv.__name__ = what
    conv.kind = kind
    return conv


def positive_int(what: str):
    """``type=`` of an integer flag > 0 (``8192``, ``8k``, ``2Mi``, ``1e6``)."""
    return _arg_type(parse_positive_int, what, "int+")


def nonneg_int(what: str):
    """``type=`` of an integer flag >= 0."""
    return _arg_type(parse_nonneg_int, what, "int0")


def positive_float(what: str, example: str = "2.5 or 1e12"):
    """``type=`` of a positive, finite number."""
    return _arg_type(parse_positive_float, what, "number+", example=example)


def nonneg_float(what: str, example: str = "0 or 1e12"):
    """``type=`` of a finite number >= 0."""
    return _arg_type(parse_nonneg_float, what, "number0", example=example)


def fraction(what: str):
    """``type=`` of a fraction in (0, 1] (an MFU)."""
    return _arg_type(parse_fraction, what, "fraction")


def positive_ints(what: str):
    """``type=`` of a comma-separated list of positive integers (``1,2,4,8``; no empty items)."""
    return _arg_type(parse_positive_ints, what, "ints+")


CHART_FORMATS = ("png", "svg", "pdf", "jpg", "jpeg", "eps", "ps", "tif", "tiff")  # matplotlib writes these


def in_path(what: str):
    """``type=`` of a file a command reads: a non-empty path without NUL bytes (an empty one would read as "not
    given" and be ignored); whether it exists and parses is checked by its loader, with the file named."""
    return text_arg(what, "a file path", kind="path")


def text_arg(what: str, example: str, kind: str = "text"):
    """``type=`` of a non-empty name (an empty one would read as "not given" and be ignored)."""

    def conv(s: str) -> str:
        if not s.strip():
            raise argparse.ArgumentTypeError(f"the value is empty; give {example}")
        if "\0" in s:
            raise argparse.ArgumentTypeError(f"{s!r} contains a NUL byte; give {example}")
        if kind in ("path", "out", "chart", "folder"):
            from lab.core.paths import check_names

            try:
                check_names(s, "the path")
            except UserError as exc:
                raise argparse.ArgumentTypeError(str(exc).removeprefix("the path: ")) from None
        return s

    conv.__name__ = what
    conv.kind = kind
    return conv


def add_target(parser: argparse.ArgumentParser, when: str = "", gpus: bool = True) -> None:
    """``--target TOPOLOGY`` (dest ``topology``): compile for a TPU topology (or GPUs) that need not be here."""
    also = " or GPUs, e.g. h100:8 (needs JAX's CUDA plugin, the gpu-aot extra)" if gpus else ""
    parser.add_argument(
        "--target",
        dest="topology",
        metavar="TOPOLOGY",
        type=text_arg("--target", "a TPU topology such as v5e:2x4"),
        help=f"{when}compile for a TPU topology that need not be here, e.g. v5e:2x4, v5p:2x2x2, v6e:4x4 (needs "
        f"libtpu){also}; priced on that chip unless --hardware is given",
    )


def add_calls(parser: argparse.ArgumentParser, warmup_help: str, repeats_help: str) -> None:
    """``--warmup N`` and ``--repeats N``: untraced calls of a program, then profiled ones (default None: the
    command's own counts, which each help states), each at most :data:`lab.core.limits.MAX_CALLS` in every
    command that takes them."""
    parser.add_argument("--warmup", metavar="N", type=_calls(nonneg_int("--warmup")), help=warmup_help)
    parser.add_argument("--repeats", metavar="N", type=_calls(positive_int("--repeats")), help=repeats_help)


def _calls(base):
    """``base`` (an integer flag's type) bounded by the calls a profile can hold."""
    from lab.core.limits import MAX_CALLS

    def conv(s: str) -> int:
        n = base(s)
        if n > MAX_CALLS:
            raise argparse.ArgumentTypeError(f"{n} is more calls than a profile can hold; give at most {MAX_CALLS}")
        return n

    conv.__name__, conv.kind = base.__name__, base.kind
    return conv


def scale_arg(s: str) -> str:
    """``type=`` of ``--scale``: checked at once (:func:`lab.core.hardware.parse_scale`), kept as its text."""
    try:
        parse_scale(s)
    except UserError as exc:
        raise argparse.ArgumentTypeError(str(exc).removeprefix("--scale: ").removeprefix("--scale ")) from None
    return s


scale_arg.kind = "scale"


def out_path(what: str):
    """``type=`` of a file a command writes: like :func:`in_path`; before the command runs, the command line checks
    the path (:func:`lab.core.paths.check_file`: its folder writable, its names not too long, an existing file
    replaced only if the lab wrote it or ``--overwrite`` is given)."""
    return text_arg(what, "a file path", kind="out")


def folder_path(what: str):
    """``type=`` of a folder a command writes into (``--out``): checked before the command runs
    (:func:`lab.core.paths.check_folder`)."""
    return text_arg(what, "a folder", kind="folder")


def add_overwrite(parser: argparse.ArgumentParser, *, force_alias: bool = True) -> None:
    """``--overwrite`` (also spelled ``--force`` where the command has no other ``--force``): a command that writes
    a file the user names may replace one shardlab did not write."""
    flags = ("--overwrite", "--force") if force_alias else ("--overwrite",)
    parser.add_argument(
        *flags,
        dest="overwrite",
        action="store_true",
        help="replace an existing output file that shardlab did not write",
    )


def check_outputs(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Every output path the command line gives, checked before the command runs (:mod:`lab.core.paths`): files
    (``out_path``, ``chart_path``) and folders (``folder_path``)."""
    from lab.core.paths import check_file, check_folder

    for action in _chosen_actions(parser, args):
        value, kind = getattr(args, action.dest, None), getattr(action.type, "kind", None)
        if value is None or kind not in ("out", "chart", "folder"):
            continue
        flag = action.option_strings[0] if action.option_strings else action.dest
        if kind == "folder":
            check_folder(value, flag)
        else:
            check_file(value, flag, force=getattr(args, "overwrite", False))


def _chosen_actions(parser: argparse.ArgumentParser, args: argparse.Namespace) -> list[argparse.Action]:
    """The actions of the (sub)parser the command line chose, its parents' included."""
    out = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            chosen = getattr(args, action.dest, None)
            if chosen in action.choices:
                out += _chosen_actions(action.choices[chosen], args)
        else:
            out.append(action)
    return out


def chart_path(what: str):
    """``type=`` of a chart file: :func:`out_path` whose suffix names a format matplotlib writes (``.png``)."""
    base = out_path(what)

    def conv(s: str) -> str:
        s = base(s)
        suffix = Path(s).suffix.lower().lstrip(".")
        if suffix not in CHART_FORMATS:
            raise argparse.ArgumentTypeError(
                f"{s!r} does not end in a chart format; use .png (or .{', .'.join(CHART_FORMATS[1:])})"
            )
        return s

    conv.__name__ = what
    conv.kind = "chart"
    return conv


def write_chart(path: str | None, default: str, draw: Callable[[Path], Any]) -> str:
    """Draw the chart to ``path`` (else ``default``), creating its folder; an unwritable place is a UserError."""
    png = Path(path or default)
    try:
        png.parent.mkdir(parents=True, exist_ok=True)
        draw(png)
    except OSError as exc:
        raise UserError(f"cannot write the chart to {str(png)!r}: {exc.strerror}; pass --png PATH") from None
    return str(png)


def dtype_arg(s: str) -> str:
    try:
        return canonical_dtype(s)
    except UserError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


dtype_arg.kind = "dtype"


def parse_bytes(text: str) -> float:
    """``33554432``, ``32Mi``, ``1e6`` or an array such as ``bf16[2048,8192]`` -> bytes (below 2**63)."""
    s = str(text).strip()
    m = re.fullmatch(r"([A-Za-z0-9_]+)\[([^\]]*)\]", s)
    if m:
        dt = canonical_dtype(m.group(1))
        n = math.prod(parse_positive_ints(m.group(2), f"--bytes {text}: dims"))
        if n >= INT_LIMIT or n * dtype_bytes(dt) >= INT_LIMIT:  # ints first: a float of n may overflow
            raise UserError(f"--bytes: {text!r} is too large; use an array of fewer than 2**63 bytes")
        return n * dtype_bytes(dt)
    try:
        return float(parse_positive_int(s, "--bytes"))
    except UserError:
        raise UserError(
            f"--bytes: {text!r} is not a byte count; use e.g. 33554432, 32Mi, 1e6 or bf16[2048,8192]"
        ) from None


def chip_of(args: argparse.Namespace) -> Chip:
    chip = default_catalog(args.hardware_file).get(args.hardware)
    scale = getattr(args, "scale", None)
    return scale_chip(chip, scale) if scale else chip


def with_chip(fn):
    """Adapt ``fn(args, chip)`` to the ``func(args)`` that main() calls."""

    def run(args: argparse.Namespace):
        return fn(args, chip_of(args))

    return run


def _given_numbers(parser: argparse.ArgumentParser, args: argparse.Namespace) -> str:
    """The numeric flags set away from their defaults, as ``--tokens 1e+300, --chips 8``."""
    out = []
    for a in parser._actions:
        v = getattr(args, a.dest, None)
        if a.option_strings and isinstance(v, int | float) and not isinstance(v, bool) and v != a.default:
            out.append(f"{a.option_strings[0]} {v:g}" if isinstance(v, float) else f"{a.option_strings[0]} {v}")
        elif a.option_strings and isinstance(v, tuple) and v and all(isinstance(x, int) for x in v):
            out.append(f"{a.option_strings[0]} {','.join(map(str, v))}")
    return ", ".join(out) or "the defaults"


def warn(args: argparse.Namespace, message: str) -> None:
    """Say ``message`` on stderr once the command has succeeded (a command that then fails prints its one error
    line and nothing else)."""
    args.__dict__.setdefault("_warnings", []).append(message)


def command(
    parser: argparse.ArgumentParser,
    fn: Callable[[argparse.Namespace], tuple[dict[str, Any], str]],
    allowed: Callable[[str, Mapping[str, Any]], bool] | None = None,
) -> None:
    """Make ``fn`` the command of ``parser``, with what every command shares.

    * ``--hardware-file`` is read before anything else, whether or not the command prices a chip: a missing or
      broken file is an error everywhere, never silently ignored.
    * Warnings (:func:`warn`) are printed only when the command succeeds: a failure is one line.
    * The result must be finite: an ``inf`` or ``nan`` (an input so large the arithmetic overflowed) is a
      :class:`UserError` naming the value and the numbers given, not a JSON null with exit 0. ``allowed(key,
      table)`` names the infinities that mean something (see :func:`lab.core.table.non_finite`).
    """

    def run(args: argparse.Namespace) -> tuple[dict[str, Any], str]:
        if getattr(args, "hardware_file", None):
            default_catalog(args.hardware_file)
        data, text = fn(args)
        bad = non_finite(data, allowed)
        if bad is not None:
            path, value = bad
            raise UserError(
                f"the result's {path} came out {value}: an input is too large or too small for the arithmetic "
                f"(given: {_given_numbers(parser, args)}); use values in a realistic range"
            )
        for message in args.__dict__.get("_warnings", ()):
            print(f"shardlab: warning: {message}", file=sys.stderr)
        return data, text

    parser.set_defaults(func=run)


# The longest sequence a flag may ask for: 2**24 = 16,777,216 tokens, past the longest context any released model
# claims (10M tokens, Llama 4 Scout); a longer one is a typo, and the estimators' arithmetic would price it anyway.
MAX_SEQ_LEN = 2**24


def common_parent() -> argparse.ArgumentParser:
    """``--json`` and ``--hardware-file``, which every command takes."""
    common = Parser(add_help=False)
    common.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    common.add_argument(
        "--hardware-file",
        type=in_path("--hardware-file"),
        metavar="FILE",
        help="TOML or JSON file adding or overriding chips (same format calibration writes)",
    )
    return common


def hardware_parent(required: bool = True) -> argparse.ArgumentParser:
    """``--hardware NAME`` and ``--scale`` what-ifs."""
    hw = Parser(add_help=False)
    hw.add_argument(
        "--hardware",
        required=required,
        metavar="NAME",
        help="chip name or alias (tpu-v5e, v5e, h100, a100, cpu...); see `shardlab hardware list`",
    )
    hw.add_argument(
        "--scale",
        type=scale_arg,
        metavar="FIELD=X,...",
        help="what-if: multiply chip fields, e.g. hbm_bandwidth=2,flops=1.5,ici_bandwidth=0.5",
    )
    return hw


def check_checkpoints(k: float | None) -> None:
    """--checkpoints-per-layer: a few to a few hundred saved [tokens, d_model] tensors; more is a typo."""
    from lab.predict.training.config import MAX_CHECKPOINTS_PER_LAYER

    if k is not None and k > MAX_CHECKPOINTS_PER_LAYER:
        raise UserError(
            f"--checkpoints-per-layer {k:g}: a layer saves a few to a few hundred [tokens, d_model] tensors, never "
            f"that many; give at most {MAX_CHECKPOINTS_PER_LAYER}, e.g. 2 or 4.5"
        )


__all__ = [
    "MAX_SEQ_LEN",
    "Parser",
    "add_overwrite",
    "chart_path",
    "check_checkpoints",
    "check_outputs",
    "chip_of",
    "command",
    "common_parent",
    "dtype_arg",
    "folder_path",
    "fraction",
    "hardware_parent",
    "in_path",
    "nonneg_float",
    "nonneg_int",
    "out_path",
    "parse_bytes",
    "positive_float",
    "positive_int",
    "positive_ints",
    "scale_arg",
    "warn",
    "with_chip",
    "write_chart",
]
