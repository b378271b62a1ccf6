"""Nothing lost, no tracebacks, second round: paths, the environment, run records, user code, saved plans, signals.

Each kind of fault is built by a generator, not listed: bad paths from the ways a path goes wrong
(:func:`tests.test_fuzz.bad_paths` covers every output flag of every command), bad ``JAX_PLATFORMS`` and
``XLA_FLAGS`` values, run records damaged byte by byte, saved plans edited field by field, user models that exit
or raise at each stage. The contract is the fuzz's: exit 2, one line, no traceback; and nothing the user had is
changed.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lab.core.errors import UserError
from lab.core.hardware import Catalog, load_hardware_file
from lab.core.limits import MAX_CALLS, MAX_EMULATED
from lab.core.models import ModelConfig
from lab.core.paths import MARK, check_file, check_folder
from lab.run import store
from lab.run.preflight import DEVICE_COUNT, PLATFORMS, check_environment
from tests.test_fuzz import assert_user_error, run

ROOT = Path(__file__).resolve().parent.parent
EXPERIMENTS = ROOT / "experiments"
GEN = settings(max_examples=25, derandomize=True, deadline=None, suppress_health_check=list(HealthCheck))
FEW = settings(max_examples=8, derandomize=True, deadline=None, suppress_health_check=list(HealthCheck))  # ~2 s each
LLAMA = ["train", "estimate", "--model", "llama3-8b", "--hardware", "h100", "--chips", "8"]


@pytest.fixture
def here(tmp_path, monkeypatch) -> Path:
    monkeypatch.chdir(tmp_path)
    return tmp_path


# ----- output paths: checked before any work, a user's file never replaced without --overwrite ------------------


def test_save_plan_never_replaces_a_users_file(here):
    mine = here / "mine.toml"
    mine.write_text("# my experiment\n[experiment]\n")
    line = assert_user_error([*LLAMA, "--save-plan", str(mine)])
    assert "--overwrite" in line and "did not write" in line
    assert mine.read_text() == "# my experiment\n[experiment]\n"
    assert run([*LLAMA, "--save-plan", str(mine), "--overwrite", "--json"])[0] == 0
    assert MARK in mine.read_text().splitlines()[0]
    mine.write_text("# mine again\n")
    assert run([*LLAMA, "--save-plan", str(mine), "--force", "--json"])[0] == 0  # --force: the same permission
    assert MARK in mine.read_text().splitlines()[0]


def test_calibrates_force_keeps_its_meaning_and_does_not_overwrite(here):
    """calibrate's --force keeps a busy host's calibration; replacing a user's file there takes --overwrite."""
    mine = here / "spec.json"
    mine.write_text("{}\n")
    line = assert_user_error(["calibrate", "--quick", "--force", "--out", str(mine)])
    assert "--overwrite" in line and mine.read_text() == "{}\n"


def test_a_file_the_lab_wrote_is_replaced_without_asking(here):
    plan = here / "plan.toml"
    assert run([*LLAMA, "--save-plan", str(plan), "--json"])[0] == 0
    first = plan.read_text()
    assert run([*LLAMA, "--tp", "2", "--save-plan", str(plan), "--json"])[0] == 0
    assert plan.read_text() != first and "tp=2" in plan.read_text().splitlines()[0]


def test_a_chart_the_lab_drew_carries_its_mark(here):
    png = here / "sweep.png"
    assert run(["infer", "sweep", "--model", "llama3-8b", "--hardware", "h100", "--png", str(png), "--json"])[0] == 0
    check_file(png, "--png")  # replaceable: the lab's own
    png.write_bytes(b"\x89PNG\r\n\x1a\n someone else's")
    with pytest.raises(UserError, match="did not write"):
        check_file(png, "--png")


def test_plan_validate_refuses_a_bad_out_before_planning(here, monkeypatch):
    import lab.predict.planner.layouts as layouts

    def never(*_a, **_k):
        raise AssertionError("planned before --out was checked")

    monkeypatch.setattr(layouts, "plan", never)
    (here / "afile").write_text("x")
    argv = ["plan", "--model", "llama3-8b", "--hardware", "cpu", "--chips", "8", "--batch-tokens", "64Ki"]
    for out in (here / "afile", here / "afile" / "runs", here / ("r" * 300)):
        assert_user_error([*argv, "--validate", "1", "--out", str(out)])


@GEN
@given(depth=st.integers(1, 3), n=st.integers(256, 300))
def test_no_folder_is_made_for_a_refused_path(tmp_path_factory, depth, n):
    base = tmp_path_factory.mktemp("refused")
    path = base.joinpath(*["d"] * depth, "x" * n)
    with pytest.raises(UserError, match="255"):
        check_folder(path, "--out")
    assert list(base.iterdir()) == []


# ----- the environment, before JAX starts ------------------------------------------------------------------------

BAD_PLATFORM = st.one_of(
    st.text(st.characters(codec="ascii", categories=("L", "N")), min_size=1, max_size=8).filter(
        lambda s: s.lower() not in PLATFORMS
    ),
    st.sampled_from(["cpu,", ",cpu", "cpu,,tpu", "CPU;TPU", "tpu gpu"]),
)
BAD_COUNT = st.one_of(
    st.integers(max_value=0).map(str),
    st.integers(MAX_EMULATED + 1, 10**9).map(str),
    st.sampled_from(["", "abc", "1.5", "8k", "0x10", "-"]),
)


@GEN
@given(value=BAD_PLATFORM)
def test_a_bad_jax_platforms_is_named(value):
    with pytest.raises(UserError, match="JAX_PLATFORMS=") as e:
        check_environment({"JAX_PLATFORMS": value})
    assert "JAX_PLATFORMS=cpu" in str(e.value)


@GEN
@given(count=BAD_COUNT, before=st.sampled_from(["", "--xla_dump_to=/tmp/x "]))
def test_a_bad_device_count_is_named_with_the_limit(count, before):
    with pytest.raises(UserError, match=f"{DEVICE_COUNT} must be a whole number") as e:
        check_environment({"XLA_FLAGS": f"{before}{DEVICE_COUNT}={count}"})
    assert str(MAX_EMULATED) in str(e.value)


@GEN
@given(word=st.text(st.characters(codec="ascii", categories=("L",)), min_size=1, max_size=10))
def test_a_word_that_is_no_flag_is_named(word):
    with pytest.raises(UserError, match="is not a flag"):
        check_environment({"XLA_FLAGS": f"{DEVICE_COUNT}=8 {word}"})


def test_an_unknown_xla_flag_is_named_by_xla_in_one_line():
    with pytest.raises(UserError, match="Unknown flag in XLA_FLAGS: --xla_not_a_flag=1"):
        check_environment({"XLA_FLAGS": "--xla_not_a_flag=1"})


def test_a_valid_environment_passes():
    check_environment({"JAX_PLATFORMS": "cpu", "XLA_FLAGS": f"{DEVICE_COUNT}=8"})
    check_environment({})


@pytest.mark.parametrize("command", [["audit", "tp_mlp"], ["demo", "--analytic-only"], ["calibrate", "--quick"]])
def test_the_jax_commands_check_the_environment_first(command, monkeypatch):
    monkeypatch.setenv("JAX_PLATFORMS", "bogus")
    assert "JAX_PLATFORMS='bogus'" in assert_user_error(command)


def test_a_platform_that_is_not_here_is_one_line(tmp_path):
    env = {**os.environ, "JAX_PLATFORMS": "cuda"}
    r = subprocess.run(
        [sys.executable, "-m", "lab", "demo", "--analytic-only"],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=300,
    )
    assert r.returncode == 2, r.stderr
    (line,) = r.stderr.strip().splitlines()
    assert line.startswith("shardlab: error: JAX_PLATFORMS='cuda'") and "JAX_PLATFORMS=cpu" in line


def test_a_mesh_past_the_host_is_refused_with_the_limit():
    from lab.run.environment import require_devices

    with pytest.raises(UserError, match=f"more than the {MAX_EMULATED} a host can emulate"):
        require_devices({"X": 64, "Y": 64})


# ----- the same limit for the same quantity in every command -----------------------------------------------------


@pytest.mark.parametrize("flag", ["--warmup", "--repeats"])
def test_calls_are_bounded_alike_in_run_and_plan(flag):
    too_many = str(MAX_CALLS + 1)
    plan = ["plan", "--model", "llama3-8b", "--hardware", "cpu", "--chips", "8", "--batch-tokens", "64Ki"]
    for argv in ([*plan, "--validate", "1", flag, too_many], ["run", "experiments/tp_mlp.toml", flag, too_many]):
        assert f"at most {MAX_CALLS}" in assert_user_error(argv)


# ----- run records: damaged ones named, a resume held to how the run started ---------------------------------------

SWEEP = (EXPERIMENTS / "collective_permute.toml").read_text()


def _started_run(base: Path, exp: Path, env: dict | None) -> Path:
    """A run folder as a started run leaves it (the experiment kept, its env.json), without running anything."""
    run_dir = base / "sweep"
    (run_dir / "points").mkdir(parents=True)
    (run_dir / "experiment.toml").write_bytes(exp.read_bytes())
    if env is not None:
        (run_dir / "env.json").write_text(json.dumps(env))
    return run_dir


@FEW
@given(garbage=st.one_of(st.binary(max_size=40), st.sampled_from([b"[]", b"1", b'"x"', b'{"overrides":', b""])))
def test_a_damaged_env_json_is_named_with_its_fix(tmp_path_factory, garbage):
    base = tmp_path_factory.mktemp("runs")
    exp = base / "sweep.toml"
    exp.write_text(SWEEP)
    run_dir = _started_run(base, exp, None)
    (run_dir / "env.json").write_bytes(garbage)
    try:
        json.loads(garbage)
        parses = isinstance(json.loads(garbage), dict)
    except ValueError:
        parses = False
    argv = ["run", str(exp), "--out", str(base), "--resume", "--run-id", "sweep"]
    if not parses:
        line = assert_user_error(argv)
        assert "env.json" in line and "damaged" in line and "without --resume" in line


def test_a_resume_is_held_to_compile_only(tmp_path):
    exp = tmp_path / "sweep.toml"
    exp.write_text(SWEEP)
    _started_run(tmp_path, exp, {"overrides": {}, "chip_flags": {}, "compile_only": False})
    argv = ["run", str(exp), "--out", str(tmp_path), "--resume", "--run-id", "sweep", "--compile-only"]
    assert "started without --compile-only" in assert_user_error(argv)


def test_a_waiting_lock_takes_its_turn(tmp_path):
    """Two resumes of one sweep take turns: the second waits (said once) and gets the lock when the first lets go."""
    hold = "import fcntl, os, sys, time; fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT); "
    hold += "fcntl.flock(fd, fcntl.LOCK_EX); print('held', flush=True); time.sleep(1.5)"
    owner = subprocess.Popen(
        [sys.executable, "-c", hold, str(tmp_path / store.LOCK)], stdout=subprocess.PIPE, text=True
    )
    assert owner.stdout.readline().strip() == "held"
    said = []
    with store.RunLock(tmp_path, wait=said.append):
        assert owner.poll() is not None  # the lock came only once the owner was gone
    assert len(said) == 1 and "waiting for its turn" in said[0]
    owner.wait(timeout=60)


# ----- user code: an exit or an exception is the user's, with their line ----------------------------------------

USER_EXP = (EXPERIMENTS / "user_flax_mlp.toml").read_text()
STAGES = {
    "import": "{fault}\ndef build(sizes):\n    pass\n",
    "build": "def build(sizes):\n    {fault}\n",
}
FAULTS = {"exit 0": "import sys; sys.exit(0)", "exit 3": "raise SystemExit(3)", "raise": "raise ValueError('mine')"}


@pytest.mark.parametrize("stage", sorted(STAGES))
@pytest.mark.parametrize("fault", sorted(FAULTS))
def test_a_user_model_that_exits_or_raises_is_named_with_its_line(here, stage, fault):
    (here / "m.py").write_text(STAGES[stage].format(fault=FAULTS[fault]))
    lines = USER_EXP.splitlines()
    entry = next(i for i, line in enumerate(lines) if line.startswith("entry"))
    lines[entry] = 'entry = "m.py:build"'
    (here / "exp.toml").write_text("\n".join(lines) + "\n")
    line = assert_user_error(["audit", str(here / "exp.toml")])
    assert "m.py:" in line, line  # the file and the line of the user's code
    assert ("sys.exit" in line) if fault.startswith("exit") else ("ValueError: mine" in line)


# ----- saved plans, edited field by field -------------------------------------------------------------------------

BAD_VALUES = ["-1", "0", '""', "1e999", "[]", '"nope"', "true", "{}", "2.5", '"x" "y"']


def test_a_saved_plan_edited_field_by_field_is_priced_or_refused_in_one_line(here):
    plan = here / "plan.toml"
    assert run([*LLAMA, "--tp", "2", "--save-plan", str(plan), "--json"])[0] == 0
    lines = plan.read_text().splitlines()
    fields = [i for i, line in enumerate(lines) if " = " in line and not line.startswith("#")]
    assert len(fields) > 30
    seen_refusals = 0
    for i in fields:
        for value in BAD_VALUES:
            edited = list(lines)
            edited[i] = f"{lines[i].split(' = ')[0]} = {value}"
            plan.write_text("\n".join(edited) + "\n")
            code, out, err = run(["train", "estimate", "--plan", str(plan), "--json"])
            assert code in (0, 2), (edited[i], err[-300:])
            if code == 2:
                seen_refusals += 1
                assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, (edited[i], err)
            else:
                json.loads(out)
    assert seen_refusals > len(fields)  # most edits are nonsense, and said so


# ----- nonsense that used to be accepted ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("fields", "needle"),
    [
        ({"kv_lora_rank": 512, "rope_head_dim": 63}, "rope-head-dim=63 must be even"),
        ({"head_dim": 127}, "head-dim=127 must be even"),
        ({"experts": 8, "experts_per_token": 2, "dense_d_ff": 1024}, "the model has none"),
    ],
)
def test_model_nonsense_is_refused(fields, needle):
    base = dict(name="m", layers=4, d_model=512, d_ff=1024, heads=8, kv_heads=8, head_dim=64, vocab=1000)
    with pytest.raises(UserError, match=needle):
        ModelConfig(**{**base, **fields})


@pytest.mark.parametrize("flag", ["--dense-d-ff", "--v-head-dim"])
def test_a_width_of_zero_is_refused_as_a_flag(flag):
    assert "is a width of nothing" in assert_user_error([*LLAMA, flag, "0"])


def test_a_named_remat_policy_with_a_checkpoint_count_is_refused():
    line = assert_user_error([*LLAMA, "--remat", "minimal", "--checkpoints-per-layer", "2"])
    assert "give one of them" in line


@GEN
@given(data=st.data())
def test_an_alias_another_chip_owns_is_refused(tmp_path_factory, data):
    taken = sorted({n for c in Catalog().chips() for n in (c.name, *c.aliases)})
    alias = data.draw(st.sampled_from(taken))
    f = tmp_path_factory.mktemp("hw") / "hw.toml"
    f.write_text(f'[chip]\nname = "mine"\nbase = "h100"\naliases = ["{alias}"]\n')
    with pytest.raises(UserError, match="already names"):
        load_hardware_file(f, Catalog())


# ----- SIGTERM is Ctrl-C ----------------------------------------------------------------------------------------------


def test_sigterm_keeps_what_finished_and_says_so_in_one_line(tmp_path):
    """``calibrate`` runs for seconds after JAX's backend (and libtpu's own SIGTERM handler) has started; SIGTERM
    then ends it with the Ctrl-C path's one line and exit 143, not libtpu's stack dump."""
    p = subprocess.Popen(
        [sys.executable, "-m", "lab", "calibrate", "--quick", "--force", "--out", str(tmp_path / "c.json")],
        stderr=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        text=True,
        cwd=tmp_path,
    )
    lines = []
    deadline = time.monotonic() + 240  # a hang guard
    while time.monotonic() < deadline:
        lines.append(p.stderr.readline())
        if "collectives" in lines[-1]:  # past the first device measurements: the backend is up
            break
    p.send_signal(signal.SIGTERM)
    rest = p.stderr.read()
    assert p.wait(timeout=120) == 143, rest
    assert rest.strip().splitlines()[-1].startswith("shardlab: terminated:"), rest
    assert " @ " not in rest and "RAW:" not in rest, rest  # no stack dump
    assert not (tmp_path / "c.json").exists()


def test_a_printed_tool_command_runs_as_printed(monkeypatch, tmp_path):
    """The `tensorboard --logdir` line a run prints names the environment's own copy when the shell would not
    find it (a fresh clone whose .venv is not activated), and the bare name when it would."""
    from lab.core.paths import runnable

    here = Path(sys.executable).parent
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("SHARDLAB_CALLER_PATH", raising=False)
    monkeypatch.setenv("PATH", "/nonexistent")
    printed = runnable("shardlab")
    assert Path(printed).resolve() == (here / "shardlab").resolve()
    assert subprocess.run([printed, "hardware", "list"], capture_output=True, timeout=120).returncode == 0
    monkeypatch.setenv("PATH", f"{here}:/usr/bin:/bin")
    assert runnable("shardlab") == "shardlab"
    monkeypatch.setenv("SHARDLAB_CALLER_PATH", "/usr/bin:/bin")  # scripts/ put .venv/bin on PATH; the shell has not
    assert Path(runnable("shardlab")).resolve() == (here / "shardlab").resolve()


def test_the_usual_xla_flags_cost_no_child_process(monkeypatch):
    """The flags the suite itself runs with are checked in-process (3.5 s a command otherwise); an unknown flag, or
    a known one with a value not of its kind, is still tried by XLA in a child, once per process and value."""
    from lab.run import preflight

    probed = []
    monkeypatch.setattr(preflight, "_probe", lambda value, env: probed.append(value))
    monkeypatch.setattr(preflight, "_checked", set())
    usual = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
    check_environment({"XLA_FLAGS": f"{usual} {DEVICE_COUNT}=8"})
    assert probed == []
    odd = f"{usual} --xla_backend_optimization_level=abc"
    check_environment({"XLA_FLAGS": odd})
    check_environment({"XLA_FLAGS": odd})  # the same value again: not tried twice
    check_environment({"XLA_FLAGS": "--xla_cpu_something_new=1"})
    assert probed == [odd, "--xla_cpu_something_new=1"]


def test_an_error_raised_while_an_interrupt_is_handled_is_the_interrupt():
    """Python 3.11's threading can turn a Ctrl-C into ``RuntimeError: release unlocked lock`` (the interrupt is its
    context): that is the interrupt, exit 130 with its kept line; an error with no interrupt behind it is not."""
    from lab.core.errors import Interrupted, interrupt_in

    def raced():
        try:
            raise Interrupted("2 of 3 points are complete")
        except KeyboardInterrupt:
            raise RuntimeError("release unlocked lock") from None  # `from None` still keeps __context__

    with pytest.raises(RuntimeError) as info:
        raced()
    assert str(interrupt_in(info.value)) == "2 of 3 points are complete"
    assert interrupt_in(RuntimeError("a bug")) is None
    try:
        try:
            raise ValueError("first")
        except ValueError:
            raise RuntimeError("second") from None
    except RuntimeError as exc:
        assert interrupt_in(exc) is None  # a chain of errors with no interrupt in it
