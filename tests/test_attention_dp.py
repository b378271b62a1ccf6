"""What one serving chip holds (lab/predict/inference/holdings.py): MLA's latent cache whole on every tensor-parallel
rank, data-parallel attention (SGLang's --enable-dp-attention), and the interval classes of runs served under load."""

import json

import pytest

from lab.core.errors import UserError
from lab.core.hardware import get_chip
from lab.core.models import get_model
from lab.predict.inference.estimate import InferConfig, estimate_inference
from lab.predict.inference.holdings import kv_shards, replicated_params, weight_bytes_per_chip
from lab.studies.public_runs import PublicRun
from lab.studies.validate_public import interval_class
from tests.cli_runner import run_cli

V3 = get_model("deepseek-v3")


def _est(model=V3, tp=8, batch=64, **kw):
    cfg = InferConfig(
        model=model, chip=get_chip("h200"), batch=batch, context=4096, tp=tp, weights="fp8", kv="bf16", **kw
    )
    return estimate_inference(cfg)


def test_an_mla_cache_is_whole_on_every_tensor_parallel_rank():
    tp, dpa = _est(), _est(attention_dp=True)
    whole = V3.kv_bytes(4096, "bf16") * 64  # every sequence's latent cache
    assert tp.kv_bytes_per_chip == pytest.approx(whole)  # one latent a token: no heads to split
    assert dpa.kv_bytes_per_chip == pytest.approx(whole / 8)  # each rank its own requests'
    assert tp.kv_s == pytest.approx(8 * dpa.kv_s)
    assert dpa.max_batch > 6 * tp.max_batch  # the room the duplicated cache took


def test_data_parallel_attention_holds_the_whole_attention_on_every_rank():
    attention = V3.attention_params_per_layer * V3.layers
    latent = V3.layers * V3.d_model * (V3.q_lora_rank + V3.kv_lora_rank + V3.rope_head_dim)
    assert replicated_params(V3) == latent  # the latent down-projections, ReplicatedLinear under TP
    assert replicated_params(V3, attention_dp=True) == attention
    extra = (attention - latent) * (1 - 1 / 8)  # fp8: a byte a weight
    assert weight_bytes_per_chip(V3, 8, 1, "fp8", True) - weight_bytes_per_chip(V3, 8, 1, "fp8") == pytest.approx(extra)
    assert _est(attention_dp=True).param_bytes_per_chip > _est().param_bytes_per_chip


def test_a_model_with_kv_heads_splits_its_cache_by_heads_either_way():
    llama = get_model("llama3-70b")  # 8 KV heads over 8 ranks, or 8 ranks of requests: the same bytes a chip
    assert kv_shards(llama, 8, 64) == kv_shards(llama, 8, 64, attention_dp=True) == 8
    assert replicated_params(llama) == 0.0
    tp, dpa = _est(llama), _est(llama, attention_dp=True)
    assert tp.kv_bytes_per_chip == pytest.approx(dpa.kv_bytes_per_chip)


def test_data_parallel_attention_needs_a_tensor_parallel_group():
    with pytest.raises(UserError, match="--tp 2 or more"):
        _est(tp=1, attention_dp=True)


def test_the_flag_prices_and_reports_it():
    base = ["infer", "estimate", "--model", "deepseek-v3", "--hardware", "h200", "--chips", "8", "--tp", "8"]
    base += ["--batch", "64", "--context", "4096", "--weights", "fp8", "--achievable", "--json"]
    tp, dpa = (json.loads(run_cli(argv)[1]) for argv in (base, [*base, "--attention-dp"]))
    assert (tp["attention_dp"], dpa["attention_dp"]) == (False, True)
    assert dpa["kv_s"] < tp["kv_s"] and dpa["param_bytes_per_chip"] > tp["param_bytes_per_chip"]
    code, _, err = run_cli(
        [*base[:6], "--chips", "1", "--tp", "1", "--batch", "1", "--context", "64", "--attention-dp"]
    )
    assert code == 2 and "--tp 2 or more" in err and len(err.strip().splitlines()) == 1


def _run(**kw) -> PublicRun:
    base = dict(case_id="X1", kind="serving", chip="h200", chips=8, model="deepseek-v3", seq_len=4000)
    base |= dict(global_batch=64, microbatch=64, remat="none", measured=0.05, unit="s/token", source="s", grade="B")
    base |= dict(dtype="fp8", stack="SGLang")
    return PublicRun(**(base | kw))


def test_a_run_served_under_load_takes_the_load_simulators_class():
    step = _run(layout={"tp": 8, "batch": 64, "prompt": 3200, "generated": 800})
    load = _run(layout={"tp": 8, "batch": 64, "prompt": 3200, "generated": 800, "concurrency": 64})
    first = _run(layout=dict(load.layout), unit="s/prefill")
    assert [interval_class(r) for r in (step, load, first)] == [
        "GPU serving",
        "GPU serving under load",
        "GPU serving under load, first token",
    ]


# ----- a fused MoE kernel's fixed cost (efficiency.FUSED_MOE_FIXED_S) -------------------------------------------------

# microbenchmarks-added.md M4 (vLLM fused_moe, B200, 128 experts of 9.44 MB bf16, top-8) and M5 (SGLang fused_moe,
# H200, 128 experts of 2.36 MB fp8 at TP 8, top-8): microseconds of one MoE layer at B tokens
FUSED_MOE = {
    ("b200", 8e12, 9.44e6): ((1, 39.6), (2, 51.9), (4, 73.2)),
    ("h200", 4.8e12, 2.36e6): ((1, 31.7), (2, 36.6), (4, 49.7), (8, 66.9), (16, 92.4), (32, 125.0)),
}


@pytest.mark.parametrize(("chip", "bandwidth", "expert_bytes"), list(FUSED_MOE))
def test_a_fused_moe_layer_is_its_fixed_cost_and_its_touched_experts_bytes(chip, bandwidth, expert_bytes):
    from lab.predict import efficiency as eff

    hw = get_chip(chip)
    for tokens, us in FUSED_MOE[chip, bandwidth, expert_bytes]:
        touched = 128 * (1 - (1 - 8 / 128) ** tokens)  # the distinct experts B tokens route to, top-8 of 128
        t = eff.decode_kernel_overhead(hw, 0, 1) + touched * expert_bytes / (eff.decode_weight_fraction(hw) * bandwidth)
        assert t * 1e6 == pytest.approx(us, rel=0.15), (chip, tokens)  # tolerance set before comparing


def test_a_routed_moe_step_pays_the_fixed_cost_per_moe_layer_and_the_dense_einsum_does_not():
    from lab.predict.inference.estimate import decode_step

    mixtral = get_model("mixtral-8x7b")

    def overhead(chip: str, moe_weights: str) -> float:
        cfg = InferConfig(mixtral, get_chip(chip), 1, 1024, achievable=True, moe_weights=moe_weights)
        return float(decode_step(cfg)["overhead_s"])

    dense_fixed = mixtral.layers * (14 * 0.9e-6 + 8 * 1.5e-6)  # O2, O3: graph gaps and small kernels a layer
    assert overhead("h100", "routed") == pytest.approx(dense_fixed + mixtral.moe_layers * 28e-6)  # M4-M5
    assert overhead("a100-80gb", "routed") == pytest.approx(dense_fixed + mixtral.moe_layers * 50e-6)  # M3
    assert overhead("h100", "all") == pytest.approx(dense_fixed)  # the einsum over every expert: no fused kernel
    assert overhead("tpu-v5p", "routed") == pytest.approx(100e-6)  # a TPU step's dispatch (O4), nothing per layer
