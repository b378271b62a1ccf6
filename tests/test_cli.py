"""The command line: JSON keys, readable tables, and one-line errors with exit code 2."""

import json
import subprocess
import sys

import pytest

from lab.cli.args import parse_bytes
from lab.cli.main import main


def run_json(capsys, *argv):
    assert main([*argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def run_cli(*argv):
    """The real console entry point, in a subprocess (exit code and stderr as a user sees them)."""
    return subprocess.run([sys.executable, "-m", "lab", *argv], capture_output=True, text=True, timeout=60)


def test_hardware_list_and_show(capsys):
    data = run_json(capsys, "hardware", "list")
    assert [c["name"] for c in data["hardware"]][:3] == ["tpu-v3", "tpu-v4", "tpu-v5e"]
    show = run_json(capsys, "hardware", "show", "V5E")
    assert show["name"] == "tpu-v5e"
    assert show["peak_flops"] == {"bf16": 1.97e14, "int8": 3.94e14}
    assert show["hbm_bytes"] == 16e9 and show["hbm_bandwidth"] == 8.2e11
    assert show["derived"]["critical_intensity"]["bf16"] == pytest.approx(240, rel=0.01)
    assert show["sources"]["hbm_bandwidth"]


def test_roofline_matmul_keys(capsys):
    d = run_json(
        capsys,
        "roofline",
        "matmul",
        "--hardware",
        "v5e",
        "--b",
        "512",
        "--d",
        "8192",
        "--f",
        "8192",
        "--weight-dtype",
        "int8",
    )
    for key in ("flops", "bytes", "intensity", "critical_intensity", "compute_s", "memory_s", "time_s", "bound"):
        assert key in d
    assert d["flops"] == 2 * 512 * 8192 * 8192
    assert d["bytes"] == 512 * 8192 * 2 + 8192 * 8192 + 512 * 8192 * 2
    assert d["bound"] == "compute" and d["compute_dtype"] == "bf16"


def test_roofline_inf_becomes_null(capsys):
    d = run_json(capsys, "roofline", "matmul", "--hardware", "h100", "--b", "1", "--d", "64", "--f", "64")
    assert d["critical_batch"] is None


def test_roofline_op(capsys, tmp_path):
    # sharding.md pop quiz: reading 1 MiB from HBM at 3.4e12 B/s takes about 308 ns.
    f = tmp_path / "h100.toml"
    f.write_text('name = "h100"\nbase = "h100"\nhbm_bandwidth = 3.4e12\n')
    d = run_json(capsys, "roofline", "op", "--hardware", "h100", "--bytes", "1Mi", "--hardware-file", str(f))
    assert d["time_s"] == pytest.approx(308e-9, rel=0.01) and d["bound"] == "memory"


def test_collective_keys_and_book_value(capsys):
    d = run_json(
        capsys, "collective", "all-gather", "--hardware", "v5e", "--bytes", "bf16[2048,8192]", "--axis-size", "4"
    )
    assert d["time_s"] == pytest.approx(373e-6, rel=0.01) and d["latency_bound"] is False
    d = run_json(
        capsys,
        "collective",
        "all-gather",
        "--hardware",
        "v5e",
        "--bytes",
        str(2048 * 8192 * 2),
        "--axis-size",
        "4",
        "--no-wraparound",
    )
    assert d["time_s"] == pytest.approx(559e-6, rel=0.01)
    d = run_json(
        capsys,
        "collective",
        "all-reduce",
        "--hardware",
        "h100",
        "--bytes",
        "64Mi",
        "--axis-size",
        "8,4",
        "--scope",
        "cross-node",
    )
    assert d["axis_sizes"] == [8, 4] and d["group_size"] == 32 and d["link"] == "nvlink+network"


def test_sharded_matmul_keys(capsys):
    d = run_json(
        capsys,
        "sharded-matmul",
        "A[I,J_X] * B[J_X,K] -> C[I,K_X]",
        "--sizes",
        "I=1024,J=8192,K=4096",
        "--mesh",
        "X=2,Y=4",
        "--hardware",
        "v5e",
    )
    assert d["output"] == "C[I, K_X]"
    assert [(c["kind"], c["axes"]) for c in d["collectives"]] == [("reduce-scatter", ["X"])]
    assert d["collectives"][0]["bytes"] == 1024 * 4096 * 2
    assert d["time_s"] == pytest.approx(d["compute_s"] + d["comm_s"])
    for c in d["collectives"]:
        assert set(c) >= {"kind", "axes", "bytes", "time_s"}


def test_human_tables(capsys):
    assert (
        main(
            [
                "sharded-matmul",
                "A[I_X,J] * B[J,K_X]",
                "--sizes",
                "I=64,J=64,K=128",
                "--mesh",
                "X=2",
                "--hardware",
                "h100",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "book case(s): 4" in out and "AllGather_X" in out and "time, no overlap" in out
    assert main(["hardware", "list"]) == 0
    assert "tpu-v5e" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["hardware", "show", "tpu-v9"], "unknown hardware 'tpu-v9'; valid: tpu-v3"),
        (["roofline", "matmul", "--hardware", "v5e", "--b", "-3", "--d", "8", "--f", "8"], "'-3'"),
        (["roofline", "matmul", "--hardware", "v5e", "--b", "0", "--d", "8", "--f", "8"], "positive integer"),
        (
            ["roofline", "matmul", "--hardware", "v5e", "--b", "8", "--d", "8", "--f", "8", "--dtype", "bf17"],
            "unknown dtype 'bf17'; valid: fp32",
        ),
        (
            ["collective", "gossip", "--hardware", "v5e", "--bytes", "1e6", "--axis-size", "4"],
            "unknown collective 'gossip'; valid: all-gather",
        ),
        (
            ["collective", "all-gather", "--hardware", "v5e", "--bytes", "lots", "--axis-size", "4"],
            "--bytes: 'lots' is not a byte count",
        ),
        (["collective", "all-gather", "--hardware", "v5e", "--bytes", "1e6", "--axis-size", "4,0"], "positive integer"),
        (
            ["collective", "all-gather", "--hardware", "v5e", "--bytes", "1e6", "--axis-size", "4", "--scope", "rack"],
            "invalid choice: 'rack'",
        ),
        (
            ["sharded-matmul", "A[I_X,J * B[J,K]", "--sizes", "I=8,J=8,K=8", "--mesh", "X=2", "--hardware", "v5e"],
            "at column 9",
        ),
        (
            ["sharded-matmul", "A[I_X,J] * B[J,K]", "--sizes", "I=9,J=8,K=8", "--mesh", "X=2", "--hardware", "v5e"],
            "dim I=9 does not divide over X",
        ),
        (
            ["sharded-matmul", "A[I_X,J] * B[J,K]", "--sizes", "I=8,J=-8,K=8", "--mesh", "X=2", "--hardware", "v5e"],
            "--sizes J",
        ),
        (
            [
                "sharded-matmul",
                "A[I_X,J] * B[J,K]",
                "--sizes",
                "I=8,J=8,K=8",
                "--mesh",
                "X=2,Y=4",
                "--chips",
                "16",
                "--hardware",
                "v5e",
            ],
            "--mesh X=2,Y=4 has 8 devices but --chips is 16",
        ),
        (["hardware", "list", "--hardware-file", "/nonexistent/chips.toml"], "does not exist"),
        (
            ["roofline", "op", "--hardware", "h100", "--bytes", "1Mi", "--flops", "-5"],
            "argument --flops: '-5' must be a finite number >= 0",
        ),
        (["frobnicate"], "invalid choice: 'frobnicate'"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(argv, needle):
    r = run_cli(*argv)
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert needle in lines[0]
    assert "Traceback" not in r.stderr and r.stdout == ""


def test_python_dash_m_lab_and_version():
    r = run_cli("--version")
    assert r.returncode == 0 and r.stdout.startswith("shardlab ")


@pytest.mark.parametrize(
    ("text", "n"),
    [
        ("33554432", 33554432),
        ("32Mi", 32 * 1024**2),
        ("1e6", 1e6),
        ("bf16[2048,8192]", 2048 * 8192 * 2),
        ("int8[3, 5]", 15),
        ("float32[7]", 28),
    ],
)
def test_parse_bytes(text, n):
    assert parse_bytes(text) == n


@pytest.mark.parametrize(
    ("argv", "match"),
    [
        (["roofline", "matmul", "--hardware", "v5e", "--b", "1e999", "--d", "8", "--f", "8"], "'1e999' is too large"),
        (
            ["train", "estimate", "--model", "llama3-8b", "--hardware", "h100", "--chips", "8", "--tokens", "nan"],
            "argument --tokens: 'nan' is not a number; use a positive, finite number",
        ),
    ],
)
def test_overflowing_and_non_finite_numbers_are_refused(capsys, argv, match):
    assert _exit_code(argv) == 2
    assert match in capsys.readouterr().err


def _exit_code(argv) -> int:
    """main's return code, or argparse's exit code for a value its type check refuses."""
    try:
        return main(argv)
    except SystemExit as exc:
        return exc.code


def test_a_hardware_file_that_is_not_utf8_is_named(tmp_path, capsys):
    bad = tmp_path / "chips.toml"
    bad.write_bytes(b"\xff\xfe\x00")
    assert main(["hardware", "list", "--hardware-file", str(bad)]) == 2
    assert "is not UTF-8 text" in capsys.readouterr().err


def test_every_command_is_in_the_table_that_lets_the_others_stay_unimported():
    from lab.cli.commands import COMMANDS
    from lab.cli.main import build_parser

    sub = next(a for a in build_parser()._actions if getattr(a, "choices", None) and "run" in a.choices)
    assert list(sub.choices) == list(COMMANDS)  # registered in the table's order, none missing, none extra
    helps = {a.dest: a.help for a in sub._choices_actions}
    assert helps == {name: text for name, (_, text) in COMMANDS.items()}


def test_a_command_imports_only_its_own_group():
    import subprocess
    import sys

    code = (
        "import sys\nfrom lab.cli.main import main\nrc = main(['hardware', 'list'])\n"
        "loaded = sorted(m for m in sys.modules if m.startswith(('lab.cli.', 'lab.predict.training', 'jax')))\n"
        "print(loaded, file=sys.stderr)\nsys.exit(rc)\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stderr.strip().splitlines()[-1] == str(
        ["lab.cli.analytic", "lab.cli.args", "lab.cli.commands", "lab.cli.main"]
    )


def test_a_command_builds_its_own_parser_and_lists_its_groups_others():
    """``train estimate`` builds the train command's flags; plan, study, validate and model (the same module) are
    listed by name and help only, and each still parses when it is the one chosen."""
    from lab.cli.main import build_parser

    def choices(argv):
        sub = next(a for a in build_parser(argv)._actions if getattr(a, "choices", None) and "run" in a.choices)
        return sub.choices

    lazy = choices(["train", "estimate", "--model", "llama3-8b"])
    assert "--validate" not in lazy["plan"]._option_string_actions
    assert lazy["train"]._subparsers is not None and lazy["study"]._subparsers is None  # built: generations|...
    assert "--validate" in choices(["plan", "--model", "llama3-8b"])["plan"]._option_string_actions
    assert main(["validate", "--group", "development", "--json"]) == 0


def test_a_dense_training_estimate_loads_neither_the_program_table_nor_numbers():
    """Start-up: the program table (lab.core.programs, about 4 ms) is for MoE models and the lab's own programs,
    ``numbers`` only for a byte count that is neither int nor float, the book's thresholds
    (lab.predict.training.limits) for ``train limits``; a dense model's estimate needs none of them."""
    argv = ["train", "estimate", "--model", "llama3-8b", "--hardware", "h100", "--chips", "8"]
    code = (
        "import contextlib, io, sys\nfrom lab.cli.main import main\n"
        f"with contextlib.redirect_stdout(io.StringIO()):\n    rc = main({argv!r})\n"
        "print(rc, 'lab.core.programs' in sys.modules, 'numbers' in sys.modules,"
        " 'lab.predict.training.limits' in sys.modules)\n"
        "from lab.predict.training.estimate import Limits, limits\nprint(Limits.__module__, limits.__module__)\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.stdout.splitlines() == [
        "0 False False False",
        "lab.predict.training.limits lab.predict.training.limits",
    ], r.stderr


@pytest.mark.parametrize(
    ("argv", "env", "expected"),
    [
        (["calibrate", "--hardware-file", "x.toml"], {}, "calibrate measures this host and reads no chip file"),
        (["calibrate", "--out", "c.txt"], {}, "the spec is written as JSON; give a path ending in .json"),
        (["calibrate", "--mesh", "X=100000"], {}, "calibrate emulates at most 2048 (try X=2,Y=4)"),
        (["demo", "--analytic-only", "--out", "x"], {}, "--analytic-only runs nothing; drop one of them"),
        (["run", "experiments/tp_mlp.toml", "--devices", "100000"], {}, "at most 2048 host devices can be emulated"),
        (["run", "experiments/tp_mlp.toml", "--run-id", ""], {}, "argument --run-id: the value is empty"),
        (["run", "experiments/tp_mlp.toml", "--hardware", ""], {}, "argument --hardware: the value is empty"),
        (["launch", "--local-processes", "2", "--port", "1", "experiments/multiprocess_dp_tp.toml"], {}, "--port 1 is"),
        (
            ["run", "experiments/tp_mlp.toml"],
            {"SHARDLAB_COORDINATOR": "127.0.0.1:5", "SHARDLAB_NUM_PROCESSES": "2", "SHARDLAB_PROCESS_ID": "5"},
            "SHARDLAB_PROCESS_ID=5 is not a rank of 2 processes",
        ),
        (
            ["run", "experiments/tp_mlp.toml"],
            {
                "SHARDLAB_COORDINATOR": "127.0.0.1:5",
                "SHARDLAB_NUM_PROCESSES": "2",
                "SHARDLAB_PROCESS_ID": "0",
                "SHARDLAB_LOCAL_DEVICES": "abc",
            },
            "SHARDLAB_LOCAL_DEVICES='abc' must be a whole number",
        ),
    ],
)
def test_run_side_mistakes_found_by_the_sweep_are_one_line(argv, env, expected, monkeypatch, capsys, tmp_path):
    """Cases a bad-input sweep of the JAX commands found accepted silently or refused with the wrong advice."""
    from lab.cli.main import main

    for k, v in env.items():
        monkeypatch.setenv(k, v)
    root = __import__("pathlib").Path(__file__).resolve().parent.parent
    monkeypatch.chdir(root)
    try:
        code = main([*argv, "--out", str(tmp_path / "o")] if argv[0] == "run" else argv)
    except SystemExit as exc:  # argparse's own refusals
        code = exc.code
    assert code == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert expected in line and not (tmp_path / "o").exists(), line


def test_every_flag_of_every_command_says_what_it_is_and_its_default():
    import argparse

    from lab.cli.main import build_parser

    problems = []

    def walk(p, path):
        for a in p._actions:
            if isinstance(a, argparse._SubParsersAction):
                for name, sp in a.choices.items():
                    walk(sp, [*path, name])
            elif a.option_strings and a.dest != "help":
                flag = f"{' '.join(path)} {a.option_strings[0]}"
                said = a.default is None or a.default is False or a.default == argparse.SUPPRESS or a.nargs == 0
                if not a.help or len(a.help) < 8:
                    problems.append(f"{flag}: no help")
                elif not said and "default" not in a.help.lower():
                    problems.append(f"{flag}: default {a.default!r} not said")

    walk(build_parser([]), [])
    assert not problems, problems


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["collective", "all-reduce", "--hardware", "h100", "--bytes", "-1e6", "--axis-size", "8"], "'-1e6'"),
        (["train", "estimate", "--model", "llama3-8b", "--hardware", "h100", "--pp-split", "-1,9"], "'-1'"),
    ],
)
def test_a_negative_number_in_any_form_is_refused_as_the_flags_value(argv, needle, capsys):
    # argparse took -1e6 and -1,9 for flags ("expected one argument"), naming neither the value nor a valid one
    try:
        code = main(argv)
    except SystemExit as e:  # argparse's own refusals exit; the commands' return 2
        code = e.code
    err = capsys.readouterr().err
    assert code == 2 and needle in err and "expected one argument" not in err and len(err.splitlines()) == 1
