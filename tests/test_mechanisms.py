"""The mechanisms behind the estimators' held-out error, each priced from a cited measurement of the piece (the rows of
shared/reference/microbenchmarks.md and docs/reference/microbenchmarks-added.md), the expected values computed here from
those figures, not read back from the code."""

import dataclasses
import math

import pytest

from lab.core.errors import UserError
from lab.core.hardware import get_chip
from lab.core.models import get_model
from lab.predict import efficiency as eff
from lab.predict.inference.estimate import InferConfig, decode_step, estimate_inference
from lab.predict.placement import placement

# ----- attention by the sequence it sees (A4) ---------------------------------------------------------------------


def _loglin(x, x0, y0, x1, y1):
    x = min(max(x, x0), x1)
    return y0 + (y1 - y0) * math.log(x / x0) / math.log(x1 / x0)


@pytest.mark.parametrize(("kernel", "lo", "hi"), [("fa3", 292.0, 616.0), ("fa2", 191.0, 335.0)])
def test_a_fused_attention_kernel_runs_faster_on_a_longer_sequence(kernel, lo, hi):
    h100 = get_chip("h100")
    at_8k = eff.attention_efficiency(h100, kernel)
    assert eff.attention_efficiency(h100, kernel, 8192) == pytest.approx(at_8k)
    ref = _loglin(8192, 512, lo, 16384, hi)
    for tokens in (512, 2048, 4096, 16384, 131072):
        want = at_8k * _loglin(tokens, 512, lo, 16384, hi) / ref
        assert eff.attention_efficiency(h100, kernel, tokens) == pytest.approx(want, rel=1e-9), tokens
    assert eff.attention_efficiency(h100, kernel, 131072) == eff.attention_efficiency(h100, kernel, 16384)
    assert eff.attention_efficiency(get_chip("tpu-v5e"), kernel, 2048) is None


# ----- the inference cards (D1-D12) --------------------------------------------------------------------------------


def test_the_inference_cards_are_priced_at_their_measured_gemm_rates():
    for chip, tflops, peak in (("l4", 70.9, 121), ("l40s", 269.2, 362), ("a10g", 69.5, 125), ("v100", 94.8, 125)):
        c = get_chip(chip)
        assert c.flops("bf16") == peak * 1e12
        assert eff.gemm_ceiling(c, "bf16") == pytest.approx(tflops / peak, abs=0.002), chip
    assert eff.family(get_chip("a10")) == "a10" and eff.family(get_chip("a100-80gb")) == "a100"
    assert eff.hbm_fraction(get_chip("v100")) == pytest.approx(766 / 900, abs=0.005)  # D10
    with pytest.raises(UserError, match="no fp8 peak"):
        get_chip("v100").flops("fp8")


# ----- one placement rule -------------------------------------------------------------------------------------------


def test_inference_prices_a_tensor_parallel_group_beyond_a_pod_over_the_slow_link():
    """A TP group larger than its TPU pod (here a 4-chip pod) crosses slices over DCN, as training prices it."""
    small_pod = dataclasses.replace(get_chip("tpu-v5e"), name="v5e-pod4", pod_shape=(2, 2), aliases=())
    inside = InferConfig(get_model("llama2-7b"), small_pod, batch=8, context=1024, tp=4, achievable=True)
    across = dataclasses.replace(inside, tp=8)
    assert placement(small_pod, 4, 1) == {"scope": "node"}
    assert placement(small_pod, 8, 1) == {"scope": "cross-node", "members_per_node": 4}
    act = 8 * 4096 * 2.0
    want = eff.comm_time(small_pod, "all-reduce", act, 8, scope="cross-node", members_per_node=4)
    assert decode_step(across)["comm_s"] == pytest.approx(2 * 32 * want, rel=1e-9)
    ici = eff.comm_time(small_pod, "all-reduce", act, 4)
    assert decode_step(inside)["comm_s"] == pytest.approx(2 * 32 * ici, rel=1e-9)
    assert want > 2 * eff.comm_time(get_chip("tpu-v5e"), "all-reduce", act, 8)  # DCN, not ICI


# ----- MoE weight streaming (M1, M2) --------------------------------------------------------------------------------


def test_a_moe_decode_streams_every_expert_by_default_and_the_routed_ones_when_told():
    m = get_model("mixtral-8x7b")
    base = InferConfig(m, get_chip("h100"), batch=1, context=1024, tp=2, achievable=True)
    routed = dataclasses.replace(base, moe_weights="routed")
    dense = m.params - m.expert_params_total
    per_chip_all = (dense + m.expert_params_total) / 2 * 2.0
    per_chip_routed = (dense + m.expert_params_total * (m.experts_per_token / m.experts)) / 2 * 2.0
    assert decode_step(base)["weight_bytes"] == pytest.approx(per_chip_all, rel=1e-12)
    assert decode_step(routed)["weight_bytes"] == pytest.approx(per_chip_routed, rel=1e-12)
    assert estimate_inference(base).to_dict()["moe_weights"] == "all"
    with pytest.raises(UserError, match=r"--moe-weights 'some' is not one of all, routed"):
        estimate_inference(dataclasses.replace(base, moe_weights="some"))


# ----- weight-only quantised decode (Q1, Q6) ------------------------------------------------------------------------


@pytest.mark.parametrize("chip", ["a100-80gb", "h100"])
def test_int4_weights_stream_faster_than_int8_at_their_measured_rates(chip):
    """Q6 (H100, M = 1): bf16 2.30, W8A16 1.73 and W4A16 1.25 TB/s; int4 holds half int8's bytes, so at batch 1 it takes
    (0.5 / 1.25) / (1 / 1.73) of int8's weight time, 1.44x faster, not the same (a 128-row compute floor did that)."""
    cfg = InferConfig(get_model("llama3-8b"), get_chip(chip), batch=1, context=1024, achievable=True)
    w8 = decode_step(dataclasses.replace(cfg, weights="int8"))
    w4 = decode_step(dataclasses.replace(cfg, weights="int4"))
    assert w8["weights_s"] / w4["weights_s"] == pytest.approx((1 / 1.73) / (0.5 / 1.25), rel=1e-9)
    assert w4["weights_s"] > w4["compute_s"] and w8["weights_s"] > w8["compute_s"]  # weight-bound: the step shows it
    assert w8["step_s"] / w4["step_s"] > 1.3
    bf16 = decode_step(cfg)
    assert bf16["weights_s"] / w8["weights_s"] == pytest.approx(2 * 1.73 / 2.30, rel=1e-9)


# ----- TPUs stream decode weights at their copy rate (T3) -----------------------------------------------------------


def test_a_tpu_decode_streams_weights_at_the_measured_tpu_copy_rate():
    v5e = get_chip("tpu-v5e")
    cfg = InferConfig(get_model("llama2-7b"), v5e, batch=1, context=512, tp=4, achievable=True)
    d = decode_step(cfg)
    assert d["weights_s"] == pytest.approx(d["weight_bytes"] / (0.87 * v5e.hbm_bandwidth), rel=1e-12)  # T3: 87%


# ----- serving under load (S1-S8) ---------------------------------------------------------------------------------


def test_a_stated_step_overhead_adds_to_every_decode_step():
    """A serving stack's host work per step (S1-S5), stated: 2 ms on every decode step, nothing else moves.
    Continuous batching itself is priced by the scheduler (tests/test_serving_load.py), not here."""
    cfg = InferConfig(get_model("llama3-8b"), get_chip("h100"), batch=32, context=768, achievable=True)
    plain = estimate_inference(cfg).decode_step_s
    over = estimate_inference(dataclasses.replace(cfg, step_overhead_s=0.002)).decode_step_s
    assert over == pytest.approx(plain + 0.002, rel=1e-12)
    with pytest.raises(UserError, match=r"--step-overhead must be seconds in \[0, 10\)"):
        estimate_inference(dataclasses.replace(cfg, step_overhead_s=-1.0))


def test_infer_estimate_continuous_names_infer_serve_in_one_line():
    from cli_runner import run_cli

    code, out, err = run_cli(["infer", "estimate", "--model", "llama3-8b", "--hardware", "h100", "--continuous"])
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1 and "infer serve --concurrency" in err


# ----- the scale-out network a cluster states (N1-N13) --------------------------------------------------------------


def test_a_hardware_file_states_its_nics_and_fabric_and_the_estimate_follows(tmp_path):
    """An EFA cluster of 4 x 100 Gb/s per 8 A100s (AWS p4d, N3): 6.25 GB/s per GPU and EFA's step latency across nodes,
    where the catalog's DGX A100 has 8 x 200 Gb/s HDR (25 GB/s) and InfiniBand's."""
    from lab.core.hardware import FABRIC_STEP_LATENCY, Catalog, load_hardware_file, scaleout_step_latency

    f = tmp_path / "p4d.toml"
    f.write_text('name = "a100-p4d"\nbase = "a100-40gb"\nnics_per_node = 4\nnic_bandwidth = 1.25e10\nfabric = "efa"\n')
    cat = Catalog()
    (p4d,) = load_hardware_file(f, cat)
    assert p4d.scaleout_bandwidth == pytest.approx(4 * 1.25e10 / 8)
    assert scaleout_step_latency(p4d) == FABRIC_STEP_LATENCY["efa"] == 25e-6
    dgx = get_chip("a100-40gb")
    assert dgx.scaleout_bandwidth == pytest.approx(8 * 2.5e10 / 8) and scaleout_step_latency(dgx) == 10e-6
    slow = eff.comm_time(p4d, "all-reduce", 2**30, 64, scope="cross-node", members_per_node=8)
    fast = eff.comm_time(dgx, "all-reduce", 2**30, 64, scope="cross-node", members_per_node=8)
    assert slow / fast == pytest.approx(4.0, rel=0.02)  # a quarter of the NIC rate, bandwidth-bound at 1 GiB


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ("nics_per_node = -8\nnic_bandwidth = 5e10\n", r"nics_per_node = -8 must be a positive integer"),
        ('base = "h100-pcie"\nnics_per_node = 8\n', r"give nics_per_node and nic_bandwidth together"),
        ('fabric = "ethernet"\n', r"fabric 'ethernet' is not one of infiniband, roce, efa, tcpx, dcn"),
        ('fabric = "efa"\nscaleout_latency_s = 1e-5\n', r"fabric 'efa' sets the step latency .* not both"),
        ("nics_per_node = 8\nnic_bandwidth = 5e10\nscaleout_bandwidth = 1e10\n", r"sets scaleout_bandwidth; give"),
        ("nics_per_node = 8\nnic_bandwidth = 0.5\n", r"nic_bandwidth = 0.5 is outside the plausible"),
    ],
)
def test_a_bad_network_description_is_refused_by_name(tmp_path, body, message):
    from lab.core.hardware import load_hardware_file

    f = tmp_path / "bad.toml"
    f.write_text('name = "x"\n' + (body if body.startswith("base") else 'base = "h100"\n' + body))
    with pytest.raises(UserError, match=message):
        load_hardware_file(f)


# ----- data-parallel and FSDP traffic by the overlap schedule (P1-P6) ----------------------------------------------


def _job(**kw):
    from lab.predict.training.config import Layout, TrainConfig

    lay = kw.pop("layout", Layout(dp=64))
    return TrainConfig(get_model("llama3-8b"), get_chip("h100"), lay, seq_len=4096, global_batch=64, **kw)


def test_the_gradient_reduction_leaves_its_last_bucket_exposed_or_all_of_it_without_overlap():
    from lab.predict.training.estimate import estimate, layer_cost, step_terms
    from lab.predict.training.step import prices, role_comms

    cfg = _job()
    lt, _, _ = step_terms(cfg)
    lc = layer_cost(cfg)
    (grads,) = [c for c in role_comms(cfg, "dp") if c.role == "dp"]
    bucket = dataclasses.replace(grads, bytes=25 * 2**20)
    assert lt.dp_tail == pytest.approx(prices(cfg.chip, cfg.layout, (bucket,))[0], rel=1e-12)
    backward = lt.layers * (lc.bwd + lc.recompute)
    rest = lt.dp - lt.dp_tail
    hidden = rest - backward + 0.189 * backward if rest > backward else 0.189 * rest
    assert estimate(cfg).breakdown["comm_dp_s"] == pytest.approx(lt.dp_tail + hidden + lt.loss, rel=1e-9)
    off = estimate(dataclasses.replace(cfg, dp_overlap=False)).breakdown["comm_dp_s"]
    assert off == pytest.approx(lt.dp + lt.loss, rel=1e-9)


def test_zero_over_a_node_keeps_more_state_and_gathers_the_weights_inside_it():
    from lab.predict.training.config import Layout
    from lab.predict.training.estimate import estimate

    whole = estimate(_job(layout=Layout(dp=64, zero=1)))
    node = estimate(_job(layout=Layout(dp=64, zero=1, zero_shard=8)))
    assert node.memory.optimizer == pytest.approx(whole.memory.optimizer * 64 / 8, rel=1e-9)
    assert whole.breakdown["dp_reduction_s"] != node.breakdown["dp_reduction_s"]
    with pytest.raises(UserError, match=r"--zero-shard 7 must divide --dp 64"):
        estimate(_job(layout=Layout(dp=64, zero=1, zero_shard=7)))
    # with context parallelism the state spans dp x cp ranks, so a shard may be any divisor of the product
    assert estimate(_job(layout=Layout(dp=16, cp=4, zero=1, zero_shard=8))).memory.optimizer > 0
    with pytest.raises(UserError, match=r"--zero-shard 3 must divide --dp 16 x --cp 4 = 64"):
        estimate(_job(layout=Layout(dp=16, cp=4, zero=1, zero_shard=3)))
    with pytest.raises(UserError, match=r"--zero-shard shards ZeRO-1 or -2's state"):
        estimate(_job(layout=Layout(dp=64, zero_shard=8)))


def test_fsdp_pays_the_first_gather_and_the_last_scatter_of_each_microbatch():
    from lab.predict.training.config import Layout
    from lab.predict.training.estimate import layer_cost, step_terms

    cfg = _job(layout=Layout(fsdp=64))
    _, mt, ft = step_terms(cfg)
    lc = layer_cost(cfg)
    layers = cfg.model.layers
    per_layer = sum(eff.overlapped(0.189, c, t) for c, t in ((ft.fwd, lc.fwd), (ft.bwd, lc.bwd + lc.recompute)))
    ends = ft.fwd + ft.scatter
    want = layers * per_layer + ends + (eff.overlapped(0.189, ft.rest, lc.logits) if ft.rest else 0.0)
    from lab.predict.training.estimate import estimate

    got = estimate(cfg).breakdown["comm_fsdp_s"]
    assert got == pytest.approx(mt.n_mb * want, rel=1e-9) and ft.scatter > 0 and ft.fwd > 0


def test_the_planner_prices_zero_layouts_as_the_estimator_does():
    from lab.predict.planner.layouts import plan
    from lab.predict.training.estimate import estimate

    result = plan(get_model("llama3-8b"), get_chip("h100"), 64, 64 * 4096, 4096, top=6)
    for est in result.top:
        assert est.step_time_s == estimate(est.config).step_time_s


# ----- a calibrated host: the lab's Transformer step's op factors (lab/run/calibrate_step.py) -----------------------


def test_the_step_calibration_takes_measured_over_estimated_per_kind_of_op():
    from lab.run.calibrate_step import factors

    report = {
        "estimated_ops": [
            {"name": "mlp/up", "kind": "matmul", "estimated_s": 0.2, "measured_s": 0.3},
            {"name": "logits", "kind": "matmul", "estimated_s": 0.1, "measured_s": 0.3},
            {"name": "attention/scores", "kind": "attention", "estimated_s": 0.05, "measured_s": 0.25},
            {"name": "norm", "kind": "elementwise", "estimated_s": 0.01, "measured_s": 0.04},
            {"name": "FSDP: weights", "kind": "all-gather", "estimated_s": 0.02, "measured_s": 0.06},
            {"name": "unmatched", "kind": "matmul", "estimated_s": 0.5, "measured_s": None},
        ]
    }
    got = factors(report)["op_factor"]
    assert got == pytest.approx({"matmul": 0.6 / 0.3, "attention": 5.0, "elementwise": 4.0, "collective": 3.0})


def test_a_calibrated_host_prices_each_kind_of_op_at_its_factor():
    from lab.predict.training.config import Layout, TrainConfig
    from lab.predict.training.estimate import _compute_ops, _logits_time

    base = get_chip("cpu")
    factored = dataclasses.replace(base, calibration={"op_factor": {"matmul": 2.0, "attention": 5.0}})
    m = dataclasses.replace(
        get_model("llama3-8b"), layers=2, d_model=256, d_ff=1024, heads=8, kv_heads=4, head_dim=32, vocab=2048
    )
    cfg = TrainConfig(m, base, Layout(fsdp=8), seq_len=256, global_batch=32, flash_attention=False)
    plain = {o[0]: o for o in _compute_ops(cfg)}
    scaled = {o[0]: o for o in _compute_ops(dataclasses.replace(cfg, chip=factored))}
    for name, (_, kind, fwd, bwd, *_) in plain.items():
        want = {"matmul": 2.0, "attention": 5.0}.get(kind, 1.0)
        assert scaled[name][2] == pytest.approx(fwd * want) and scaled[name][3] == pytest.approx(bwd * want), name
    assert _logits_time(dataclasses.replace(cfg, chip=factored)) > 1.9 * _logits_time(cfg)
    assert eff.host_factor(get_chip("h100"), "matmul") == 1.0  # an accelerator is never scaled


@pytest.mark.slow
def test_the_reference_step_runs_and_yields_a_factor_per_kind(tmp_path):
    """The reference program of calibrate_step runs on the emulated devices against the placeholder spec; every kind
    of op is measured (the factors, whatever this host's speed, are positive and finite)."""
    import json

    from lab.core.hardware import get_chip
    from lab.run.calibrate_step import measure_step
    from lab.run.environment import ensure_devices

    ensure_devices(8)
    spec = tmp_path / "cpu.json"
    spec.write_text(json.dumps(get_chip("cpu").fields()))
    found = measure_step(spec, 8, quick=True)
    assert set(found["op_factor"]) == {"matmul", "attention", "elementwise", "collective"}
    assert all(0 < v < 1e4 for v in found["op_factor"].values())
    assert found["op_factor_step"]["measured_s"] > 0
