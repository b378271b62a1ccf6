"""A Plan changed on the command line, and a real-size Plan scaled down to this host, said and recorded."""

import json
from pathlib import Path

import pytest

from lab.cli.main import main
from lab.core.errors import UserError
from lab.run.experiment import load_experiment
from lab.run.overrides import override, parse_model, scale_to_host

ROOT = Path(__file__).resolve().parents[1]
DECODE = str(ROOT / "experiments" / "llama3_8b_decode.toml")
TRAIN = str(ROOT / "experiments" / "llama3_8b_train_2layer.toml")


def test_parse_model_fields():
    assert parse_model("layers=2,d-model=1024,tied_embeddings=true") == {
        "layers": 2,
        "d_model": 1024,
        "tied_embeddings": True,
    }
    assert parse_model("base=llama3-8b,layers=1") == {"base": "llama3-8b", "layers": 1}
    # a field whose 0 means none (no window, no shared experts) takes 0; a size does not
    assert parse_model("sliding_window=0,global_layers=0") == {"sliding_window": 0, "global_layers": 0}
    with pytest.raises(UserError, match="sliding_window='-1' is not a whole number >= 0"):
        parse_model("sliding_window=-1")


@pytest.mark.parametrize(
    ("text", "match"),
    [("", "empty"), ("layers", "not FIELD=VALUE"), ("layers=0", "positive whole"), ("layers=two", "positive whole")],
)
def test_bad_model_fields(text, match):
    with pytest.raises(UserError, match=match):
        parse_model(text)


def test_override_changes_and_records_each_flag():
    plan = load_experiment(TRAIN).plan
    new, record = override(plan, mesh="data=4,model=2", sizes="batch=16", dtype="fp32", model="layers=1,d_ff=4096")
    assert new.shape == {"data": 4, "model": 2} and new.sizes["batch"] == 16 and new.sizes["seq"] == 2048
    assert new.dtype == "fp32" and new.model.layers == 1 and new.model.d_ff == 4096
    assert new.model.d_model == plan.model.d_model == 4096  # untouched fields kept
    assert record == {
        "mesh": {"data": 4, "model": 2},
        "sizes": {"batch": 16},
        "dtype": "fp32",
        "model": {"layers": 1, "d_ff": 4096},
    }
    assert override(plan) == (plan, {})


def test_sizes_named_like_the_experiments_own_are_accepted():
    # decode's sizes have underscores (prompt_len); a name that is not one says which are
    new, record = override(load_experiment(DECODE).plan, sizes="prompt_len=64,steps=2")
    assert (new.sizes["prompt_len"], new.sizes["steps"], new.sizes["batch"]) == (64, 2, 16)
    assert record == {"sizes": {"prompt_len": 64, "steps": 2}}
    with pytest.raises(UserError, match=r"unknown size 'prompt-len'; its sizes are batch, prompt_len, steps"):
        override(load_experiment(DECODE).plan, sizes="prompt-len=64")
    with pytest.raises(UserError, match=r"'2x' is not a valid name; example: batch=16,prompt_len=1024,steps=32"):
        override(load_experiment(DECODE).plan, sizes="2x=64")


def test_override_is_validated():
    plan = load_experiment(TRAIN).plan
    with pytest.raises(UserError, match="batch"):
        override(plan, sizes="batch=3")  # not divisible by data=2
    with pytest.raises(UserError, match="no model to change"):
        override(load_experiment(str(ROOT / "experiments" / "tp_mlp.toml")).plan, model="layers=2")


def test_scale_to_host_picks_the_smallest_power_of_two_that_fits():
    plan = load_experiment(TRAIN).plan
    # "fits" at d_model <= 1024: 4096 / 1024 = 4 is the smallest factor
    scaled, record = scale_to_host(plan, lambda p: p.model.d_model <= 1024)
    assert record["factor"] == 4 and scaled.model.d_model == 1024 and scaled.model.d_ff == 14336 // 4
    assert scaled.model.vocab == 128256 // 4 and scaled.sizes["seq"] == 512 and scaled.sizes["batch"] == 8
    assert scaled.model.layers == 2 and scaled.model.heads == 32  # depth and heads are kept
    assert record["fields"]["model.d_model"] == [4096, 1024]
    with pytest.raises(UserError, match="no power-of-two scale"):
        scale_to_host(plan, lambda p: False)


def test_a_real_size_run_that_does_not_fit_says_how_to_scale_it(tmp_path, capsys):
    assert main(["run", TRAIN, "--out", str(tmp_path), "--quiet", "--hardware", "cpu"]) == 2  # no calibration first
    err = capsys.readouterr().err
    assert "GiB per device" in err and "--scale-to-host" in err and len(err.strip().splitlines()) == 1


def test_scale_to_host_is_printed_and_recorded(tmp_path, capsys):
    argv = ["run", DECODE, "--out", str(tmp_path), "--scale-to-host", "--compile-only", "--json", "--quiet"]
    assert main(argv) == 0
    out, err = capsys.readouterr()
    r = json.loads(out)
    s = r["scaled_to_host"]
    assert s["factor"] >= 2 and "scaled down by 1/" in err and "model.d_model 4096 -> " in err
    assert r["plan"]["model"]["d_model"] == 4096 // s["factor"] and s["fields"]["model.d_model"][0] == 4096
    assert r["sizes"]["prompt_len"] == 1024 // s["factor"]
    saved = json.loads((Path(r["run_dir"]) / "report.json").read_text())
    assert saved["scaled_to_host"] == s


def test_run_overrides_are_recorded(tmp_path, capsys):
    exp = str(ROOT / "experiments" / "train_dp.toml")
    argv = ["run", exp, "--out", str(tmp_path), "--compile-only", "--json", "--quiet", "--model", "layers=1"]
    assert main([*argv, "--sizes", "batch=16"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["overrides"] == {"sizes": {"batch": 16}, "model": {"layers": 1}}
    assert r["plan"]["model"]["layers"] == 1 and r["sizes"]["batch"] == 16


def test_warmup_and_repeats_replace_the_experiments_and_are_recorded(tmp_path, capsys):
    exp = str(ROOT / "experiments" / "sharded_matmul_case2.toml")  # its [run]: the defaults, 10 and 5
    assert main(["run", exp, "--out", str(tmp_path), "--json", "--quiet", "--warmup", "0", "--repeats", "2"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["overrides"] == {"warmup": 0, "repeats": 2}
    assert (r["summary"]["warmup"], r["summary"]["repeats"]) == (0, 2)


def _exit_code(argv: list[str]) -> int:
    """``main``'s exit code, argparse's own refusals (a SystemExit) included."""
    try:
        return main(argv)
    except SystemExit as exc:
        return exc.code


def test_launch_refuses_bad_calls_before_starting_a_process(capsys):
    for extra, said in (
        (["--compile-only", "--warmup", "2"], "--warmup with --compile-only: nothing is profiled"),
        (["--repeats", "10001"], "argument --repeats: 10001 is more calls than a profile can hold; give at most 10000"),
    ):
        assert _exit_code(["launch", "--local-processes", "2", DECODE, *extra]) == 2
        err = capsys.readouterr().err.strip()
        assert said in err and len(err.splitlines()) == 1, err


@pytest.mark.parametrize(
    ("overrides", "said"),
    [({"warmup": -1}, "--warmup -1 is not a whole number of calls >= 0"), ({"repeats": "3"}, "--repeats '3' is not")],
)
def test_the_python_api_checks_its_calls_too(tmp_path, overrides, said):
    from lab.run.pipeline import run_experiment

    with pytest.raises(UserError, match=said):
        run_experiment(DECODE, str(tmp_path), overrides=overrides)


def test_a_resume_with_other_options_than_the_start_is_refused(tmp_path):
    """The points still to run would be profiled (or built) otherwise than those kept: refused, naming both."""
    import shutil

    from lab.run.pipeline import run_experiment

    run = tmp_path / "llama3_8b_decode"
    run.mkdir()
    shutil.copyfile(DECODE, run / "experiment.toml")
    (run / "env.json").write_text(json.dumps({"overrides": {"warmup": 1, "repeats": 2}}))
    said = r"started with --warmup 1 --repeats 2; resume with the same options \(not none\)"
    with pytest.raises(UserError, match=said):
        run_experiment(DECODE, str(tmp_path), resume=True, run_id=run.name)
    with pytest.raises(UserError, match=r"\(not --warmup 1\)"):
        run_experiment(DECODE, str(tmp_path), resume=True, run_id=run.name, overrides={"warmup": 1})


def test_a_resume_for_another_chip_than_the_start_is_refused(tmp_path):
    """A sweep started with --hardware h100 and resumed without it (or for another chip) would price its remaining
    points for another chip than its first: refused, naming both. A run recorded before the chip was (no
    chip_flags in env.json) is not held to it."""
    import shutil

    from lab.run.pipeline import run_experiment

    run = tmp_path / "llama3_8b_decode"
    run.mkdir()
    shutil.copyfile(DECODE, run / "experiment.toml")
    (run / "env.json").write_text(json.dumps({"chip_flags": {"hardware": "h100"}}))
    with pytest.raises(UserError, match=r"started with --hardware h100; resume with the same options \(not none\)"):
        run_experiment(DECODE, str(tmp_path), resume=True, run_id=run.name)
    with pytest.raises(UserError, match=r"\(not --hardware a100-80gb\)"):  # as the catalog names it
        run_experiment(DECODE, str(tmp_path), resume=True, run_id=run.name, hardware="a100")
    with pytest.raises(UserError, match="is not a finished run"):  # the same chip by another spelling: accepted
        run_experiment(DECODE, str(tmp_path), resume=True, run_id=run.name, hardware="H100")
    # recorded before chip_flags (an env.json of its day): the options' check passes, the run's own state decides
    (run / "env.json").write_text(json.dumps({"jax": "0.4.30", "backend": "cpu"}))
    with pytest.raises(UserError, match="is not a finished run"):
        run_experiment(DECODE, str(tmp_path), resume=True, run_id=run.name, hardware="a100")


def test_a_run_records_the_chip_flags_it_was_priced_with(tmp_path):
    from lab.run.pipeline import run_experiment

    matmul = str(ROOT / "experiments" / "sharded_matmul_case2.toml")
    plain = run_experiment(matmul, str(tmp_path), compile_only=True, quiet=True, run_id="plain")
    chosen = run_experiment(matmul, str(tmp_path), compile_only=True, quiet=True, run_id="cpu", hardware="cpu")
    assert json.loads((plain.run_dir / "env.json").read_text())["chip_flags"] == {}
    assert json.loads((chosen.run_dir / "env.json").read_text())["chip_flags"] == {"hardware": "cpu"}


def test_warmup_and_repeats_help_states_the_experiments_defaults():
    from lab.cli.main import build_parser
    from lab.run.experiment import REPEATS, WARMUP

    run = build_parser(["run", "--help"])._subparsers._group_actions[0].choices["run"]
    helps = {a.dest: a.help for a in run._actions}
    assert f"default {WARMUP})" in helps["warmup"] and f"default {REPEATS})" in helps["repeats"]


@pytest.mark.parametrize(
    ("extra", "match"),
    [
        (["--warmup", "2", "--compile-only"], "--warmup with --compile-only: nothing is profiled"),
        (["--repeats", "20000"], "argument --repeats: 20000 is more calls than a profile can hold; give at most 10000"),
        (["--scale-to-host", "--target", "v5e:2x4", "--compile-only"], "drop --target"),
        (["--model", "layers=x"], "positive whole"),
        (["--mesh", "data=3,model=4"], "not divisible by mesh axis 'data'"),
    ],
)
def test_bad_overrides_exit_2(tmp_path, capsys, extra, match):
    assert _exit_code(["run", DECODE, "--out", str(tmp_path), *extra]) == 2
    err = capsys.readouterr().err.strip()
    assert match in err and len(err.splitlines()) == 1, err
