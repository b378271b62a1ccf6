"""Fuzz: every command refuses every bad value with exit 2 and one line, never a traceback or an exit 1.

The commands are listed from the parser itself (``build_parser()``), so a new command or flag without bad values
here fails :func:`test_every_command_and_flag_is_fuzzed`. Each (command, flag) gets values of its kind that no
valid input looks like (huge, negative, zero, nan, inf, non-numeric, empty, empty list items, unknown names and
choices, paths that are missing or unwritable, files of garbage) and the command, run in-process through
``lab.cli.main.main``, must exit 2 with one line on stderr. ``run``, ``calibrate``, ``demo`` and ``launch`` start
JAX: only their pure checks run here. The experiment loader gets generated bad files and must raise ``UserError`` only.

Reproducible: hypothesis runs derandomized, with a fixed number of examples per property.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import string
import subprocess
import sys
from pathlib import Path

import pytest
from cli_runner import run_cli
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lab.cli.main import build_parser
from lab.core.errors import UserError
from lab.core.hardware import Catalog
from lab.core.models import get_model
from lab.core.programs import PROGRAMS
from lab.core.schema import (
    parse_fraction,
    parse_nonneg_float,
    parse_positive_float,
    parse_positive_int,
    parse_positive_ints,
)
from lab.core.units import canonical_dtype
from lab.predict.collectives import canonical_kind
from lab.run.experiment import EXPERIMENT, MODEL, OPTIONS, RULES, RUN, load_experiment

ROOT = Path(__file__).resolve().parent.parent
EXPERIMENTS = ROOT / "experiments"
# They start JAX (launch: processes that do); their argument checks are tested on their own below.
SKIPPED = {"run", "calibrate", "demo", "launch", "explain memory", "explain overlap", "explain sharding"}
FUZZ = settings(max_examples=10, derandomize=True, deadline=None, suppress_health_check=list(HealthCheck))
LOADER = settings(max_examples=60, derandomize=True, deadline=None, suppress_health_check=list(HealthCheck))


# ----- the commands, from the parser ----------------------------------------------------------------------------


def _leaves(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()) -> dict[str, argparse.ArgumentParser]:
    """Every runnable command (``"infer sweep"``) with its parser."""
    for a in parser._actions:
        if isinstance(a, argparse._SubParsersAction):
            out: dict[str, argparse.ArgumentParser] = {}
            for name, sub in a.choices.items():
                out |= _leaves(sub, (*path, name))
            return out
    return {" ".join(path): parser}


LEAVES = _leaves(build_parser())


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    """A scratch folder, also the working directory, so nothing a command writes lands in the checkout."""
    d = tmp_path_factory.mktemp("fuzz")
    (d / "afile").write_text("a regular file, so afile/x cannot be created\n")
    (d / "foreign.toml").write_text("# the user's own experiment file: never replaced without --overwrite\n")
    (d / "foreign.png").write_bytes(b"\x89PNG\r\n\x1a\n a chart the user made elsewhere")
    old = Path.cwd()
    os.chdir(d)
    yield d
    os.chdir(old)


def bases(work: Path) -> dict[str, list[str]]:
    """A valid command line per command (the happy path every bad value is substituted into)."""
    out = str(work / "out")
    return {
        "hardware list": ["hardware", "list"],
        "hardware show": ["hardware", "show", "h100"],
        "roofline matmul": ["roofline", "matmul", "--hardware", "h100", "--b", "8", "--d", "64", "--f", "64"],
        "roofline op": ["roofline", "op", "--hardware", "h100", "--bytes", "1Mi"],
        "roofline attention": [
            *("roofline", "attention", "--hardware", "v5e", "--b", "2", "--t", "256", "--s", "256"),
            *("--heads", "4", "--kv-heads", "2", "--head-dim", "64"),
        ],
        "collective": ["collective", "all-gather", "--hardware", "v5e", "--bytes", "1Mi", "--axis-size", "4"],
        "sharded-matmul": [
            "sharded-matmul",
            "A[I_X,J] * B[J,K_Y]",
            "--sizes",
            "I=64,J=64,K=64",
            "--mesh",
            "X=2,Y=2",
            "--hardware",
            "h100",
        ],
        "model list": ["model", "list"],
        "model show": ["model", "show", "llama3-8b"],
        "train estimate": ["train", "estimate", "--model", "llama3-8b", "--hardware", "h100", "--chips", "8"],
        "train limits": ["train", "limits", "--hardware", "h100", "--model", "llama3-8b"],
        "plan": ["plan", "--model", "llama3-8b", "--hardware", "h100", "--chips", "8", "--batch-tokens", "1Mi"],
        "study generations": ["study", "generations", "--model", "llama3-8b", "--chips", "64", "--png", f"{out}/g.png"],
        "study memory-tech": ["study", "memory-tech", "--png", f"{out}/m.png"],
        "validate": ["validate"],
        "infer estimate": [
            "infer",
            "estimate",
            "--model",
            "llama3-8b",
            "--hardware",
            "h100",
            "--chips",
            "8",
            "--batch",
            "8",
            "--context",
            "1024",
        ],
        "infer sweep": ["infer", "sweep", "--model", "llama3-8b", "--hardware", "h100", "--png", f"{out}/s.png"],
        "infer topology": ["infer", "topology", "--model", "llama3-8b", "--hardware", "h100"],
        "infer disaggregate": [
            "infer",
            "disaggregate",
            "--model",
            "llama3-8b",
            "--hardware",
            "h100",
            "--chips",
            "8",
            "--batch",
            "8",
            "--context",
            "1024",
            "--prefill-len",
            "512",
            "--generate",
            "128",
        ],
        "infer serve": [
            *("infer", "serve", "--model", "llama3-8b", "--hardware", "h100", "--rate", "10", "--requests", "50"),
            *("--png", f"{out}/serve.png"),
        ],
        "audit": ["audit", "--list"],
    }


run = run_cli


def assert_user_error(argv: list[str]) -> str:
    """The contract for a user mistake: exit 2, nothing on stdout, exactly one line on stderr, no traceback."""
    code, out, err = run(argv)
    lines = err.strip().splitlines()
    assert code == 2, f"{argv!r} exited {code}: {err.strip()[-400:]}"
    assert len(lines) == 1, f"{argv!r}: {len(lines)} lines on stderr: {err!r}"
    assert lines[0].startswith("shardlab"), (argv, lines[0])
    assert "Traceback" not in err and "internal error" not in err, (argv, err)
    assert out == "", (argv, out)
    return lines[0]


def with_value(base: list[str], flag: str, value: str, positional_at: int | None = None) -> list[str]:
    """``base`` with ``flag`` set to ``value`` (replaced where it is given, else added); a positional is replaced."""
    argv = list(base)
    if positional_at is not None:
        argv[positional_at] = value
    elif flag in argv:
        argv[argv.index(flag) + 1] = value
    else:
        argv += [flag, value]
    return [*argv, "--json"]


# ----- bad values, by kind ---------------------------------------------------------------------------------------

TEXT = st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="0123456789"), max_size=12)
NON_FINITE = ["nan", "inf", "-inf", "NaN", "Infinity", "1e999", "-1e999", "1e400"]
EMPTY = ["", " ", ",", "--"]
BAD_INT_TEXT = [*NON_FINITE, *EMPTY, "0", "-0", "-1", "1.5", "0.5", "1e-3", "8,,16", "0x10", "1e", "abc", "8 k 2"]
BAD_INT_TEXT += [str(2**63), "9" * 30, "-" + "9" * 30]


def _not_positive_int(x: float) -> bool:
    return not (math.isfinite(x) and x == int(x) and 1 <= x < 2**63)


BAD_INT = st.one_of(
    st.sampled_from(BAD_INT_TEXT),
    st.integers(max_value=0).map(str),
    st.integers(min_value=2**63, max_value=2**200).map(str),
    st.floats().filter(_not_positive_int).map(repr),
    TEXT.filter(lambda s: s.strip().lower() not in ("k", "m", "g", "ki", "mi", "gi")),
)
BAD_INT0 = st.one_of(
    st.sampled_from([*NON_FINITE, *EMPTY, "-1", "1.5", "abc", str(2**63)]),
    st.integers(max_value=-1).map(str),
    st.floats().filter(lambda x: not (math.isfinite(x) and x == int(x) and 0 <= x < 2**63)).map(repr),
)
BAD_POSITIVE = st.one_of(
    st.sampled_from([*NON_FINITE, *EMPTY, "0", "-0", "-1", "abc", "1,2", "1e"]),
    st.floats(max_value=0).map(repr),
    st.floats(allow_nan=True).filter(lambda x: not math.isfinite(x)).map(repr),
    TEXT.filter(lambda s: s.strip().lower() not in ("nan", "inf", "infinity")),
)
BAD_NONNEG = st.one_of(
    st.sampled_from([*NON_FINITE, *EMPTY, "-1", "-1e-9", "abc"]),
    st.floats(max_value=-1e-300).map(repr),
)
BAD_FRACTION = st.one_of(
    st.sampled_from([*NON_FINITE, *EMPTY, "0", "-0.5", "1.0000001", "40", "100", "abc"]),
    st.floats().filter(lambda x: not (0 < x <= 1)).map(repr),
)
BAD_INTS = st.one_of(
    st.sampled_from(["", " ", ",", "8,,16", "8,", ",8", "1,0", "1,-2", "1,1.5", "1,nan", "1,1e999", "a,b"]),
    st.lists(BAD_INT.filter(lambda s: "," not in s), min_size=1, max_size=3).map(lambda xs: ",".join(["4", *xs])),
)
SCALE_FIELDS = ["hbm_bandwidth", "flops", "ici_bandwidth", "hbm", "latency"]
BAD_SCALE = st.one_of(
    st.sampled_from(["", " ", ",", "hbm_bandwidth", "=2", "warp=2", "hbm_bandwidth=2,,flops=2", "flops=1e7"]),
    st.builds(lambda f, v: f"{f}={v}", st.sampled_from(SCALE_FIELDS), BAD_POSITIVE),
    st.builds(lambda f: f"{f}=1e-7", st.sampled_from(SCALE_FIELDS)),
)


def _not(valid) -> callable:
    """A filter keeping the strings that ``valid`` refuses with a UserError."""

    def keep(s: str) -> bool:
        try:
            valid(s)
        except UserError:
            return True
        return False

    return keep


NAMES = st.from_regex(r"[a-z][a-z0-9\-]{0,10}", fullmatch=True)
BAD_HARDWARE = st.one_of(
    st.sampled_from(["", "tpu-v99", "h1000", "a100-160gb", "cpu!"]),
    NAMES.filter(_not(Catalog().resolve)),
)
BAD_MODEL = st.one_of(
    st.sampled_from(["", "llama9-1t", "gpt5", "missing.toml", "no/such/dir"]),
    NAMES.filter(_not(get_model)),
)
BAD_KIND = st.one_of(st.sampled_from(["", "gossip", "all-gatherer"]), NAMES.filter(_not(canonical_kind)))
BAD_DTYPE = st.one_of(st.sampled_from(["", "bf17", "float64", "int2", "nan"]), NAMES.filter(_not(canonical_dtype)))
BAD_ASSIGNMENTS = st.one_of(
    st.sampled_from(["", "X", "X=", "=2", "X=0", "X=-1", "X=1.5", "X=nan", "X=inf", "X=1e999", "X=2,X=2"]),
    st.sampled_from(["2X=2", "X=2,,Y=2", "X=2,", "X Y=2"]),
    st.builds(lambda v: f"X={v}", BAD_INT.filter(lambda s: "," not in s and "=" not in s)),
)
BAD_BYTES = st.one_of(
    BAD_INT.filter(lambda s: "[" not in s),
    st.sampled_from(["bf16[]", "bf16[8,,8]", "bf17[8]", "bf16[0]", "bf16[1e999]", "bf16[9e18,9e18]", "bf16[8", "lots"]),
)
BAD_NOTATION = st.one_of(
    st.sampled_from(["", "A[I_X,J", "A[I_X,J_X] * B[J,K]", "A[I_Z,J] * B[J,K]", "A[I,J]", "A[I,I] * B[I,K]"]),
    TEXT.filter(lambda s: "[" not in s),
)
# a request length (infer serve): a count or a range LO-HI, each >= 1 and LO <= HI
BAD_LENGTHS = st.one_of(st.sampled_from(["", "0", "-5", "9-3", "1.5", "3-", "-", "1-2-3", "nan"]), TEXT)
# latency targets: METRIC=NUMBER with a unit of s, ms or us
BAD_SLO = st.one_of(
    st.sampled_from(["", ",", "ttft", "ttft=", "ttft=0.5", "ttft=-1s", "ttft=0s", "ttft=nans", "ttft=infs", "x=1s"]),
    st.sampled_from(["ttft=5minutes", "tpot=1e999ms", "ttft=1s,,tpot"]),
    TEXT,
)
BAD_TARGET = st.one_of(
    st.sampled_from(["", "nope", "missing.toml", "a b", "x;y", "decode", "train_step"]),
    NAMES.filter(lambda s: s not in PROGRAMS),
)


def bad_paths(work: Path, kind: str = "in"):
    """Paths a command cannot read (``in``), write as a file (``out``, ``chart``) or write into as a folder
    (``folder``), built from the ways a path goes wrong: empty or with a NUL byte, a name or a whole path longer
    than the file system takes, a folder under a regular file, and by kind: missing (read); a folder, or a file the
    user wrote (written); a chart's name without a chart format; a regular file where a folder is written."""
    ext = ".png" if kind == "chart" else ".toml"
    broken = st.sampled_from(["", " ", "\0", f"a\0b{ext}"])
    too_long_name = st.integers(256, 400).map(lambda n: str(work / ("n" * n + ext)))
    too_long_path = st.integers(820, 900).map(lambda n: str(work / "/".join(["abcd"] * n)) + ext)
    under_a_file = st.sampled_from([str(work / "afile" / f"x{ext}"), str(work / "afile" / "deeper" / f"x{ext}")])
    by_kind = {
        "in": st.sampled_from([str(work / "missing.toml")]),
        "out": st.sampled_from([str(work), str(work / "foreign.toml")]),
        "chart": st.sampled_from([str(work), str(work / "foreign.png"), str(work / "x.toml"), str(work / "noext")]),
        "folder": st.sampled_from([str(work / "afile")]),
    }[kind]
    return st.one_of(broken, too_long_name, too_long_path, under_a_file, by_kind)


def strategy(command: str, action: argparse.Action, work: Path):
    """Bad values for one flag of one command, or None when the flag takes none (a switch)."""
    if action.nargs == 0:
        return None
    kind = getattr(action.type, "kind", None)
    name = action.option_strings[0] if action.option_strings else action.dest
    if command == "audit" and kind is None and action.option_strings:  # with --list, even a valid value is refused
        valid = {"--mesh": "X=2,Y=4", "--sizes": "I=8", "--dtype": "bf16", "--axes": "X", "--hardware": "h100"}
        valid |= {"--target": "v5e:2x4", "--model": "layers=2"}
        return st.one_of(st.just(valid[name]), TEXT)
    by_kind = {
        "int+": BAD_INT,
        "int0": BAD_INT0,
        "number+": BAD_POSITIVE,
        "number0": BAD_NONNEG,
        "fraction": BAD_FRACTION,
        "ints+": BAD_INTS,
        "scale": BAD_SCALE,
        "dtype": BAD_DTYPE,
        "chart": bad_paths(work, "chart"),
        "out": bad_paths(work, "out"),
        "folder": bad_paths(work, "folder"),
        "path": bad_paths(work, "in"),
        "lengths": BAD_LENGTHS,
        "optimizer": TEXT.filter(lambda s: s.strip().lower() not in ("adam", "adamw", "sgd", "adafactor")),
    }
    if kind in by_kind:
        return by_kind[kind]
    if action.choices:
        return TEXT.filter(lambda s: s not in [str(c) for c in action.choices])
    by_name = {
        "--hardware": BAD_HARDWARE,
        "hardware": BAD_HARDWARE,
        "--model": BAD_MODEL,
        "model": BAD_MODEL,
        "--bytes": BAD_BYTES,
        "--slo": BAD_SLO,
        "kind": BAD_KIND,
        "expression": BAD_NOTATION,
        "--sizes": BAD_ASSIGNMENTS,
        "--mesh": BAD_ASSIGNMENTS,
        "target": BAD_TARGET,
        "--target": TEXT,  # plan --target without --validate, or a name that is no TPU topology
        # validate --case: no such run, or one with no prediction (unexpressible: no interval either)
        "--case": st.one_of(st.sampled_from(["T229", "T212", "PT99", "T9999"]), TEXT.filter(lambda s: not _is_case(s))),
    }
    return by_name.get(name)


def _is_case(text: str) -> bool:
    from lab.studies.validate_public import split_runs

    ids = {r.case_id for split in ("development", "test") for r in split_runs(split)}
    return text.strip().upper() in ids


POSITIONAL_AT = {("hardware show", "hardware"): 2, ("collective", "kind"): 1, ("sharded-matmul", "expression"): 1}
POSITIONAL_AT |= {("model show", "model"): 2, ("audit", "target"): 1}


def _flags() -> list[tuple[str, str]]:
    return [
        (cmd, a.option_strings[0] if a.option_strings else a.dest)
        for cmd, p in LEAVES.items()
        if cmd not in SKIPPED
        for a in p._actions
        if a.dest != "help" and a.nargs != 0
    ]


def _action(command: str, flag: str) -> argparse.Action:
    return next(a for a in LEAVES[command]._actions if (a.option_strings[:1] or [a.dest])[0] == flag)


# ----- the properties ---------------------------------------------------------------------------------------------


def test_every_command_and_flag_is_fuzzed(work):
    assert set(LEAVES) - SKIPPED == set(bases(work)), "a command without a happy path here: add it to bases()"
    missing = [f"{c} {f}" for c, f in _flags() if strategy(c, _action(c, f), work) is None]
    assert not missing, f"flags without bad values: {missing}"


@pytest.mark.parametrize("command", sorted(set(LEAVES) - SKIPPED))
def test_happy_path(work, command):
    code, out, err = run([*bases(work)[command], "--json"])
    assert code == 0, err
    json.loads(out)


@pytest.mark.parametrize(("command", "flag"), _flags())
@FUZZ
@given(data=st.data())
def test_a_bad_value_is_one_line_and_exit_2(work, command, flag, data):
    value = data.draw(strategy(command, _action(command, flag), work), label=flag)
    assert_user_error(with_value(bases(work)[command], flag, value, POSITIONAL_AT.get((command, flag))))


AUDIT_PURE = {"--mesh": BAD_ASSIGNMENTS, "--sizes": BAD_ASSIGNMENTS, "--hardware": BAD_HARDWARE}


@pytest.mark.parametrize("flag", sorted(AUDIT_PURE))
@FUZZ
@given(data=st.data())
def test_audit_refuses_bad_flags_before_compiling(work, flag, data):
    """With a kernel: the flags are read (and refused) before JAX starts; a valid value would compile."""
    value = data.draw(AUDIT_PURE[flag], label=flag)
    assert_user_error(with_value(["audit", "sharded_matmul_case1"], flag, value))


EXPLAIN_PURE = {
    "memory": {"EXPERIMENT": "path", "--target": "target", "--png": "chart", "--dtype": "dtype", "--hbm": "bytes"},
    "overlap": {"EXPERIMENT": "path", "--target": "target", "--run": "run", "--dtype": "dtype"},
    "sharding": {"EXPERIMENT": "path", "--target": "target", "--dtype": "dtype"},
}


@pytest.mark.parametrize(("what", "flag"), [(w, f) for w, flags in EXPLAIN_PURE.items() for f in sorted(flags)])
@FUZZ
@given(data=st.data())
def test_explain_refuses_bad_values_before_compiling(work, what, flag, data):
    """Every flag of ``explain memory``, ``overlap`` and ``sharding`` is read (and refused) before JAX starts; a
    valid value would compile."""
    kinds = {"path": st.one_of(bad_paths(work, "in"), BAD_TARGET), "target": TEXT, "chart": bad_paths(work, "chart")}
    kinds["dtype"] = TEXT.filter(lambda s: s not in ("float32", "bfloat16", "fp32", "bf16"))
    kinds["run"] = st.one_of(bad_paths(work, "in"), st.just(str(work)))  # a folder that is no finished run
    kinds["bytes"] = st.one_of(st.sampled_from(["0", "-5", "nan", "inf", "1e400", "0.5"]), TEXT)
    value = data.draw(kinds[EXPLAIN_PURE[what][flag]], label=flag)
    base = ["explain", what, str(EXPERIMENTS / "train_fsdp_tp.toml"), *(["--fit"] if flag == "--hbm" else [])]
    assert_user_error(with_value(base, flag, value, 2 if flag == "EXPERIMENT" else None))


HUGE = ["1073741825", "4611686018427387904", "9223372036854775807", "1e18", "999999937", "720720"]


# `plan --top N` past the layouts there are prints every layout the planner priced (2.7 MB of JSON for Llama 3 8B on
# 8 chips, about 4 s a value): the six values take 40 s, a tenth of the default suite, for one flag that only caps
# the output, so that one pair runs under `slow`; `test_plan_top_past_the_layouts_prints_them_all` keeps it covered.
INT_FLAGS = [
    pytest.param(c, f, marks=pytest.mark.slow) if (c, f) == ("plan", "--top") else (c, f)
    for c, f in _flags()
    if getattr(_action(c, f).type, "kind", "") in ("int+", "ints+")
]


@pytest.mark.parametrize(("command", "flag"), INT_FLAGS)
def test_huge_integers_finish_with_0_or_2(work, command, flag):
    """Valid but absurd integers: a finite result or one line, quickly; never a hang, an overflow or a crash.
    (A result that is not finite is refused before printing, so exit 0 means every number printed is finite.)"""
    for value in HUGE:
        code, out, err = run(with_value(bases(work)[command], flag, value, POSITIONAL_AT.get((command, flag))))
        assert code in (0, 2), f"{command} {flag} {value}: exit {code}: {err.strip()[-400:]}"
        if code == 2:
            assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
        else:
            json.loads(out)


def test_plan_top_past_the_layouts_prints_them_all(work):
    """One huge ``--top``: every layout the planner priced, no more, and the default top-10 are its first rows."""
    code, out, err = run(with_value(bases(work)["plan"], "--top", HUGE[0]))
    assert code == 0, err
    every = json.loads(out)
    code, out, err = run([*bases(work)["plan"], "--json"])
    assert code == 0, err
    top10 = json.loads(out)
    assert len(every["top"]) == every["feasible"] > len(top10["top"]) == 10
    assert every["top"][:10] == top10["top"]


@pytest.mark.parametrize("value", ["1e300", "1e308", "1.7e308"])
def test_an_overflowing_result_names_the_input(work, value):
    line = assert_user_error(with_value(bases(work)["train estimate"], "--tokens", value))
    assert "total_flops" in line and "--tokens" in line


# ----- the cases the user sweep of issue 16 reported -------------------------------------------------------------

H100 = ["--hardware", "h100"]
LLAMA = ["--model", "llama3-8b", *H100, "--chips", "8"]
HEADS_3 = ["model", "show", "--layers", "2", "--d-model", "100", "--heads", "3", "--d-ff", "8", "--vocab", "8"]


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["roofline", "op", *H100, "--bytes", "1Mi", "--scale", "hbm_bandwidth=inf"], "'inf' is not finite"),
        (["roofline", "op", *H100, "--bytes", "1Mi", "--scale", "hbm_bandwidth=nan"], "'nan' is not a number"),
        (["roofline", "op", *H100, "--bytes", "1Mi", "--scale", "hbm_bandwidth=0"], "must be a positive, finite"),
        (["roofline", "op", *H100, "--bytes", "1Mi", "--scale", "hbm_bandwidth=1e999"], "'1e999' is not finite"),
        (["validate", "--hardware-file", "missing.toml"], "'missing.toml' does not exist"),
        (["model", "list", "--hardware-file", "missing.toml"], "'missing.toml' does not exist"),
        (HEADS_3, "d-model=100 is not a multiple of heads=3"),
        (["train", "estimate", *LLAMA, "--interleave", "2"], "add --pp-schedule interleaved"),
        (["infer", "sweep", "--model", "llama3-8b", *H100, "--chips", "8,,16"], "'8,,16' has an empty item"),
        (["train", "estimate", *LLAMA, "--tokens", "1e300"], "total_flops came out inf"),
        (["train", "estimate", *LLAMA, "--dp", "1e999"], "'1e999' is too large"),
        (["infer", "estimate", *LLAMA, "--batch", "1", "--context", "8", "--tp", "1e400"], "'1e400' is too large"),
        (["plan", "--model", "llama3-8b", *H100, "--chips", "9e18", "--batch-tokens", "1Mi"], "at most 1048576"),
    ],
)
def test_issue_16_reported_cases(work, argv, needle):
    assert needle in assert_user_error(argv)


def test_head_dim_given_explicitly_is_kept(work):
    argv = ["model", "show", "--layers", "2", "--d-model", "100", "--heads", "3", "--head-dim", "32"]
    code, out, _ = run([*argv, "--d-ff", "8", "--vocab", "8", "--json"])
    assert code == 0 and json.loads(out)["head_dim"] == 32


# ----- the parsers accept every valid value ---------------------------------------------------------------------


@FUZZ
@given(n=st.integers(min_value=1, max_value=2**63 - 1), suffix=st.sampled_from(["", "k", "Mi", "G"]))
def test_every_positive_integer_reads_back(n, suffix):
    scale = {"": 1, "k": 1000, "Mi": 2**20, "G": 10**9}[suffix]
    if n * scale < 2**63:
        assert parse_positive_int(f"{n}{suffix}", "--x") == n * scale
    assert parse_positive_ints(f"{n},1, 2", "--x") == (n, 1, 2)


@FUZZ
@given(x=st.floats(min_value=1e-300, max_value=1e300))
def test_every_positive_finite_number_reads_back(x):
    assert parse_positive_float(repr(x), "--x") == x == parse_nonneg_float(repr(x), "--x")
    if x <= 1:
        assert parse_fraction(repr(x), "--x") == x


# ----- files given to flags -----------------------------------------------------------------------------------------

CHIP_FIELDS = ["hbm_bandwidth", "hbm_bytes", "link_bandwidth", "hop_latency_s", "node_size", "price_per_hour"]
BAD_JSON_VALUES = ["Infinity", "-Infinity", "NaN", "1e999", "-5", "0", '"fast"', "[1, 2]", "{}", "null", "true"]
VALID_JSON = {("price_per_hour", "null"), ("price_per_hour", "0"), ("hop_latency_s", "0")}  # no price; no latency


def _chip_file(field_value: tuple[str, str]) -> bytes:
    field, value = field_value
    return f'{{"name": "h100-x", "base": "h100", "{field}": {value}}}'.encode()


CHIP_ENTRIES = sorted({(f, v) for f in CHIP_FIELDS for v in BAD_JSON_VALUES} - VALID_JSON)


BAD_HARDWARE_FILES = st.one_of(
    st.binary(min_size=1, max_size=64).filter(lambda b: not _utf8(b)),
    st.sampled_from([b'{"name": "h100-x", "base": "h100"', b"[1, 2]", b'{"chips": [1, 2]}', b'{"chips": []}']),
    st.sampled_from([b'{"name": "x", "base": "nope"}', b'{"name": "x"}', b'{"name": "h", "base": "h100", "warp": 1}']),
    st.sampled_from([b'{"name": "h", "base": "h100", "peak_flops": {"bf16": "fast"}}', b"[" * 3000 + b"]" * 3000]),
    st.sampled_from([b'{"name": "h", "base": "h100", "peak_flops": 5}', b'{"name": "h", "base": "h100", "kind": 1}']),
    st.sampled_from(CHIP_ENTRIES).map(_chip_file),
)


def _utf8(b: bytes) -> bool:
    try:
        b.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


FILE_COMMANDS = ["hardware list", "model list", "validate", "roofline op", "study generations", "infer topology"]


@pytest.mark.parametrize("command", FILE_COMMANDS)
@FUZZ
@given(content=BAD_HARDWARE_FILES)
def test_a_bad_hardware_file_is_refused_by_every_command(work, command, content):
    f = work / "chips.json"
    f.write_bytes(content)
    line = assert_user_error(with_value(bases(work)[command], "--hardware-file", str(f)))
    assert "chips.json" in line


BAD_MODEL_FILES = st.one_of(
    st.binary(min_size=1, max_size=64).filter(lambda b: not _utf8(b)),
    st.sampled_from([b"layers = ", b"layers = 2\nlayers = 3", b"a = " + b"[" * 3000, b"warp = 1", b"layers = 2"]),
    st.sampled_from([b"base = 'llama3-8b'\nlayers = -1", b"base = 'llama3-8b'\nlayers = 1e999", b"base = 5"]),
    st.sampled_from([b"base = 'llama3-8b'\nrope_theta = nan", b"base = 'llama3-8b'\ngated_mlp = 'yes'"]),
    st.sampled_from([b"layers = 2\nd_model = 100\nheads = 3\nd_ff = 8\nvocab = 8", b"base = 'llama3-8b'\nname = 5"]),
    st.sampled_from([b"base = 'llama3-8b'\nlayers = 100000000000000000000000", b"base = 'llama3-8b'\nheads = 7"]),
)


@pytest.mark.parametrize("command", ["model show", "train estimate", "infer topology"])
@FUZZ
@given(content=BAD_MODEL_FILES)
def test_a_bad_model_file_is_refused(work, command, content):
    f = work / "model.toml"
    f.write_bytes(content)
    flag = "model" if command == "model show" else "--model"
    assert_user_error(with_value(bases(work)[command], flag, str(f), POSITIONAL_AT.get((command, flag))))


BAD_PLAN_FILES = st.one_of(
    st.binary(min_size=1, max_size=64).filter(lambda b: not _utf8(b)),
    st.sampled_from([b"", b"[experiment]\nprogram = ", b"[experiment]\nprogram = 'nope'\n[mesh]\nx = 2\n"]),
    st.sampled_from([(EXPERIMENTS / "tp_mlp.toml").read_bytes(), (EXPERIMENTS / "decode_tp.toml").read_bytes()]),
    st.sampled_from([(EXPERIMENTS / "train_fsdp_tp.toml").read_bytes().replace(b"batch = 8", b"batch = -8")]),
    st.sampled_from([(EXPERIMENTS / "train_fsdp_tp.toml").read_bytes().replace(b"layers = 2", b"layers = 1e999")]),
    st.sampled_from([(EXPERIMENTS / "train_fsdp_tp.toml").read_bytes() + b"\n[bogus]\nx = 1\n"]),
)


@FUZZ
@given(content=BAD_PLAN_FILES)
def test_a_bad_plan_file_is_refused(work, content):
    """train estimate --plan: a file that is garbage, invalid, or runs another program (tp_mlp, decode)."""
    f = work / "plan.toml"
    f.write_bytes(content)
    assert_user_error(["train", "estimate", "--plan", str(f), "--hardware", "h100", "--json"])


def test_a_corrupt_host_calibration_breaks_only_what_prices_the_host(work, monkeypatch):
    specs = work / "specs"
    specs.mkdir(exist_ok=True)
    monkeypatch.setenv("SHARDLAB_SPECS_DIR", str(specs))
    for content in (b"\x89PNG\r\n\x1a\n\x00\xff", b'{"name": "cpu", "base": "cpu", "hbm_bandwidth": 1e1'):
        (specs / "cpu.json").write_bytes(content)
        for argv in (["hardware", "list"], ["hardware", "show", "h100"], ["model", "list"], bases(work)["plan"]):
            code, _, err = run([*argv, "--json"])
            assert code == 0, (argv, err)
        line = assert_user_error(["hardware", "show", "cpu"])
        assert str(specs / "cpu.json") in line and "shardlab calibrate" in line and "delete" in line
        assert_user_error(["roofline", "op", "--hardware", "host", "--bytes", "1Mi"])
        assert_user_error(["train", "estimate", "--plan", str(EXPERIMENTS / "train_fsdp_tp.toml")])


# ----- run, calibrate, demo: their pure checks ------------------------------------------------------------------


@pytest.mark.parametrize(
    "argv",
    [
        ["run", "missing.toml"],
        ["run", ""],
        ["run", "notutf8.toml"],
        ["run", "notutf8.toml", "--devices", "1e999"],
        ["run", str(EXPERIMENTS / "tp_mlp.toml"), "--devices", "0"],
        ["run", str(EXPERIMENTS / "tp_mlp.toml"), "--hardware-file", ""],
        ["calibrate", "--mesh", "X=0"],
        ["calibrate", "--mesh", "X=2,,Y=4"],
        ["demo", "--hardware-file", "\0"],
    ],
)
def test_commands_that_run_jax_refuse_bad_input_first(work, argv):
    (work / "notutf8.toml").write_bytes(b"\xff\xfe[experiment]\n")
    assert_user_error(argv)


def test_run_refuses_a_bad_file_before_jax_starts(work):
    (work / "notutf8.toml").write_bytes(b"\xff\xfe[experiment]\n")
    code = (
        "import sys\nfrom lab.cli.main import main\n"
        "codes = [main(['run', 'notutf8.toml']), main(['run', 'missing.toml'])]\n"
        "assert codes == [2, 2], codes\nassert 'jax' not in sys.modules, 'JAX started'\n"
    )
    r = subprocess.run([sys.executable, "-c", code], cwd=work, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stderr.count("shardlab: error:") == 2


# ----- the experiment loader ------------------------------------------------------------------------------------------

TOML_BAD_VALUES = st.one_of(
    st.integers(min_value=2**63, max_value=2**100),
    st.integers(max_value=0),
    st.sampled_from([math.inf, -math.inf, math.nan, 1.5, -2.5, 1e300]),
    st.text(string.ascii_letters, max_size=6),
    st.booleans(),
    st.lists(st.integers(min_value=-3, max_value=3), max_size=3),
    st.just({"size": -1}),
    st.just({"bogus": 1}),
)


def _toml(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, float):
        return {math.inf: "inf", -math.inf: "-inf"}.get(v, "nan" if math.isnan(v) else repr(v))
    if isinstance(v, str):
        return json.dumps(v)
    if isinstance(v, list):
        return "[" + ", ".join(_toml(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{ " + ", ".join(f"{k} = {_toml(x)}" for k, x in v.items()) + " }"
    return str(v)


BASE_EXPERIMENT = {
    "experiment": {"program": "train_step", "hardware": "calibrated", "dtype": "float32"},
    "mesh": {"data": 2, "model": 4},
    "sizes": {"batch": 8, "seq": 32},
    "model": {"vocab": 88, "d_model": 56, "layers": 2, "heads": 8, "kv_heads": 4, "head_dim": 12, "d_ff": 104},
    "rules": {"preset": "fsdp_tp"},
    "options": {"remat": "none", "microbatch": 1, "checkpoints_per_layer": 2.0},
    "run": {"warmup": 1, "repeats": 5},
}


def _write(doc: dict) -> str:
    return "\n".join(f"[{s}]\n" + "".join(f"{k} = {_toml(v)}\n" for k, v in t.items()) for s, t in doc.items())


# A bad value for a key, except where the value it draws is a valid one (a mesh axis of 2, warmup 0).
_KEYS = [(s, k) for s, t in BASE_EXPERIMENT.items() for k in t]


@LOADER
@given(key=st.sampled_from(_KEYS), value=TOML_BAD_VALUES)
def test_the_loader_refuses_a_bad_value(work, key, value):
    section, name = key
    if section == "run" and name == "warmup" and isinstance(value, int) and value == 0:
        value = -1  # 0 warm-up calls is valid
    doc = {s: dict(t) for s, t in BASE_EXPERIMENT.items()}
    doc[section][name] = value
    f = work / "e.toml"
    f.write_text(_write(doc))
    with pytest.raises(UserError):
        load_experiment(f)


@LOADER
@given(
    section=st.sampled_from([*BASE_EXPERIMENT, "sweep", "bogus"]),
    key=st.from_regex(r"[a-z][a-z_]{0,8}", fullmatch=True),
    value=st.one_of(TOML_BAD_VALUES, st.integers(min_value=1, max_value=8)),
)
def test_the_loader_refuses_an_unknown_key(work, section, key, value):
    fields = {"experiment": EXPERIMENT, "model": MODEL, "options": OPTIONS, "rules": RULES, "run": {**RUN, "sweep": 1}}
    fields |= {"sizes": BASE_EXPERIMENT["sizes"], "sweep": BASE_EXPERIMENT["sizes"]}
    if section == "mesh" or key in fields.get(section, {}):
        return  # a new mesh axis, or a key the section knows: not unknown
    doc = {s: dict(t) for s, t in BASE_EXPERIMENT.items()}
    doc.setdefault(section, {})[key] = value
    f = work / "e.toml"
    f.write_text(_write(doc))
    try:
        load_experiment(f)
    except UserError:
        return
    pytest.fail(f"[{section}] {key} = {value!r} was accepted")


def test_the_loader_refuses_deep_nesting(work):
    f = work / "deep.toml"
    f.write_text(_write(BASE_EXPERIMENT) + "\n[sweep]\nbatch = " + "[" * 5000 + "]" * 5000 + "\n")
    with pytest.raises(UserError):
        load_experiment(f)


@LOADER
@given(junk=st.binary(min_size=1, max_size=40), at=st.integers(min_value=0, max_value=400))
def test_the_loader_refuses_garbage_bytes(work, junk, at):
    text = _write(BASE_EXPERIMENT).encode()
    content = text[:at] + b"\xff" + junk + text[at:]
    f = work / "e.toml"
    f.write_bytes(content)
    with pytest.raises(UserError):
        load_experiment(f)
