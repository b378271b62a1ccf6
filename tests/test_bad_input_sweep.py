"""The bad inputs a user sweep found accepted (or crashing): each is now exit 2 and one line naming the value.

Every case runs in-process through :func:`lab.cli.main.main` and is refused before anything compiles.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lab.cli.main import main

ROOT = Path(__file__).resolve().parent.parent
EXPERIMENTS = ROOT / "experiments"
H100 = ["--hardware", "h100"]
LLAMA = ["--model", "llama3-8b", *H100, "--chips", "8"]
INFER = ["infer", "estimate", *LLAMA, "--batch", "1", "--context", "8"]
SWEEP = ["infer", "sweep", "--model", "llama3-8b", *H100]
OP = ["roofline", "op", *H100, "--bytes", "1Mi"]


def refused(argv: list[str], capsys) -> str:
    """Run ``argv``: exit 2, nothing on stdout, one line on stderr, no traceback; that line."""
    try:
        code = main(argv)
    except SystemExit as exc:  # argparse's own errors
        code = exc.code
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert code == 2, (argv, code, err)
    assert len(lines) == 1 and "error:" in lines[0] and "Traceback" not in err, err
    assert not out.strip(), out
    return lines[0]


@pytest.fixture(autouse=True)
def _in_tmp(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # a command that wrongly succeeded would write its chart here


# ----- (a) mesh axis names in an experiment file ---------------------------------------------------------------------


def _with_axis(tmp_path: Path, source: str, old: str, new: str) -> Path:
    text = (EXPERIMENTS / source).read_text(encoding="utf-8")
    assert f"\n{old} = " in text
    f = tmp_path / "axis.toml"
    f.write_text(text.replace(f"\n{old} = ", f"\n{new} = ", 1), encoding="utf-8")
    return f


AXIS_NAMES = ['"Xé"', '""', '"a b"', '"1"', '"Ω"']


@pytest.mark.parametrize("name", AXIS_NAMES)
def test_a_mesh_axis_name_is_ascii_in_train_estimate(tmp_path, capsys, name):
    f = _with_axis(tmp_path, "train_fsdp_tp.toml", "data", name)
    line = refused(["train", "estimate", "--plan", str(f), *H100], capsys)
    assert f"{f}:10: [mesh] axis name {json.loads(name)!r} is not ASCII letters" in line and "e.g. data = 2" in line


@pytest.mark.parametrize("name", AXIS_NAMES)
def test_a_mesh_axis_name_is_ascii_in_audit(tmp_path, capsys, name):
    """``audit FILE`` compiled the Plan, and XLA aborted the process (SIGABRT) on ``"Xé"``."""
    f = _with_axis(tmp_path, "train_fsdp_tp.toml", "data", name)
    line = refused(["audit", str(f)], capsys)
    assert str(f) in line and "is not ASCII letters and digits" in line


# ----- (b) infer sweep: nothing priced is not a result ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("extra", "needle"),
    [
        (["--chips", "3,5"], "tp=3 does not divide 32 heads"),
        (["--chips", "1e9"], "no topology of h100 serves llama3-8b"),
        (["--chips", "3,5"], "try --chips 1,2,4,8"),
        (["--batches", "1e12"], "--batches 1000000000000: at most"),
        (["--batches", "4,1e12"], "give batches from 1 to"),
    ],
)
def test_infer_sweep_refuses_what_it_cannot_price(capsys, extra, needle):
    assert needle in refused([*SWEEP, *extra, "--json"], capsys)


# ----- (c) absurd values refused with the valid range ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        ([*OP, "--scale", "hbm_bandwidth=1e6,hbm_bandwidth=1e6,hbm_bandwidth=1e6"], "multiply to 1e+12, outside"),
        ([*OP, "--scale", "flops=1e6,peak=1e6"], "multiply to 1e+12, outside 1e-06..1e+06"),
        ([*OP, "--scale", "hbm=1e-6,hbm_capacity=1e-6"], "multiply to 1e-12"),
        ([*OP, "--scale", "hbm_bandwidth=\uff12"], "is not a plain number"),
        ([*OP, "--scale", "hbm_bandwidth=1_000"], "is not a plain number"),
        ([*INFER, "--prefill-len", "100"], "--prefill-len 100 is longer than --context 8"),
        ([*INFER, "--generate", "1e12"], "give at most 16,777,216"),
        (["train", "estimate", *LLAMA, "--tokens", "0.5"], "--tokens 0.5 is less than one step"),
        (["train", "estimate", *LLAMA, "--tokens", "1e12", "--mfu", "1e-300"], "give a fraction from 0.001 to 1"),
        (["train", "estimate", *LLAMA, "--mfu", "0.5"], "give --tokens too"),
        (["train", "estimate", *LLAMA, "--checkpoints-per-layer", "1e9"], "give at most 1000"),
        (["train", "limits", *H100, "--model", "llama3-8b", "--axes", "1000"], "is one axis; give 1"),
        (["train", "limits", *H100, "--model", "llama3-8b", "--tp-axes", "7"], "--tp-axes 7"),
        (["train", "limits", "--hardware", "v5e", "--model", "llama3-8b", "--axes", "3"], "has 2 axes; give 1 to 2"),
        (["train", "limits", *H100, "--d-ff", "8", "--chips", "1e18"], "also needs --batch-tokens"),
        (["train", "limits", *H100, "--d-ff", "8", "--chips", "1e18", "--batch-tokens", "4M"], "at most 1048576"),
        (["study", "memory-tech", "--stacks", "1000"], "give 1 to 32"),
        (["study", "generations", "--model", "llama3-8b", "--chips", "64", "--seq-len", "1e8"], "at most 16,777,216"),
        (["audit", str(EXPERIMENTS / "collective_all_gather.toml"), "--sizes", "N=1e15"], "give at most 68719476736"),
        (["run", str(EXPERIMENTS / "collective_all_gather.toml"), "--sizes", "N=1e15", "--compile-only"], "2**36"),
        (["hardware", "show", "h-1-0-0"], "unknown hardware 'h-1-0-0'; valid: tpu-v3"),
        (["hardware", "show", "h-1-0-0"], "(did you mean h100?)"),
        (["hardware", "show", "\uff48\uff11\uff10\uff10"], "(did you mean h100?)"),
    ],
)
def test_absurd_values_are_refused_with_the_valid_range(capsys, argv, needle):
    assert needle in refused(argv, capsys)


def test_the_train_limits_thresholds_still_take_a_3d_torus(capsys):
    assert main(["train", "limits", "--hardware", "v5p", "--model", "llama3-8b", "--axes", "3", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["axes"] == 3


HARDWARE_FILES = [
    ({"name": "x", "base": "tpu-v5e", "pod_shape": []}, "pod_shape = [] names no axis"),
    ({"name": "x", "base": "tpu-v5e", "torus_dims": 7}, "torus_dims = 7"),
    ({"name": "x", "base": "tpu-v5e", "pod_shape": [16] * 5}, "has 5 axes but torus_dims = 2"),
    ({"name": "x", "base": "h100", "kind": "tpu", "topology": "torus"}, "a torus topology needs torus_dims"),
    ({"name": "x", "base": "h100", "kind": "tpu"}, "kind 'tpu' with topology 'switch': a TPU is priced on a torus"),
    ({"name": "x", "base": "tpu-v5e", "kind": "gpu"}, "kind 'gpu' with topology 'torus': a GPU is priced on a switch"),
    ({"name": "x", "base": "h100", "node_size": 10**26}, "node_size = 1e+26 is outside the plausible 1..1e+06"),
    ({"name": "x", "base": "h100", "hbm_bytes": 1e30}, "hbm_bytes = 1e+30 is outside the plausible"),
    ({"name": "x", "base": "h100", "hbm_bandwidth": 1e-300}, "hbm_bandwidth = 1e-300 is outside the plausible"),
    ({"name": "x", "base": "h100", "hop_latency_s": 1e300}, "hop_latency_s = 1e+300 is outside the plausible 0..1"),
    ({"name": "x", "base": "h100", "price_per_hour": 1e300}, "price_per_hour = 1e+300 is outside"),
    ({"name": "x", "base": "h100", "peak_flops": {"bf16": 1e-300}}, "peak_flops.bf16 = 1e-300 is outside"),
    ({"name": "x", "base": "h100", "calibration": {"collective_factor": {"bogus": 2}}}, "kind 'bogus'"),
    ({"name": "x", "base": "h100", "sources": {"hbm_bytes": 5}}, "sources.hbm_bytes = 5 must be a string"),
    ({"name": "evil\nchip", "base": "h100"}, "name has a control character"),
    ({"name": "x\u202e", "base": "h100"}, "name has a control character"),
    ({"name": "   ", "base": "h100"}, "name = '   ' is blank"),
]


@pytest.mark.parametrize(("entry", "needle"), HARDWARE_FILES)
def test_a_hardware_file_with_absurd_values_is_refused(tmp_path, capsys, entry, needle):
    f = tmp_path / "chips.json"
    f.write_text(json.dumps(entry), encoding="utf-8")
    line = refused(["hardware", "list", "--hardware-file", str(f)], capsys)
    assert "chips.json" in line and needle in line


def test_a_json_hardware_file_with_a_repeated_key_is_refused(tmp_path, capsys):
    f = tmp_path / "chips.json"  # TOML refuses a repeated key itself; JSON would keep the last one silently
    f.write_text('{"name": "x", "base": "h100", "hbm_bandwidth": 1e12, "hbm_bandwidth": 2e12}', encoding="utf-8")
    line = refused(["hardware", "list", "--hardware-file", str(f)], capsys)
    assert "chips.json" in line and "key 'hbm_bandwidth' appears twice" in line


def test_validate_refuses_a_hardware_file_it_would_ignore(tmp_path, capsys):
    f = tmp_path / "chips.json"
    f.write_text(json.dumps({"name": "mine", "base": "h100"}), encoding="utf-8")
    line = refused(["validate", "--hardware-file", str(f)], capsys)
    assert "validate prices the published runs on the catalog's chips" in line and str(f) in line


# ----- experiment files: the file and line named ---------------------------------------------------------------------

GATHER = "collective_all_gather.toml"
TRAIN = "train_fsdp_tp.toml"


@pytest.mark.parametrize(
    ("source", "old", "new", "needle"),
    [
        (GATHER, 'hardware = "calibrated"', 'hardware = ""', ":4: [experiment].hardware = '' names no chip"),
        (GATHER, 'axes = ["X", "Y"]', 'axes = ["X", "X"]', ":6: [experiment].axes names 'X' twice"),
        (GATHER, 'axes = ["X", "Y"]', 'axes = "XY"', ":6: [experiment].axes names 'XY', which is not a mesh axis"),
        (GATHER, "N = [65536, 262144, 1048576, 4194304]", "N = " + str(list(range(8, 24008, 8))), "lists 3000"),
        (TRAIN, 'remat = "none"', 'remat = "none"\ncheckpoints_per_layer = 1e30', "give at most 1000"),
        (GATHER, "N = 262144", "N = 1000000000000000", ":13: collective_all_gather: size N = 1000000000000000 is past"),
    ],
)
def test_an_experiment_file_error_names_the_file(tmp_path, capsys, source, old, new, needle):
    text = (EXPERIMENTS / source).read_text(encoding="utf-8")
    assert old in text
    f = tmp_path / "exp.toml"
    f.write_text(text.replace(old, new, 1), encoding="utf-8")
    line = refused(["audit", str(f)], capsys)
    assert str(f) in line and needle in line


def test_a_sweep_of_too_many_points_is_refused(tmp_path, capsys):
    text = (EXPERIMENTS / "tp_mlp.toml").read_text(encoding="utf-8")
    values = "[" + ", ".join(str(8 * i) for i in range(1, 21)) + "]"
    f = tmp_path / "exp.toml"
    f.write_text(f"{text}\n[sweep]\nB = {values}\nD = {values}\n", encoding="utf-8")
    line = refused(["audit", str(f)], capsys)
    assert str(f) in line and "20 x 20 = 400 points" in line and "at most 256" in line


def test_a_plan_files_unknown_hardware_names_the_file(tmp_path, capsys):
    text = (EXPERIMENTS / TRAIN).read_text(encoding="utf-8")
    f = tmp_path / "exp.toml"
    f.write_text(text.replace('hardware = "calibrated"', 'hardware = "nope"'), encoding="utf-8")
    line = refused(["train", "estimate", "--plan", str(f)], capsys)
    assert f"{f}:6: [experiment].hardware: unknown hardware 'nope'" in line


# ----- (d) messages ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        ([*INFER, "--tp", "3"], "got tp=3 (leave one out"),
        (["model", "show", "/dev/null"], "'/dev/null' is not a regular file"),
        (["train", "estimate", *LLAMA, "--batch-tokens", "4M"], "is not a multiple of --seq-len 8192"),
    ],
)
def test_messages_say_what_is_wrong(capsys, argv, needle):
    line = refused(argv, capsys)
    assert needle in line and "None" not in line


def test_a_folder_given_as_a_model_file_is_called_a_folder(tmp_path, capsys):
    (tmp_path / "dir.toml").mkdir()
    assert "is a folder, not a file" in refused(["model", "show", str(tmp_path / "dir.toml")], capsys)


def test_the_batch_tokens_help_example_works(capsys):
    with pytest.raises(SystemExit):
        main(["train", "estimate", "--help"])
    assert "e.g. 4Mi or 4194304" in " ".join(capsys.readouterr().out.split())
    assert main(["train", "estimate", *LLAMA, "--batch-tokens", "4Mi", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["global_batch"] == 512


# ----- options an experiment file's Plan gives, set again next to --plan ---------------------------------------------


TRAIN_PLAN = ["train", "estimate", "--plan", str(EXPERIMENTS / "train_dp.toml")]
INFER_PLAN = ["infer", "estimate", "--plan", str(EXPERIMENTS / "decode_tp.toml")]


@pytest.mark.parametrize(
    ("argv", "flag"),
    [
        ([*TRAIN_PLAN, "--remat", "full"], "--remat"),
        ([*TRAIN_PLAN, "--microbatch", "2"], "--microbatch"),
        ([*TRAIN_PLAN, "--elementwise", "eager"], "--elementwise"),
        ([*TRAIN_PLAN, "--no-flash-attention"], "--flash-attention"),
        ([*INFER_PLAN, "--weights", "int8"], "--weights"),
        ([*INFER_PLAN, "--ideal"], "--ideal"),
        ([*INFER_PLAN, "--fp8-scaling", "static"], "--fp8-scaling"),
        ([*TRAIN_PLAN, "--tp-comm-overlap"], "--tp-comm-overlap"),
    ],
)
def test_an_option_the_plan_gives_is_refused_next_to_it_not_ignored(capsys, argv, flag):
    line = refused(argv, capsys)
    assert line.startswith(f"shardlab: error: {flag} with --plan: the Plan gives") and "drop them" in line


def test_what_a_plan_does_not_give_still_goes_with_it(capsys):
    argv = [*TRAIN_PLAN, "--tokens", "1e12", "--json"]
    assert main(argv) == 0 and json.loads(capsys.readouterr().out)["days"] > 0


# ----- flags a layout or command makes meaningless (a third sweep's findings) ----------------------------------------

FP8_W8A8 = ["--weights", "fp8", "--compute", "fp8"]
TP4_SP_OVERLAP = ["--tp", "4", "--sequence-parallel", "--tp-comm-overlap"]
TRAIN_64 = ["train", "estimate", "--model", "llama3-8b", *H100, "--chips", "64", "--global-batch", "512"]
DISAGG = ["infer", "disaggregate", "--model", "llama3-70b", *H100, "--prefill-len", "4096", "--generate", "1000"]


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        ([*TRAIN_64, "--tp", "8", "--pp-schedule", "gpipe"], "--pp-schedule gpipe applies to a pipeline"),
        ([*TRAIN_64, "--tp", "8", "--pp-split", "32"], "--pp-split applies to a pipeline"),
        ([*TRAIN_64, "--tp", "8", "--pp-embedding-slots"], "--pp-embedding-slots applies to a pipeline"),
        ([*TRAIN_64, "--pp", "2", "--pp-schedule", "interleaved"], "needs --interleave 2 or more"),
        ([*TRAIN_64, "--dp", "64", "--sequence-parallel"], "--sequence-parallel splits the tensor-parallel group"),
        ([*TRAIN_64, "--tp", "8", "--tp-comm-overlap"], "give it with --tp 2 or more and --sequence-parallel"),
        (
            ["train", "estimate", "--model", "llama3-8b", "--hardware", "v5p", "--chips", "8", *TP4_SP_OVERLAP],
            "--tp-comm-overlap is Transformer Engine's (GPUs); tpu-v5p is a tpu: drop it",
        ),
        ([*TRAIN_64, "--attention-kernel", "fa3", "--no-flash-attention"], "drop --no-flash-attention"),
        ([*DISAGG, "--batch", "32", "--context", "8192"], "required: --chips"),
        ([*DISAGG, "--batch", "32", "--chips", "8"], "required: --context"),
        ([*INFER[:-4], "--batch", "32", "--context", "8192", "--mfu", "0.5"], "give --prefill-len too"),
        ([*INFER[:-4], "--batch", "32", "--context", "8192", "--fp8-scaling", "static"], "--weights fp8 --compute"),
        (
            [*INFER[:-4], "--batch", "8", "--context", "8", *FP8_W8A8, "--fp8-scaling", "dynamic", "--ideal"],
            "without --ideal",
        ),
    ],
)
def test_a_flag_that_would_change_nothing_is_refused(capsys, argv, needle):
    assert needle in refused(argv, capsys)


ALL_REDUCE = ["collective", "all-reduce", "--bytes", "32Mi", "--axis-size", "8", "--no-wraparound"]


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        ([*ALL_REDUCE, *H100], "h100's switch"),
        ([*ALL_REDUCE, "--hardware", "v5e", "--scope", "cross-node"], "not --scope cross-node (DCN)"),
    ],
)
def test_no_wraparound_is_refused_where_there_is_no_torus_axis(capsys, argv, needle):
    assert needle in refused(argv, capsys)


def test_no_wraparound_still_prices_a_torus_axis(capsys):
    base = ["collective", "all-gather", "--hardware", "v5e", "--bytes", "32Mi", "--axis-size", "16", "--json"]
    assert main(base) == 0
    ring = json.loads(capsys.readouterr().out)
    assert main([*base, "--no-wraparound"]) == 0
    line = json.loads(capsys.readouterr().out)
    assert line["time_s"] > ring["time_s"]  # one direction around an open line, both around a ring


@pytest.mark.parametrize(
    ("extra", "option"),
    [
        (["--dp", "8", "--elementwise", "eager"], "elementwise = 'eager'"),
        (["--dp", "8", "--attention-kernel", "fa3"], "attention_kernel = 'fa3'"),
        (["--pp", "2", "--dp", "4", "--pp-embedding-slots"], "pp_embedding_slots = True"),
        (["--tp", "8", "--sequence-parallel", "--tp-comm-overlap"], "tp_comm_overlap = True"),
        (["--dp", "8", "--zero", "1", "--zero-shard", "4"], "zero_shard = 4"),
        (["--dp", "8", "--no-dp-overlap"], "dp_overlap = False"),
        (["--dp", "8", "--dp-bucket-mb", "100"], "dp_bucket_mb = 100.0"),
    ],
)
def test_save_plan_records_another_stacks_options_which_price_the_same_and_do_not_run(tmp_path, capsys, extra, option):
    out = tmp_path / "p.toml"
    argv = ["train", "estimate", "--model", "llama3-8b", *H100, "--chips", "8", *extra, "--json"]
    assert main([*argv, "--save-plan", str(out)]) == 0
    flags = json.loads(capsys.readouterr().out)
    assert main(["train", "estimate", "--plan", str(out), "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["step_time_s"] == flags["step_time_s"] and plan["memory"] == flags["memory"]
    line = refused(["run", str(out)], capsys)  # the lab's Transformer runs the defaults
    assert option in line and "train estimate --plan prices it" in line


def test_train_limits_batch_tokens_alone_is_refused(capsys):
    argv = ["train", "limits", "--hardware", "v5e", "--model", "llama3-8b", "--batch-tokens", "4Mi"]
    assert "goes with --chips (the best FSDP degree) or --checkpoints-per-layer" in refused(argv, capsys)


def test_a_size_no_dim_of_the_expression_names_is_refused(capsys):
    argv = ["sharded-matmul", "--hardware", "v5e", "--sizes", "I=1024,J=8192,K=4096,Z=7", "--mesh", "X=2"]
    line = refused([*argv, "A[I,J_X]*B[J_X,K]->C[I,K]"], capsys)
    assert "--sizes Z=7 names no dim of" in line and "(its dims: I, J, K)" in line


@pytest.mark.parametrize(
    ("extra", "needle"),
    [
        (
            ["--fsdp", "8", "--zero", "1"],
            "--zero 1 shards the state over the data-parallel replicas (and the context shards)",
        ),
        (
            ["--tp", "8", "--zero", "3"],
            "--zero 3 shards the state over the data-parallel replicas (and the context shards); with --dp 1",
        ),
        (["--dp", "8", "--attention-kernel", "fa3", "--hardware", "v5p"], "fa3 is a GPU kernel; tpu-v5p is a tpu"),
    ],
)
def test_a_zero_stage_or_kernel_the_job_cannot_use_is_refused(capsys, extra, needle):
    argv = ["train", "estimate", "--model", "llama3-8b", *H100, "--chips", "8", "--global-batch", "64", *extra]
    assert needle in refused(argv, capsys)


def test_memory_tech_refuses_a_batch_that_fits_no_memory(capsys):
    line = refused(["study", "memory-tech", "--batch", "100000"], capsys)
    assert "--batch 100000 fits none of the memory technologies of h100" in line and "give at most" in line
