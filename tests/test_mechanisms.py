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
from lab.predict.inference import InferConfig, decode_step, estimate_inference, prefill_time
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


def test_continuous_batching_carries_the_joining_requests_prefills_and_a_stated_overhead():
    """32 sequences each replaced after 256 tokens: every step carries 32 / 256 of one 512-token prefill."""
    cfg = InferConfig(get_model("llama3-8b"), get_chip("h100"), batch=32, context=768, achievable=True)
    cont = dataclasses.replace(cfg, prefill_len=512, generate=256, continuous=True)
    one = prefill_time(dataclasses.replace(cfg, batch=1, prefill_len=512))
    plain = estimate_inference(cfg).decode_step_s
    got = estimate_inference(cont)
    assert got.prefill_stall_s == pytest.approx(32 / 256 * one, rel=1e-12)
    assert got.decode_step_s == pytest.approx(plain + 32 / 256 * one, rel=1e-12)
    over = estimate_inference(dataclasses.replace(cfg, step_overhead_s=0.002)).decode_step_s
    assert over == pytest.approx(plain + 0.002, rel=1e-12)
    with pytest.raises(UserError, match=r"--continuous .* give --prefill-len and --generate"):
        estimate_inference(dataclasses.replace(cfg, continuous=True))
    with pytest.raises(UserError, match=r"--step-overhead must be seconds in \[0, 10\)"):
        estimate_inference(dataclasses.replace(cfg, step_overhead_s=-1.0))
