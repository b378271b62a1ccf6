"""Cross-compiled TPU truth: a Plan compiled for a TPU topology that is not here, audited against its estimate.

The compile tests need libtpu (installed by ./scripts/test on Linux x86-64 through the dev extra); elsewhere they
are skipped with that reason. Names, bad input and the HLO arithmetic are tested everywhere.
"""

import importlib.util
import json
from pathlib import Path

import pytest

from lab.cli.main import main
from lab.compile.hlo_dots import _taps
from lab.compile.target import parse_target
from lab.core.errors import UserError

ROOT = Path(__file__).resolve().parents[1]
needs_libtpu = pytest.mark.skipif(
    importlib.util.find_spec("libtpu") is None,
    reason="libtpu is not installed (pip install -e '.[tpu]'; ./scripts/test installs it on Linux x86-64)",
)
# XLA's memory per device (arguments, outputs and temporaries, less aliases) against the estimator's, fixed up
# front: the MLP block between the estimate less its hidden activation (which libtpu may stream through the
# fusion instead of holding) and the estimate; the real-size train step within 25% (XLA's temporaries: fusion
# buffers and the f32 logits, which the estimator counts by formula).
TRAIN_MEMORY = (0.8, 1.25)


@pytest.mark.parametrize(
    ("text", "chip", "chips", "kind"),
    [
        ("v5e:2x4", "tpu-v5e", 8, "TPU v5 lite"),
        ("v5p:2x2x2", "tpu-v5p", 8, "TPU v5"),
        ("V6E:4x4", "tpu-v6e", 16, "TPU v6 lite"),
        ("v4:2x2x1", "tpu-v4", 4, "TPU v4"),
    ],
)
def test_topology_names(text, chip, chips, kind):
    t = parse_target(text)
    assert (t.chip, t.chips, t.device_kind) == (chip, chips, kind)


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("v9z:2x4", "unknown TPU generation 'v9z'"),
        ("v5e", "not a TPU topology or GPU name"),
        ("v5e:2x2x2x2", "not a TPU topology or GPU name"),
        ("v5e:0x4", "no chips"),
        ("a10g:8", "not a TPU topology or GPU name"),  # a catalog GPU XLA has no target configuration for
    ],
)
def test_bad_topology_names_list_the_known_ones(text, match):
    with pytest.raises(UserError, match=match) as e:
        parse_target(text)
    assert "v5e:2x4" in str(e.value)


def test_missing_libtpu_says_how_to_install(monkeypatch, capsys):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "libtpu" else real(name, *a))
    assert main(["audit", "tp_mlp", "--target", "v5e:2x4", "--dtype", "bf16"]) == 2
    err = capsys.readouterr().err
    assert "needs libtpu" in err and "pip install -e '.[tpu]'" in err and "Traceback" not in err


@pytest.mark.parametrize(
    ("argv", "match"),
    [
        (["audit", "tp_mlp", "--target", "v7q:2x4"], "unknown TPU generation"),
        (["audit", "--list", "--target", "v5e:2x4"], "drop --target"),
        (["run", "experiments/tp_mlp.toml", "--target", "v5e:2x4"], "add --compile-only"),
        (["run", "experiments/tp_mlp.toml", "--compile-only", "--target", "v6e:4x4"], "has 16 chips"),
        (["run", "experiments/tp_mlp.toml", "--compile-only", "--target", "v5e:2x4"], 'set dtype = "bfloat16"'),
    ],
)
def test_bad_target_input_is_one_line_and_exit_2(tmp_path, monkeypatch, capsys, argv, match):
    monkeypatch.chdir(ROOT)
    argv = [*argv, "--out", str(tmp_path)] if argv[0] == "run" else argv
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert match in err and len(err.splitlines()) == 1, err


def test_dilated_window_taps():
    # A batch dim written as a window: size 4 over an input dilated by 4, stride 3 -> one real tap per output.
    assert _taps(n_in=4, n_out=4, size=4, stride=3, lo=0, lhs_dilate=4, rhs_dilate=1) == 4
    # A plain matmul's window of 1 over 1 position; a 3-wide window over 5 padded by 1 each side.
    assert _taps(1, 1, 1, 1, 0, 1, 1) == 1
    assert _taps(n_in=5, n_out=5, size=3, stride=1, lo=1, lhs_dilate=1, rhs_dilate=1) == 13


@needs_libtpu
@pytest.mark.parametrize(
    ("topology", "mesh"), [("v5e:2x4", "X=2,Y=4"), ("v5p:2x2x2", "X=2,Y=4"), ("v6e:4x4", "X=4,Y=4")]
)
def test_mlp_block_cross_compiles_and_matches(capsys, topology, mesh):
    sizes = "B=512,D=1024,F=4096"
    argv = ["audit", "tp_mlp", "--target", topology, "--mesh", mesh, "--dtype", "bf16", "--sizes", sizes]
    assert main([*argv, "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["backend"] == "tpu" and d["emulated"] is False and d["compiled_for"] == topology
    assert d["all_match"], d
    (ar,) = d["entries"]
    x = int(mesh[2])  # B over X, bf16
    assert ar["kind"] == "all-reduce" and ar["compiled_bytes"] == ar["predicted_bytes"] == 512 // x * 1024 * 2
    assert d["flops_compiled"] == d["flops_predicted"]
    y = int(mesh[-1])
    held = {"x": 512 // x * 1024, "w1": 1024 * 4096 // y, "w2": 4096 // y * 1024, "hidden": 512 // x * 4096 // y}
    held["out"] = held["x"]
    estimate = 2 * sum(held.values())  # bf16
    assert d["memory"]["estimator_bytes"] == estimate
    assert estimate - 2 * held["hidden"] <= d["memory"]["compiled_bytes"] <= estimate
    assert d["xla"]["cost"]["flops"] > 0 and d["xla"]["memory"]["argument_size_in_bytes"] > 0


MID_MODEL = """
[experiment]
program = "train_step"
dtype = "bfloat16"
[mesh]
data = {data}
model = 4
[sizes]
batch = 8
seq = 256
[model]
vocab = 2048
d_model = 256
layers = 2
heads = 8
kv_heads = 4
head_dim = 32
d_ff = 1024
max_seq_len = 256
[rules]
preset = "fsdp_tp"
"""


def _audit_mid(folder: Path, topology: str, data: int) -> tuple[dict, str]:
    """``shardlab audit --target`` of MID_MODEL over ``data`` x 4: its JSON and the compiled HLO's text."""
    import contextlib
    import io

    exp, hlo, out = folder / f"mid{data}.toml", folder / f"mid{data}.hlo", io.StringIO()
    exp.write_text(MID_MODEL.format(data=data))
    with contextlib.redirect_stdout(out):
        assert main(["audit", str(exp), "--target", topology, "--hlo", str(hlo), "--json"]) == 0
    return json.loads(out.getvalue()), hlo.read_text()


@pytest.fixture(scope="module")
def mid_v5e(tmp_path_factory):
    """MID_MODEL (data=2) compiled once for v5e:2x4 (10-20 s of libtpu on 2 cores), read by two tests."""
    return _audit_mid(tmp_path_factory.mktemp("mid"), "v5e:2x4", 2)


@needs_libtpu
# v5e by default (it shares the mid_v5e compile); the 3-D torus and v6e's padded lanes under -m slow (7-10 s each
# of libtpu from a fresh clone)
@pytest.mark.parametrize(
    ("topology", "data"),
    [("v5e:2x4", 2), *(pytest.param(t, d, marks=pytest.mark.slow) for t, d in (("v5p:2x2x2", 2), ("v6e:4x4", 4)))],
)
def test_train_step_cross_compiles_with_every_predicted_collective(request, tmp_path, topology, data):
    if topology == "v5e:2x4":
        d, _ = request.getfixturevalue("mid_v5e")
    else:
        d, _ = _audit_mid(tmp_path, topology, data)
    kinds = {(e["kind"], tuple(e["axes"])) for e in d["entries"]}
    assert {("all-reduce", ("model",)), ("all-gather", ("data",)), ("reduce-scatter", ("data",))} <= kinds
    assert all(e["compiled_bytes"] > 0 for e in d["entries"]), d["entries"]
    # The Megatron AllReduces: the TPU compiler reduces Q/K/V's and gate/up's input gradients once each.
    (tp,) = [e for e in d["entries"] if e["axes"] == ["model"] and e["kind"] == "all-reduce"]
    assert tp["match"] and tp["compiled_bytes"] == tp["predicted_bytes"]
    assert d["flops_match"], (d["flops_compiled"], d["flops_predicted"])
    # FSDP as libtpu builds it (weights cast to bf16 before their gathers, gradients reduced in bf16, some as
    # AllReduces): every byte accounted for, nothing unexpected
    assert d["all_match"] and not d["unexpected"], d["entries"]
    (ag,) = [e for e in d["entries"] if e["kind"] == "all-gather"]
    assert "cast first" in ag["op"]
    # Memory, the difference located: the state XLA keeps (its arguments: fp32 weight shards and Adam's two moments,
    # and the int32 token batch) is the estimator's, up to TPU tiling: Adam's step count (an s32 scalar) is held as
    # 128 lanes (512 B), and on v6e (data=4) shards 64 wide in their minor dimension are padded to 128 lanes. The
    # rest is working memory, where XLA's temporaries and the estimator's activation formula part (temporaries over
    # the estimate: 0.32 on v5e, 2.4 on v5p; libtpu reports no temporaries for this step on v6e).
    m = d["memory"]
    state = m["estimator_state_bytes"] + 8 // data * 256 * 4
    if data == 2:
        assert m["compiled_argument_bytes"] == state + 512
    else:
        assert state < m["compiled_argument_bytes"] <= 1.15 * state
    assert m["estimator_working_bytes"] == m["estimator_bytes"] - m["estimator_state_bytes"] > 0


@needs_libtpu
@pytest.mark.parametrize("remat", ["selective", pytest.param("full", marks=pytest.mark.slow)])  # 13 s of libtpu each
def test_recomputed_train_steps_on_tpu(tmp_path, capsys, remat):
    exp = tmp_path / "mid.toml"
    exp.write_text(MID_MODEL.format(data=2) + f'[options]\nremat = "{remat}"\n')
    assert main(["audit", str(exp), "--target", "v5e:2x4", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    by_kind = {(e["kind"], tuple(e["axes"])): e for e in d["entries"]}
    # the recomputed forward leaves out each layer's last projection: its matmul and its AllReduce
    assert d["flops_match"] and by_kind[("all-reduce", ("model",))]["match"]
    assert by_kind[("reduce-scatter", ("data",))]["match"] and not d["unexpected"]
    if remat == "selective":
        assert d["all_match"], d["entries"]
    else:  # libtpu gathers the attention weights a third time for the recomputed forward (bf16, per device: q and
        # out 256 x 8 x 32 / 4 x 2 B = 16 kB, k and v 8 kB, in each of 2 layers); the estimate does not say so
        ag = by_kind[("all-gather", ("data",))]
        assert ag["compiled_bytes"] - ag["predicted_bytes"] == 2 * (2 * 16384 + 2 * 8192)


@pytest.mark.slow  # 60 s of libtpu compilation on 2 cores
@needs_libtpu
def test_real_size_train_step_audits_all_match_on_v5e(capsys):
    exp = str(ROOT / "experiments" / "llama3_8b_train_2layer.toml")
    assert main(["audit", exp, "--target", "v5e:2x4", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["all_match"] and not d["unexpected"], d["entries"]
    # the two halo rows of the padded gate/up gradient reduce-scatters (4096 rows as 2 x 2080), one per layer
    assert [(u["kind"], u["axes"]) for u in d["explained"]] == [("permute", ["data"])] * 2
    assert all(u["bytes"] == 2 * 32 * 3584 * 2 for u in d["explained"])  # 2 layers x 32 rows x 3584 bf16


@pytest.mark.slow  # 35 s of libtpu compilation on 2 cores
@needs_libtpu
def test_real_size_train_step_memory_and_flops_on_v5e(tmp_path, capsys):
    shipped = (ROOT / "experiments" / "llama3_8b_train_2layer.toml").read_text()
    assert 'remat = "none"' in shipped
    exp = tmp_path / "full_remat.toml"  # under full recomputation: the activations the estimator counts by formula
    exp.write_text(shipped.replace('remat = "none"', 'remat = "full"'))
    assert main(["audit", str(exp), "--target", "v5e:2x4", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert TRAIN_MEMORY[0] <= d["memory"]["ratio"] <= TRAIN_MEMORY[1], d["memory"]
    assert d["hardware"] == "tpu-v5e"
    # full recomputation as JAX runs it: the recomputed forward leaves out each layer's last projection (exact)
    assert d["flops_match"] and d["flops_compiled"] == d["flops_predicted"]


@pytest.mark.slow  # 10 s of libtpu compilation on 2 cores
@needs_libtpu
def test_real_size_train_step_memory_with_nothing_recomputed_on_v5e(capsys):
    """The shipped experiment as it is (remat none): the activations JAX saves (training.memory, jax_saved), the
    probabilities once in bf16; the compiler held 1.47x the estimate before both were counted."""
    exp = str(ROOT / "experiments" / "llama3_8b_train_2layer.toml")
    assert main(["audit", exp, "--target", "v5e:2x4", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert TRAIN_MEMORY[0] <= d["memory"]["ratio"] <= TRAIN_MEMORY[1], d["memory"]


# The run path's files for a topology: by default for the smallest experiment (about 1 s of libtpu); the shipped
# decode, at a shorter prompt and fewer steps, takes 12-23 s of libtpu on 2 cores (35 s at its own sizes).
COMPILE_ONLY_RUNS = {
    "tp_mlp": ["experiments/tp_mlp.toml", "--dtype", "bf16"],
    "llama3_8b_decode": ["experiments/llama3_8b_decode.toml", "--sizes", "batch=8,prompt_len=64,steps=2"],
}


@needs_libtpu
@pytest.mark.parametrize("name", ["tp_mlp", pytest.param("llama3_8b_decode", marks=pytest.mark.slow)])
def test_run_compile_only_for_a_topology_writes_xla_beside_the_predictions(tmp_path, capsys, monkeypatch, name):
    monkeypatch.chdir(ROOT)
    argv = ["run", *COMPILE_ONLY_RUNS[name], "--compile-only", "--target", "v5e:2x4"]
    assert main([*argv, "--out", str(tmp_path), "--json", "--quiet"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["backend"] == "tpu" and r["emulated"] is False and r["devices"] == 8
    assert r["compiled_for"]["topology"] == "v5e:2x4" and r["hardware"]["name"] == "tpu-v5e"
    x = r["xla"]
    assert x["memory"]["argument_size_in_bytes"] > 0 and x["cost"]["flops"] > 0
    assert x["lab"]["step_time_s"] == r["step_time_estimated_s"] > 0
    assert x["lab"]["memory_per_device_bytes"] > 0
    saved = json.loads((Path(r["run_dir"]) / "report.json").read_text())
    assert saved["xla"] == x and saved["step_time_measured_s"] is None


@needs_libtpu
@pytest.mark.parametrize("name", ["ring_attention_context4", "moe_expert4", "pipeline_gpipe4"])
def test_the_parallel_kernels_audit_all_match_on_tpu_too(capsys, name):
    exp = str(ROOT / "experiments" / f"{name}.toml")
    assert main(["audit", exp, "--target", "v5e:2x4", "--dtype", "bf16", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["compiled_for"] == "v5e:2x4" and d["all_match"], d["entries"]
    assert d["entries"] and not d["unexpected"] and d["flops_compiled"] == pytest.approx(d["flops_predicted"])


TRAIN_STEPS = sorted(p.stem for p in (ROOT / "experiments").glob("train_*.toml"))


@needs_libtpu
@pytest.mark.slow  # 5-20 s of compiling each
@pytest.mark.parametrize("name", TRAIN_STEPS)
def test_every_train_step_audits_whole_for_a_v5e(capsys, name):
    """Issue 37's bar: every train_* experiment, cross-compiled for v5e:2x4 in bf16, compiles to what its estimate
    expects (train_cp_dp_tp through the reductions the TPU compiler combines over ctx x data, train_ep_dp_tp with
    the router's gradient the lab's expert layers reduce over model)."""
    exp = str(ROOT / "experiments" / f"{name}.toml")
    assert main(["audit", exp, "--target", "v5e:2x4", "--dtype", "bf16", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["all_match"] and not d["unexpected"], (d["entries"], d["unexpected"])


@needs_libtpu
@pytest.mark.slow  # 20 s of compiling; the splash FLOP count itself is tested on synthesized HLO (tests/test_hlo.py)
def test_splash_attention_cross_compiles_and_its_kernels_flops_match_the_estimate(capsys, tmp_path):
    """JAX's splash kernels declare no cost estimate: the audit counts them from their operands and block sizes.
    By hand, per device and layer: 4 sequences x 2 heads x 3 computed 128 x 128 block pairs (causal, 256 tokens)
    x 128 head dims, times 2 x (2 forward + 3 dq + 4 dk/dv matmuls) = 1.811939328e9 over the 2 layers."""
    from lab.compile.hlo import parse_module
    from lab.compile.hlo_dots import dots

    exp, hlo = str(ROOT / "experiments" / "attention_splash.toml"), tmp_path / "splash.hlo"
    assert main(["audit", exp, "--target", "v5e:2x4", "--dtype", "bf16", "--json", "--hlo", str(hlo)]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["all_match"] and not d["unexpected"] and d["flops_compiled"] == pytest.approx(d["flops_predicted"])
    splash = [x for x in dots(parse_module(hlo.read_text())) if x.name.startswith("splash_mha_")]
    assert len(splash) == 3  # forward, dq, dk/dv: one call each in the layers' loop
    assert sum(x.flops * x.times for x in splash) == 2 * 4 * 2 * 3 * 128 * 128 * 128 * 2 * (2 + 3 + 4)


@needs_libtpu
@pytest.mark.slow  # 15 s of compiling
def test_decode_with_splash_cross_compiles_and_audits(capsys, tmp_path):
    """decode_paged with attention = "splash": splash's forward kernel for a 128-token prompt (head_dim 128, 128 x 128
    blocks), the lab's paged kernel for each step; the audit holds both kernels' FLOPs to the inference estimate."""
    text = (ROOT / "experiments" / "decode_paged.toml").read_text()
    for old, new in (
        ('attention = "pallas"', 'attention = "splash"'),
        ("prompt_len = 16", "prompt_len = 128"),
        ("head_dim = 12", "head_dim = 128"),
        ("d_model = 56", "d_model = 512"),
        ("max_seq_len = 64", "max_seq_len = 256"),
        ("attention_block_q = 16", "attention_block_q = 128"),
        ("attention_block_k = 16", "attention_block_k = 128"),
    ):
        assert old in text, old
        text = text.replace(old, new)
    exp = tmp_path / "decode_splash.toml"
    exp.write_text(text)
    assert main(["audit", str(exp), "--target", "v5e:2x4", "--dtype", "bf16", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["all_match"] and not d["unexpected"] and d["flops_compiled"] == pytest.approx(d["flops_predicted"])


@needs_libtpu
def test_the_ledger_prices_the_collectives_inside_tpu_fusions(mid_v5e):
    # libtpu wraps all-gathers in async collective fusions and fuses some with their matmuls: the ledger must
    # still price every collective byte and every matmul FLOP the audit's parser finds in the HLO
    from lab.compile.hlo import collectives, parse_module
    from lab.compile.hlo_dots import dots
    from lab.core.hardware import get_chip
    from lab.report.ledger import predict_ops

    _, text = mid_v5e
    module = parse_module(text)
    assert "async_collective_fusion" in text  # the case this test is about
    ops = predict_ops(text, get_chip("tpu-v5e"), {"data": 2, "model": 4})
    assert sum(o.collective_bytes * o.times for o in ops) == pytest.approx(
        sum(c.bytes * c.times for c in collectives(module))
    )
    assert sum(o.flops * o.times for o in ops) == pytest.approx(sum(d.flops * d.times for d in dots(module)))


@needs_libtpu
def test_a_second_cross_compilation_does_not_read_the_persistent_cache(capsys):
    # conftest turns JAX's persistent cache on for the session; an executable for absent TPUs cannot be loaded
    # back, so a cached one would warn ("Error reading persistent compilation cache entry") on every later compile
    import warnings

    argv = ["audit", "tp_mlp", "--target", "v6e:2x4", "--dtype", "bf16", "--sizes", "B=256,D=512,F=1024", "--json"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert main(argv) == 0 and main(argv) == 0
    capsys.readouterr()


def test_a_program_the_tpu_compiler_finds_too_large_is_a_verdict_not_a_crash():
    """libtpu refuses a program larger than HBM at compile time; that is the compiler's "does not fit", with what
    it said the temporaries need, and a user's error (exit 2), not an internal one."""
    from types import SimpleNamespace

    from lab.compile.target import DoesNotFit, compile_for

    said = (
        "RESOURCE_EXHAUSTED: Ran out of memory on HBM, the total memory required for HLO temporaries (7.50T) "
        "exceeds available HBM (95.74G)."
    )

    def lower(*_):
        raise RuntimeError(said)

    built = SimpleNamespace(fn=SimpleNamespace(lower=lower), abstract=())
    with pytest.raises(DoesNotFit, match=r"need 7,680 GiB of the 95\.74 GiB of HBM") as exc:
        compile_for(built, parse_target("v5p:2x2x2"))
    assert exc.value.need_bytes == 7.5 * 2**40 and isinstance(exc.value, UserError)

    def other(*_):
        raise RuntimeError("RESOURCE_EXHAUSTED: something else")

    with pytest.raises(RuntimeError, match="something else"):  # anything else is not dressed up as a verdict
        compile_for(SimpleNamespace(fn=SimpleNamespace(lower=other), abstract=()), parse_target("v5p:2x2x2"))
