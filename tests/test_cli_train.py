"""Command line of the model catalog and the training estimator."""

import json
import subprocess
import sys

import pytest

from lab.cli.main import main


def run_json(capsys, command, *extra):
    """Run ``shardlab COMMAND --json`` in-process; ``command`` is split on spaces, ``extra`` appended as is."""
    assert main([*command.split(), *extra, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_model_show_keys(capsys):
    d = run_json(capsys, "model show llama3-70b --kv-dtype int8")
    for key in (
        "params",
        "active_params",
        "layers",
        "d_model",
        "d_ff",
        "heads",
        "kv_heads",
        "head_dim",
        "vocab",
        "kv_bytes_per_token",
        "flops_per_token",
    ):
        assert key in d
    assert d["kv_bytes_per_token"] == 163840  # 2*8*128*80 bytes (inference.md)
    assert d["flops_per_token"] == 6 * d["params"]
    custom = run_json(
        capsys,
        "model show --layers 2 --d-model 64 --d-ff 256 --heads 4 --vocab 1000 --no-gated-mlp --seq-len 128",
    )
    assert custom["gated_mlp"] is False and custom["seq_len"] == 128
    moe = run_json(capsys, "model show mixtral-8x7b")
    assert moe["active_params"] < moe["params"]


def test_train_estimate_keys(capsys):
    d = run_json(
        capsys,
        "train estimate --model llama3-8b --hardware h100 --chips 16 --tp 2 --global-batch 64 "
        "--seq-len 4096 --tokens 1e12",
    )
    for key in (
        "total_flops",
        "days",
        "step_time_s",
        "breakdown",
        "tokens_per_s",
        "mfu",
        "hfu",
        "memory",
        "fits",
        "min_chips",
        "cost_usd",
    ):
        assert key in d
    assert set(d["breakdown"]) >= {"compute_s", "exposed_comm_s", "bubble_s"}
    assert set(d["memory"]) >= {"params", "grads", "optimizer", "activations", "total"}
    assert d["layout"]["dp"] == 8 and d["layout"]["tp"] == 2  # --dp left out fills the rest
    assert d["days"] == pytest.approx(1e12 / d["tokens_per_s"] / 86400)
    assert d["cost_usd"] == pytest.approx(d["days"] * 24 * 16 * 10.8)


def test_book_training_time_on_a_v5p_pod(capsys):
    # applied-training.md: LLaMA-3 70B on 15T tokens, 6N convention, 8960 v5p chips at 40% MFU: about 44 days.
    d = run_json(
        capsys,
        "train estimate --model llama3-70b --hardware v5p --chips 8960 --tokens 15e12 --mfu 0.4 --global-batch 8960",
    )
    assert d["total_flops"] == pytest.approx(6 * 70.55e9 * 15e12, rel=0.001)
    assert d["days"] == pytest.approx(44, rel=0.03)


def test_narayanan_training_days_with_mfu(capsys):
    # NTT-1: GPT-3 175B, 300B tokens, 1024 A100 at 140 TFLOP/s of 312 with full recomputation (8TP/nX):
    # the 6N estimate at the same achieved rate is 3/4 of the paper's 34 days.
    d = run_json(
        capsys,
        "train",
        "estimate",
        "--model",
        "gpt3-175b",
        "--hardware",
        "a100",
        "--chips",
        "1024",
        "--tp",
        "8",
        "--tokens",
        "300e9",
        "--mfu",
        str(140 / 312),
        "--global-batch",
        "1024",
        "--seq-len",
        "2048",
    )
    days_6n = 6 * 175e9 * 300e9 / (1024 * 140e12) / 86400
    assert d["days"] == pytest.approx(days_6n, rel=0.02)


def test_train_limits_keys(capsys):
    d = run_json(capsys, "train limits --hardware v5p --model llama3-70b --axes 2")
    assert {"dp_min_tokens_per_chip", "tp_max_degree", "fsdp_tp_min_tokens_per_chip"} <= set(d)
    d = run_json(capsys, "train limits --hardware v5p --d-ff 32768 --axes 2 --chips 64 --batch-tokens 49152")
    assert d["fsdp_opt_degree"] == pytest.approx(13.9, rel=0.01)


@pytest.mark.parametrize(("k", "book"), [(3, 171), (4, 225)])
def test_train_limits_chips_to_hold_llama3_70b_as_the_book_counts(capsys, k, book):
    """applied-training.md: LLaMA-3-70B, a 4e6-token batch on v5p (96 GB): 2 B weights + 8 B Adam moments per
    parameter and k bf16 checkpoints of D=8192 per token and layer over 80 layers; the book's 16.5e12 / 96e9 =
    171 with k = 3 (and about 21.6e12 / 96e9 = 225 with k = 4)."""
    argv = f"train limits --hardware v5p --model llama3-70b --batch-tokens 4000000 --checkpoints-per-layer {k}"
    d = run_json(capsys, argv)
    layer = 3 * 8192 * 28672 + 2 * 8192 * 64 * 128 + 2 * 8192 * 8 * 128 + 2 * 8192  # MLP, Q and O, K and V, 2 norms
    params = 80 * layer + 2 * 128256 * 8192 + 8192  # two tables, the final norm
    expected = (params * 10 + 2 * k * 8192 * 4e6 * 80) / 96e9
    assert d["min_chips_to_hold"] == pytest.approx(expected, rel=1e-9)
    assert int(d["min_chips_to_hold"]) == book


def test_scale_what_if(capsys):
    args = [
        "train",
        "estimate",
        "--model",
        "llama3-8b",
        "--hardware",
        "h100",
        "--chips",
        "8",
        "--tp",
        "8",
        "--global-batch",
        "8",
        "--seq-len",
        "4096",
    ]
    base = run_json(capsys, *args)
    fast = run_json(capsys, *args, "--scale", "ici_bandwidth=2")
    assert fast["breakdown"]["comm_tp_s"] < base["breakdown"]["comm_tp_s"]
    assert fast["hardware"].startswith("h100[")


def test_plan_command(capsys):
    d = run_json(
        capsys,
        "plan",
        "--model",
        "llama3-8b",
        "--hardware",
        "h100",
        "--chips",
        "16",
        "--batch-tokens",
        str(64 * 4096),
        "--seq-len",
        "4096",
        "--top",
        "3",
    )
    assert len(d["top"]) == 3 and d["evaluated"] >= d["feasible"] > 0
    times = [e["step_time_s"] for e in d["top"]]
    assert times == sorted(times) and all(e["fits"] and e["chips"] == 16 for e in d["top"])


def test_study_generations_writes_its_chart(capsys, tmp_path):
    png = tmp_path / "gen.png"
    d = run_json(capsys, "study", "generations", "--chips", "128", "--global-batch", "256", "--png", str(png))
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    names = [r["hardware"] for r in d["rows"]]
    assert names[0] == "a100-80gb" and "b200" in names


def test_validate_command(capsys):
    d = run_json(capsys, "validate", "--group", "calibration")
    assert d["all_passed"] is True
    assert len(d["rows"]) > 60


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (
            [
                "train",
                "estimate",
                "--model",
                "llama3-8b",
                "--hardware",
                "h100",
                "--chips",
                "16",
                "--tp",
                "4",
                "--dp",
                "3",
            ],
            "dp=3 x tp=4 = 12 chips but --chips is 16",
        ),
        (
            ["train", "estimate", "--model", "llama3-8b", "--hardware", "h100", "--chips", "16", "--tp", "3"],
            "--chips 16 is not a multiple of tp x pp x cp = 3",
        ),
        (
            ["train", "estimate", "--model", "llama3-8b", "--hardware", "h100", "--chips", "8", "--global-batch", "12"],
            "global batch 12 sequences does not divide over dp x fsdp = 8; try 8 or 16",
        ),
        (
            [
                "train",
                "estimate",
                "--model",
                "llama3-8b",
                "--hardware",
                "h100",
                "--chips",
                "8",
                "--global-batch",
                "8",
                "--microbatch",
                "2",
            ],
            "--microbatch 2 is larger than the 1 sequences",
        ),
        (
            [
                "train",
                "estimate",
                "--model",
                "llama3-8b",
                "--hardware",
                "h100",
                "--chips",
                "8",
                "--pp",
                "3",
                "--dp",
                "1",
                "--fsdp",
                "1",
                "--tp",
                "1",
            ],
            "make the degrees multiply to 8",
        ),
        (
            [
                *("train", "estimate", "--model", "llama3-8b", "--hardware", "h100", "--chips", "10", "--pp", "5"),
                *("--pp-schedule", "interleaved", "--interleave", "2"),
            ],
            "--pp 5 x --interleave 2 does not divide 32 layers; try --pp 4",
        ),
        (["train", "estimate", "--model", "llama9", "--hardware", "h100", "--chips", "8"], "unknown model 'llama9'"),
        (
            ["train", "estimate", "--model", "llama3-8b", "--hardware", "h100", "--chips", "8", "--remat", "most"],
            "argument --remat: invalid choice: 'most' (choose from 'none', 'selective', 'full', 'minimal'",
        ),
        (
            [
                "train",
                "estimate",
                "--model",
                "llama3-8b",
                "--hardware",
                "h100",
                "--chips",
                "8",
                "--pp",
                "4",
                "--tp",
                "2",
                "--pp-split",
                "8,8,8,9",
            ],
            "--pp-split 8,8,8,9 adds up to 33 layers but the model has 32; e.g. --pp-split 8,8,8,8",
        ),
        (
            [
                "train",
                "estimate",
                "--model",
                "llama3-8b",
                "--hardware",
                "h100",
                "--chips",
                "8",
                "--pp",
                "4",
                "--tp",
                "2",
                "--pp-split",
                "8,x",
            ],
            "argument --pp-split:",
        ),
        (
            ["train", "estimate", "--model", "llama3-8b", "--hardware", "h100", "--chips", "8", "--scale", "warp=2"],
            "--scale: unknown field 'warp'",
        ),
        (
            [
                "train",
                "estimate",
                "--model",
                "llama3-8b",
                "--hardware",
                "h100",
                "--chips",
                "8",
                "--batch-tokens",
                "1000",
                "--seq-len",
                "4096",
            ],
            "--batch-tokens 1000 is not a multiple of --seq-len 4096",
        ),
        (["model", "show", "--layers", "-2", "--d-model", "64"], "argument --layers: '-2' is not a number >= 1"),
        (
            [
                "plan",
                "--model",
                "llama3-70b",
                "--hardware",
                "h100",
                "--chips",
                "8",
                "--batch-tokens",
                "65536",
                "--seq-len",
                "8192",
            ],
            "nothing fits on 8 h100",
        ),
        (["study", "generations", "--chips", "100"], "--chips 100 does not divide"),
        (
            ["train", "estimate", "--model", "llama3-8b", "--hardware", "a100", "--chips", "8", "--dtype", "fp8"],
            "a100-80gb has no fp8 peak",
        ),
        (
            ["train", "estimate", "--model", "llama3-8b", "--hardware", "a100", "--chips", "8", "--elementwise", "jit"],
            "invalid choice: 'jit' (choose from 'fused', 'eager')",
        ),
    ],
)
def test_bad_input_exit_2(argv, needle):
    r = subprocess.run([sys.executable, "-m", "lab", *argv], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2, (r.stdout, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0], r.stderr
    assert "Traceback" not in r.stderr


def test_fewer_microbatches_than_stages_runs_with_the_bubble_said(capsys):
    from lab.cli.main import main

    argv = "train estimate --model llama3-8b --hardware h100 --chips 64 --pp 8 --tp 8 --global-batch 4 --seq-len 4096"
    assert main(argv.split()) == 0
    err = capsys.readouterr().err
    # (p - 1) / (m + p - 1) = 7 / 11 of the step idle on every stage
    assert "4 microbatches for 8 pipeline stages: each stage idles 64% of the step; give at least 8" in err


def test_eager_elementwise_ops_slow_the_step_and_say_so(capsys):
    args = "train estimate --model llama2-7b --hardware a100 --chips 8 --fsdp 8 --seq-len 4096 --global-batch 16"
    fused, eager = run_json(capsys, args), run_json(capsys, args, "--elementwise", "eager")
    ops = {(o["name"], o["kind"]) for o in eager["ops"]}
    assert eager["step_time_s"] > fused["step_time_s"] and eager["mfu"] < fused["mfu"]
    assert eager["breakdown"]["compute_s"] > fused["breakdown"]["compute_s"]
    assert eager["model_flops_per_step"] == fused["model_flops_per_step"]  # the same matmuls, more bytes
    assert ops == {(o["name"], o["kind"]) for o in fused["ops"]}


def test_a_pipeline_the_layers_do_not_divide_runs_uneven_stages_priced_at_the_busiest(capsys):
    # LLaMA-3 8B's 32 layers over 5 stages: 7/7/6/6/6, as an explicit --pp-split of the same prices it
    base = ["train", "estimate", "--model", "llama3-8b", "--hardware", "h100", "--chips", "10", "--pp", "5", "--json"]
    assert main(base) == 0
    auto = json.loads(capsys.readouterr().out)
    assert main([*base, "--pp-split", "7,7,6,6,6"]) == 0
    split = json.loads(capsys.readouterr().out)
    assert auto["layout"]["stage_split"] == [7, 7, 6, 6, 6] and auto["step_time_s"] == split["step_time_s"]


def test_an_interleaved_pipeline_the_layers_do_not_divide_gives_the_embedding_and_loss_a_slot(capsys):
    # LLaMA-3 405B: 126 layers over 16 stages x 8 chunks do not divide; with the embedding and the loss, 128 do
    base = ["train", "estimate", "--model", "llama3-405b", "--hardware", "h100", "--chips", "1024", "--tp", "8"]
    base += ["--pp", "16", "--pp-schedule", "interleaved", "--interleave", "8", "--seq-len", "8192", "--json"]
    assert main(base) == 0
    auto = json.loads(capsys.readouterr().out)
    assert main([*base, "--pp-embedding-slots"]) == 0
    slots = json.loads(capsys.readouterr().out)
    assert auto["layout"]["pp_embedding_slots"] is True and auto["step_time_s"] == slots["step_time_s"]


def test_fp16_mixed_precision_and_adamw_are_priced_as_their_16_bit_and_adam_equals(capsys):
    # fp16 matmuls run at the bf16 rate on GPUs that have both; AdamW keeps Adam's master weights and two moments
    base = ["train", "estimate", "--model", "llama2-7b", "--hardware", "a100", "--chips", "8", "--seq-len", "4096"]
    runs = {}
    for extra in ((), ("--dtype", "fp16"), ("--optimizer", "adamw")):
        assert main([*base, *extra, "--json"]) == 0
        runs[extra] = json.loads(capsys.readouterr().out)
    steps = {r["step_time_s"] for r in runs.values()}
    assert len(steps) == 1 and runs[("--dtype", "fp16")]["dtype"] == "fp16"
    with pytest.raises(SystemExit) as bad:
        main([*base, "--optimizer", "lion"])
    assert bad.value.code == 2
    assert "'lion' is not an optimizer; valid: adam, sgd, adafactor, adamw" in capsys.readouterr().err
    tpu = ["train", "estimate", "--model", "llama2-7b", "--hardware", "v5e", "--chips", "8", "--dtype", "fp16"]
    assert main(tpu) == 2
    assert "tpu-v5e has no fp16 peak" in capsys.readouterr().err


# ----- the flags' job is read into its Plan, and the estimator prices the config made from that Plan ----------------

FLAG_JOBS = [
    "--model llama3-8b --hardware h100 --chips 8",
    "--model llama3-8b --hardware h100 --chips 64 --tp 8 --dp 8 --sequence-parallel --zero 1",
    "--model llama3-70b --hardware h100 --chips 64 --tp 8 --pp 4 --dp 2 --pp-schedule interleaved --interleave 2 "
    "--remat full",
    "--model llama3-70b --hardware h100 --chips 64 --tp 4 --fsdp 16 --remat minimal_offloaded",
    "--model llama3-405b --hardware h100 --chips 1024 --tp 8 --pp 16 --dp 8",
    "--model mixtral-8x7b --hardware h100 --chips 16 --dp 2 --fsdp 8 --ep 8",
    "--model mixtral-8x7b --hardware h100 --chips 16 --dp 2 --fsdp 4 --tp 2 --ep 8 --capacity-factor 1.25",
    "--model llama3-8b --hardware tpu-v5p --chips 256 --fsdp 64 --tp 4",
    "--model llama3-8b --hardware h100 --chips 32 --cp 4 --dp 8 --zero 1 --seq-len 32768 --global-batch 16",
    "--model llama3-8b --hardware a100 --chips 16 --dp 16 --zero 2 --zero-shard 8 --no-dp-overlap --dp-bucket-mb 100 "
    "--elementwise eager",
    "--model gpt3-175b --hardware h100 --chips 512 --tp 8 --pp 8 --dp 8 --sequence-parallel --tp-comm-overlap "
    "--attention-kernel fa3 --dtype fp8",
    "--model llama3-70b --hardware h100 --chips 128 --tp 8 --pp 16 --pp-split 4,5,5,5,5,5,5,5,5,5,5,5,5,5,5,2",
    "--model llama3-8b --hardware h100 --chips 8 --dtype fp16 --optimizer adamw --no-flash-attention",
    "--model llama3-8b --hardware h100 --chips 8 --checkpoints-per-layer 10 --remat selective --batch-tokens 4Mi",
    "--model llama3-405b --hardware h100 --chips 2048 --tp 8 --pp 16 --dp 16 --pp-schedule interleaved "
    "--interleave 7 --pp-embedding-slots",
    "--model deepseek-v3 --hardware h100 --chips 2048 --pp 16 --dp 128 --ep 64",
    "--model llama3-8b --hardware h100 --chips 64 --dp 64 --zero 1 --grad-reduce fp32",
]


@pytest.mark.parametrize("flags", FLAG_JOBS)
def test_the_flags_job_is_priced_from_its_plan_whole(flags):
    """Every degree and option the flags set survives the Plan (what --save-plan writes) and comes back in the config
    the estimator prices, field for field: the flags' job is one description, the Plan."""
    from lab.cli import train as cli_train
    from lab.cli.args import chip_of
    from lab.cli.main import build_parser
    from lab.predict.training.from_plan import job_plan

    argv = ["train", "estimate", *flags.split()]
    args = build_parser(argv).parse_args(argv)
    chip = chip_of(args)
    read = cli_train._flags_job(args, chip)
    plan = job_plan(read)
    assert plan.degrees() == read.layout.degrees()
    assert cli_train.train_config(args, chip) == read


def test_a_named_recomputation_policy_is_saved_priced_the_same_and_not_run(tmp_path, capsys):
    from lab.cli.main import main

    saved = tmp_path / "p.toml"
    argv = ["train", "estimate", "--model", "llama3-70b", "--hardware", "h100", "--chips", "64", "--tp", "4"]
    argv += ["--fsdp", "16", "--remat", "minimal_offloaded", "--json"]
    assert main([*argv, "--save-plan", str(saved)]) == 0
    flags = json.loads(capsys.readouterr().out)
    assert main(["train", "estimate", "--plan", str(saved), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["step_time_s"] == flags["step_time_s"]
    assert main(["run", str(saved)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "remat 'minimal_offloaded': the lab's Transformer runs none, selective, full" in err[0]
