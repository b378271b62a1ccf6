"""The Plan and the experiment schema: one description, read from files and flags, refused with file:line."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from lab.cli.main import main
from lab.core.errors import UserError
from lab.core.hardware import get_chip
from lab.core.models import get_model
from lab.core.plan import MeshAxis, Options, Plan, kernel_plan, make_mesh_axes
from lab.core.plan_degrees import plan_from_degrees
from lab.core.rules import PRESETS, ShardingRules
from lab.predict.program.estimate import estimate_program, train_config
from lab.predict.training.config import Layout, TrainConfig
from lab.predict.training.estimate import estimate
from lab.run.experiment import load_experiment

ROOT = Path(__file__).resolve().parent.parent
TRAIN = """# a question
[experiment]
program = "train_step"
dtype = "float32"

[mesh]
data = 2
model = 4

[sizes]
batch = 8
seq = 32

[model]
vocab = 88
d_model = 56
layers = 2
heads = 8
kv_heads = 4
head_dim = 12
d_ff = 104
max_seq_len = 64

[rules]
preset = "fsdp_tp"
"""


def _file(tmp_path, body: str) -> Path:
    p = tmp_path / "exp.toml"
    p.write_text(body)
    return p


# ----- the Plan derives what each consumer needs -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("preset", "degrees"),
    [
        ("dp", {"dp": 8, "fsdp": 1, "tp": 1}),
        ("fsdp", {"dp": 1, "fsdp": 8, "tp": 1}),
        ("tp", {"dp": 2, "fsdp": 1, "tp": 4}),
        ("fsdp_tp", {"dp": 1, "fsdp": 2, "tp": 4}),
    ],
)
def test_degrees_come_from_the_rules_axes(tmp_path, preset, degrees):
    plan = load_experiment(_file(tmp_path, TRAIN.replace('"fsdp_tp"', f'"{preset}"'))).plan
    got = plan.degrees()
    assert {k: got[k] for k in degrees} == degrees
    lay = train_config(plan, get_chip("cpu")).layout
    assert (lay.dp, lay.fsdp, lay.tp, lay.chips) == (degrees["dp"], degrees["fsdp"], degrees["tp"], 8)


def test_partition_specs_and_roles_of_the_shipped_fsdp_tp_plan():
    plan = load_experiment(ROOT / "experiments" / "train_fsdp_tp.toml").plan
    assert plan.rules.spec(("layers", "embed", "heads", "head_dim")) == (None, "data", "model", None)
    assert plan.rules.spec(("batch", None)) == ("data", None)
    assert plan.roles()["tp"] == ("model",) and plan.roles()["fsdp"] == ("data",) and plan.roles()["dp"] == ()
    assert plan.model.params == 77336 and plan.to_dict()["degrees"]["tp"] == 4


def test_a_catalog_model_with_overrides_describes_a_real_size_layer_stack(tmp_path):
    body = TRAIN.replace('dtype = "float32"', 'dtype = "float32"\nmodel = "llama3-8b"')
    body = body[: body.index("[model]")] + "[model]\nlayers = 2\n\n" + body[body.index("[rules]") :]
    plan = load_experiment(_file(tmp_path, body)).plan
    m = plan.model
    assert (m.name, m.layers, m.d_model, m.d_ff, m.heads, m.kv_heads, m.vocab) == (
        "llama3-8b",
        2,
        4096,
        14336,
        32,
        8,
        128256,
    )


def test_slow_axes_price_their_parallelism_across_the_slow_link(tmp_path):
    plan = load_experiment(_file(tmp_path, TRAIN.replace('"fsdp_tp"', '"tp"'))).plan
    slow = dataclasses.replace(plan, mesh=(MeshAxis("data", 2, "slow"), MeshAxis("model", 4)))
    assert slow.slow_axes == ("data",) and slow.role_links()["dp"] == "slow" and slow.role_links()["tp"] == "fast"
    assert train_config(slow, get_chip("h100")).layout.cross_node == ("dp", "batch")
    # LLaMA-3-8B dims (2 layers), dp=2 x tp=4 on H100s: the gradient AllReduce over NVLink, or across two nodes
    m = dataclasses.replace(get_model("llama3-8b"), layers=2)
    times = []
    for links in ((), ("dp",)):
        p = plan_from_degrees(m, hardware="h100", batch=8, seq_len=4096, dp=2, tp=4, slow=links)
        times.append({o.name: o.time_s for o in estimate_program(p, get_chip("h100")).ops}["DP gradient AllReduce"])
    assert times[1] > 5 * times[0]  # 50 GB/s of node egress per GPU against 450 GB/s of NVLink


def test_flags_and_a_saved_plan_price_the_same_job(tmp_path):
    flags = ["train", "estimate", "--model", "llama3-8b", "--hardware", "h100", "--chips", "32", "--tp", "4"]
    flags += ["--pp", "2", "--fsdp", "4", "--global-batch", "64", "--seq-len", "4096", "--microbatch", "2"]
    flags += ["--sequence-parallel", "--pp-schedule", "interleaved", "--interleave", "2", "--remat", "full"]
    saved = tmp_path / "plan.toml"
    a = _json([*flags, "--save-plan", str(saved)])
    b = _json(["train", "estimate", "--plan", str(saved)])
    assert b["step_time_s"] == a["step_time_s"] and b["memory"] == a["memory"] and b["mfu"] == a["mfu"]
    plan = load_experiment(saved).plan  # pipeline axes: priced, not executable yet
    assert plan.degrees()["pp"] == 2 and plan.shape == {"pipe": 2, "fsdp": 4, "model": 4}


def test_a_mixture_of_experts_job_is_saved_with_its_router_and_capacity_and_priced_the_same(tmp_path):
    flags = ["train", "estimate", "--model", "mixtral-8x7b", "--hardware", "h100", "--chips", "16", "--dp", "8"]
    flags += ["--tp", "2", "--ep", "4", "--capacity-factor", "1.25"]
    saved = tmp_path / "plan.toml"
    a = _json([*flags, "--save-plan", str(saved)])
    b = _json(["train", "estimate", "--plan", str(saved)])
    assert b["step_time_s"] == a["step_time_s"] and b["memory"] == a["memory"]
    options = load_experiment(saved).plan.options  # Megatron's router and the stated capacity, not the lab's
    assert options.moe_partial_router is False and options.capacity_factor == 1.25
    assert options.priced_only() == ["capacity_factor = 1.25"]


def test_gradients_reduced_in_fp32_double_what_the_reduction_moves_not_what_zero_gathers(tmp_path):
    """--grad-reduce fp32 (Megatron-LM's default for bf16 training): plain data parallelism all-reduces twice the
    bytes; under ZeRO-1 over the whole group only the ReduceScatter half doubles, the AllGather of the bf16 weights
    stays, so the reduction takes about 1.5x (bandwidth-bound: 1.4-1.6 fixed before looking). The Plan records the
    choice, priced the same, and shardlab run names it as priced only."""
    base = ["train", "estimate", "--model", "llama3-8b", "--hardware", "h100", "--chips", "64", "--dp", "64"]

    def dp_s(*extra: str) -> float:
        return _json([*base, *extra])["breakdown"]["dp_reduction_s"]

    def dp_bytes(*extra: str) -> float:
        return next(o["bytes"] for o in _json([*base, *extra])["ops"] if o["name"] == "DP gradient AllReduce")

    assert dp_bytes("--grad-reduce", "fp32") == 2 * dp_bytes()
    assert dp_s("--grad-reduce", "fp32") > 1.8 * dp_s()
    zero = 1.4 < dp_s("--zero", "1", "--grad-reduce", "fp32") / dp_s("--zero", "1") < 1.6
    assert zero and dp_s("--zero", "1", "--grad-reduce", "bf16") == dp_s("--zero", "1")
    saved = tmp_path / "plan.toml"
    a = _json([*base, "--zero", "1", "--grad-reduce", "fp32", "--save-plan", str(saved)])
    assert _json(["train", "estimate", "--plan", str(saved)])["step_time_s"] == a["step_time_s"]
    assert load_experiment(saved).plan.options.priced_only() == ["grad_reduce = 'fp32'"]
    assert "gradients reduced in fp32" in " ".join(a["assumptions"])


def test_zero_2_reduces_the_gradients_after_every_microbatch():
    """ZeRO-2 partitions the gradients, so each microbatch's backward reduce-scatters them (DeepSpeed's stage 2) and
    the updated weights are gathered once a step: with n microbatches the reduction moves (n + 1) / 2 times ZeRO-1's
    (a ReduceScatter half each microbatch, one AllGather half); with one microbatch the two are the same."""
    base = ["train", "estimate", "--model", "llama2-7b", "--hardware", "a100", "--chips", "8", "--dp", "4"]
    base += ["--tp", "2", "--seq-len", "4096", "--global-batch", "64"]

    def run(zero: str, mb: str) -> dict:
        return _json([*base, "--zero", zero, "--microbatch", mb])

    one, two = run("1", "2"), run("2", "2")  # 8 microbatches a replica
    assert two["microbatches"] == 8
    reduced = two["breakdown"]["dp_reduction_s"] / one["breakdown"]["dp_reduction_s"]
    assert reduced == pytest.approx(9 / 2, rel=1e-9)
    assert two["step_time_s"] > one["step_time_s"]
    whole = ["--global-batch", "4", "--microbatch", "1"]
    assert _json([*base, "--zero", "2", *whole])["step_time_s"] == _json([*base, "--zero", "1", *whole])["step_time_s"]


def test_an_uneven_pipeline_split_is_saved_and_priced_the_same(tmp_path):
    flags = ["train", "estimate", "--model", "llama3-8b", "--hardware", "h100", "--chips", "8", "--tp", "4"]
    flags += ["--pp", "2", "--pp-split", "15,17", "--global-batch", "16", "--microbatch", "2", "--pp-schedule", "gpipe"]
    saved = tmp_path / "plan.toml"
    a = _json([*flags, "--save-plan", str(saved)])
    b = _json(["train", "estimate", "--plan", str(saved)])
    assert b["step_time_s"] == a["step_time_s"] and b["memory"] == a["memory"]
    plan = load_experiment(saved).plan
    assert plan.options.stage_split == (15, 17) and plan.stored_layers() == 34


def test_plan_from_degrees_round_trips_every_layout_degree():
    m = get_model("mixtral-8x7b")
    for kw in (dict(dp=8), dict(fsdp=8, tp=8), dict(dp=4, fsdp=2, ep=2), dict(dp=4, ep=2), dict(pp=4, tp=8, dp=2)):
        plan = plan_from_degrees(m, hardware="h100", batch=64, seq_len=4096, **kw)
        degrees = plan.degrees()
        assert all(degrees[k] == v for k, v in kw.items()), (kw, degrees)
        assert plan.devices == math_prod(v for k, v in kw.items() if k != "ep")  # ep draws from dp x fsdp


def test_a_job_crossing_the_slow_link_keeps_it_through_its_plan():
    """A published run's data-parallel group stated across nodes is priced as its Plan: the data axis on the slow
    link, the role back in the config, the step the stated job's (and not the one inside a node)."""
    from lab.predict.training.from_plan import job_plan
    from lab.predict.training.from_plan import train_config as from_plan

    chip = get_chip("h100")
    lay = Layout(dp=4, tp=2, zero=1, cross_node=("dp",))  # 8 chips: one node unless said otherwise
    job = TrainConfig(model=get_model("llama3-8b"), chip=chip, layout=lay, seq_len=4096, global_batch=32)
    plan = job_plan(job)
    assert plan.slow_axes == ("data",)
    back = from_plan(plan, chip)
    assert "dp" in back.layout.cross_node
    assert estimate(back).step_time_s == estimate(job).step_time_s
    inside = dataclasses.replace(job, layout=dataclasses.replace(lay, cross_node=()))
    assert estimate(inside).step_time_s != estimate(job).step_time_s


def math_prod(xs) -> int:
    out = 1
    for x in xs:
        out *= x
    return out


def test_kernel_plans_get_the_axes_their_kernels_look_up():
    plan = kernel_plan("sharded_matmul_case2", {"X": 8}, {"I": 8, "J": 16, "K": 8})
    assert plan.shape == {"X": 8, "Y": 1}
    assert load_experiment(ROOT / "experiments" / "tp_mlp.toml").plan.rules is None


# ----- bad input: the file, its line and a valid alternative, before anything compiles --------------------------


@pytest.mark.parametrize(
    ("edit", "match"),
    [
        (
            ('"fsdp_tp"\n', '"fsdp_tp"\nheads = "modle"\n'),
            r":\d+: \[rules\]\.heads = 'modle' names mesh axis 'modle'.*"
            r"valid: data, model",
        ),
        (('"fsdp_tp"\n', '"fsdp_tp"\nbatch = ["data", "data"]\n'), r"names a mesh axis twice"),
        (('"fsdp_tp"\n', '"tp"\nembed = "model"\n'), r":2\d: .*mesh axis 'model' to both"),
        (
            ("heads = 8\nkv_heads = 4", "heads = 6\nkv_heads = 6"),
            r":1\d: .*heads=6 \(the model\) is not divisible by mesh axis 'model'",
        ),
        (("layers = 2", "layerz = 2"), r":1\d: \[model\]\.layerz is not a known field; valid: .*layers"),
        (('"fsdp_tp"', '"zero3"'), r":2\d: \[rules\]\.preset = 'zero3' must be one of single, dp"),
        (("seq = 32", "seq = 32\nsteps = 3"), r"\[sizes\]\.steps is not a known field; valid: batch, seq"),
        (("batch = 8", "batch = 7"), r":1\d: .*batch=7 \(the input\) is not divisible by mesh axis 'data'"),
        (("[rules]", '[options]\nremat = "some"\n[rules]'), r"\[options\]\.remat = 'some' must be one of none"),
        (("data = 2", 'data = { size = 2, link = "dcn" }'), r"\[mesh\]\.data link = 'dcn' is not one of fast"),
        (("[rules]", "[sweep]\nbatch = []\n[rules]"), r"\[sweep\]\.batch = \[\] must be a non-empty list"),
        (("[rules]", '[run]\nwarmup = "ten"\n[rules]'), r"\[run\]\.warmup = 'ten' must be a non-negative integer"),
        (("[rules]", "[run]\nrepeats = 9223372036854775807\n[rules]"), r"\[run\]\.repeats = .* at most 10000"),
        (("data = 2", "data = 4611686018427387904"), r"\[mesh\]\.data = .* more devices than any machine has"),
        (("[rules]", '[options]\npp_schedule = "gpipe"\n[rules]'), r'pp_schedule = "gpipe" .* no mesh axis on layers'),
        (("[rules]", '[options]\nparam_dtype = "fp8"\n[rules]'), r"param_dtype 'fp8' is not one of float32, bfloat16"),
        (('dtype = "float32"', 'dtype = "float32"\naxes = ["data"]'), r"only the collective programs take axes"),
    ],
)
def test_bad_plans_name_the_file_line_and_what_is_valid(tmp_path, edit, match):
    with pytest.raises(UserError, match=match):
        load_experiment(_file(tmp_path, TRAIN.replace(*edit)))


KERNEL = """[experiment]
program = "tp_mlp"
[mesh]
X = 2
Y = 4
[sizes]
B = 64
D = 128
F = 512
"""
SWEEP = """[experiment]
program = "collective_all_reduce"
axes = ["X"]
[mesh]
X = 2
Y = 4
[sizes]
N = 1024
[sweep]
N = [1024, 2048]
"""


@pytest.mark.parametrize(
    ("body", "match"),
    [
        # were run silently: unsharded on a misnamed mesh, options ignored, an indivisible size found only by JAX
        (KERNEL.replace("X = 2\nY = 4", "A = 2\nB = 4"), r"mesh axis 'A': tp_mlp shards over X, Y, and the mesh names"),
        (KERNEL + '[options]\nremat = "full"\n', r"\[options\] configure the Transformer's train_step and decode"),
        (KERNEL.replace("B = 64", "B = 63"), r"dim B=63 does not divide over X \(2 shards\)"),
        (SWEEP + "[run.sweep]\nN = [7]\n", r"\[run\]\.sweep and \[sweep\] both sweep sizes"),
        (SWEEP.replace("N = [1024, 2048]", "N = [1024, 1024]"), r"\[sweep\]\.N lists 1024 twice"),
        (SWEEP.replace('axes = ["X"]', "axes = []"), r"exp.toml:\d+: \[experiment\]\.axes = \[\] names no mesh axis"),
        (
            TRAIN.replace('program = "train_step"', 'program = "train_step"\nmodel = "gpt9"'),
            r"exp.toml:4: unknown model",
        ),
        (
            TRAIN.replace('preset = "fsdp_tp"', 'preset = "fsdp_tp"\nheads = ["model", "model"]'),
            r"exp.toml:\d+: sharding",
        ),
    ],
)
def test_kernel_experiments_refuse_what_they_would_ignore(tmp_path, body, match):
    with pytest.raises(UserError, match=match):
        load_experiment(_file(tmp_path, body))


def test_a_bad_plan_is_refused_before_jax_starts(tmp_path):
    bad = _file(tmp_path, TRAIN.replace('"fsdp_tp"\n', '"fsdp_tp"\nheads = "modle"\n'))
    code = (
        "import sys\nfrom lab.cli.main import main\n"
        f"rc = main(['run', {str(bad)!r}, '--out', {str(tmp_path / 'runs')!r}])\n"
        "assert 'jax' not in sys.modules\nsys.exit(rc)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=dict(os.environ), cwd=ROOT
    )
    assert out.returncode == 2, out.stderr
    (line,) = out.stderr.strip().splitlines()
    assert line.startswith("shardlab: error: ") and "exp.toml:" in line and "valid: data, model" in line
    assert not (tmp_path / "runs").exists()


def test_a_plan_too_big_for_its_chip_is_refused_unless_compile_only(tmp_path, jax_devices, capsys):
    chips = tmp_path / "chips.toml"
    chips.write_text('[[chip]]\nname = "cpu-small"\nbase = "cpu"\nhbm_bytes = 100000\n')
    f = _file(tmp_path, TRAIN.replace('dtype = "float32"', 'dtype = "float32"\nhardware = "cpu-small"'))
    out = str(tmp_path / "runs")
    assert main(["run", str(f), "--out", out, "--hardware-file", str(chips), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "GiB per device on cpu-small" in err and "--compile-only" in err and not Path(out).exists()
    assert main(["run", str(f), "--out", out, "--hardware-file", str(chips), "--quiet", "--compile-only"]) == 0
    assert "warning" in capsys.readouterr().err
    report = json.loads((Path(out) / "exp" / "report.json").read_text())
    assert report["compile_only"] and report["audit"]["all_match"] and report["step_time_measured_s"] is None


def test_train_estimate_refuses_layout_flags_beside_a_plan_and_another_program(capsys):
    assert main(["train", "estimate", "--plan", "experiments/train_dp.toml", "--tp", "2"]) == 2
    assert "--tp with --plan" in capsys.readouterr().err
    assert main(["train", "estimate", "--plan", "experiments/decode_tp.toml"]) == 2
    assert "runs decode; train estimate prices train_step (try `infer estimate`)" in capsys.readouterr().err
    assert main(["train", "estimate", "--model", "llama3-8b"]) == 2
    assert "required: --hardware, --chips (or --plan FILE)" in capsys.readouterr().err


def test_the_estimator_learns_the_lab_programs_choices():
    """Where the lab's Transformer is written differently from Megatron, the estimator prices what it is."""
    m, h100 = get_model("llama3-8b"), get_chip("h100")
    lay = Layout(tp=8)
    fused = estimate(TrainConfig(m, h100, lay, 4096, 8))
    unfused = estimate(TrainConfig(m, h100, lay, 4096, 8, microbatch=8, fused_projections=False))
    ar = {o["name"]: o["calls"] for o in unfused.to_dict()["ops"] if o["kind"] == "all-reduce"}
    assert ar["TP AllReduces: 2 forward, 5 backward"] == 7 * m.layers  # q, k, v, gate, up reduced apart
    assert unfused.breakdown["comm_tp_s"] > fused.breakdown["comm_tp_s"]
    fp32 = estimate(TrainConfig(m, h100, lay, 4096, 8, param_dtype="fp32"))
    # fp32 weights are their own master copy: 4 + 4 + 8 bytes per parameter instead of 2 + 4 + 12
    assert fp32.memory.params == 2 * fused.memory.params
    assert fp32.memory.optimizer == pytest.approx(fused.memory.optimizer * 8 / 12)


def test_options_refuse_what_does_not_add_up():
    with pytest.raises(UserError, match="interleave = 2 needs pp_schedule"):
        Options(interleave=2)
    with pytest.raises(UserError, match="zero = 4"):
        Options(zero=4)
    with pytest.raises(UserError, match="link 'dcn'"):
        make_mesh_axes({"data": 2}) and MeshAxis("data", 2, "dcn")
    with pytest.raises(UserError, match="experts = \\['expert'\\]: model 'llama3-8b' is dense"):  # experts run now
        Plan(
            "train_step",
            make_mesh_axes({"expert": 2, "data": 4}),
            {"batch": 8, "seq": 32},
            model=dataclasses.replace(get_model("llama3-8b"), layers=2, max_seq_len=64),
            rules=dataclasses.replace(PRESETS["dp"], batch="data", experts="expert"),
        ).validate()
    with pytest.raises(UserError, match="one mesh axis can split only one dim"):
        ShardingRules(batch="data", heads="data").spec(("batch", None, "heads", None), "q")


def _json(argv) -> dict:
    out = subprocess.run(
        [sys.executable, "-m", "lab", *argv, "--json"], capture_output=True, text=True, timeout=60, cwd=ROOT
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_a_model_the_lab_cannot_build_is_refused_by_name_and_priced_by_the_estimators(tmp_path):
    # GPT-NeoX-20B: a parallel block, biases, LayerNorm, a GeLU MLP: the lab's Transformer builds none of them
    body = TRAIN.replace('dtype = "float32"', 'dtype = "float32"\nmodel = "gpt-neox-20b"')
    body = body[: body.index("[model]")] + "[model]\nlayers = 2\n\n" + body[body.index("[rules]") :]
    with pytest.raises(UserError, match="a parallel attention and MLP block") as e:
        load_experiment(_file(tmp_path, body))
    assert "gpt-neox-20b" in str(e.value) and "biases" in str(e.value)
    m = dataclasses.replace(get_model("gpt-neox-20b"), layers=2)
    cfg = TrainConfig(model=m, chip=get_chip("h100"), layout=Layout(tp=2), seq_len=2048, global_batch=8, microbatch=1)
    assert estimate(cfg).step_time_s > 0


def test_a_windowed_model_is_refused_by_the_lab_transformer_with_its_window(tmp_path):
    # Mistral 7B v0.1 is LLaMA-shaped but for its 4096-token window, which the lab's attention does not mask
    body = TRAIN.replace('dtype = "float32"', 'dtype = "float32"\nmodel = "mistral-7b"')
    body = body[: body.index("[model]")] + "[model]\nlayers = 2\n\n" + body[body.index("[rules]") :]
    with pytest.raises(UserError, match="a 4096-token sliding attention window") as e:
        load_experiment(_file(tmp_path, body))
    assert "sliding_window = 0 in [model] runs it with full attention" in str(e.value)  # and the way out
