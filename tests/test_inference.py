"""The inference estimator against the scaling book's serving chapters (inference.md, applied-inference.md)."""

import json
import subprocess
import sys

import pytest

from lab.cli.main import main
from lab.core.errors import UserError
from lab.core.hardware import get_chip
from lab.core.models import get_model
from lab.predict.inference.estimate import InferConfig, estimate_inference

V5E, H100 = get_chip("v5e"), get_chip("h100")
L70 = get_model("llama3-70b")


def est(model=L70, chip=V5E, **kw):
    return estimate_inference(InferConfig(model=model, chip=chip, **kw))


def test_llama70b_int8_on_v5e_4x2_and_4x4():
    # applied-inference.md: batch 32, 8k context, int8 params and KV: about 112 GB in all; memory-bound step
    # (KV + params) / (8 x HBM BW) = 17 ms on a 4x2, half that on a 4x4. The book uses 160e3 B/token and 70e9.
    a = est(batch=32, context=8192, tp=8, weights="int8", kv="int8")
    assert a.total_bytes == pytest.approx(112e9, rel=0.02)
    assert a.kv_s + a.weights_s == pytest.approx(17e-3, rel=0.03)
    assert a.weights_s > a.compute_s  # int8 weights, bf16 FLOPs: compute-bound only past B = 120
    assert a.fits
    b = est(batch=32, context=8192, tp=16, weights="int8", kv="int8")
    assert b.kv_s + b.weights_s == pytest.approx((a.kv_s + a.weights_s) / 2, rel=1e-9)
    assert a.decode_step_s > a.kv_s + a.weights_s  # the collectives come on top


def test_tp_collectives_get_latency_bound_at_small_batch():
    # Two AllReduces of [B, D] per layer: at batch 1 every shard is far under the 45 kB threshold.
    small = est(batch=1, context=1024, tp=8)
    assert small.latency_bound_collectives and small.comm_s > 0
    # Latency-bound collectives make TP=2 slower than bandwidth alone predicts.
    tp1 = est(model=get_model("llama3-8b"), chip=H100, batch=1, context=1024, tp=1)
    tp2 = est(model=get_model("llama3-8b"), chip=H100, batch=1, context=1024, tp=2)
    assert tp2.latency_bound_collectives
    assert tp2.decode_step_s > 1.05 * tp1.decode_step_s / 2  # not the 2x that HBM bandwidth alone promises


def test_critical_batch_for_int8_weights_is_120():
    # Compute overtakes weight reads at B = 120 with int8 weights and bf16 FLOPs (240 for bf16 weights).
    def crossover(weights):
        b = 1
        while True:
            e = est(batch=b, context=16, tp=16, weights=weights)
            if e.compute_s > e.weights_s:
                return b
            b += 1

    assert crossover("int8") == pytest.approx(120, rel=0.05)
    assert crossover("bf16") == pytest.approx(240, rel=0.05)


def test_prefill_at_40_percent_mfu():
    # applied-inference.md: 2 x 70e9 x 8192 / (16 x 1.97e14 x 0.4) = 0.91 s.
    e = est(batch=1, context=8192, tp=16, prefill_len=8192, mfu=0.4)
    assert e.prefill_s == pytest.approx(0.91 * L70.active_params / 70e9, rel=0.01)
    assert e.to_dict()["time_to_first_token_s"] == e.prefill_s


def test_full_hbm_step_is_hbm_over_bandwidth():
    # applied-inference.md: at the largest batch that fits, a step streams a full chip of HBM: 16 GB / 8.2e11 = 19 ms.
    probe = est(batch=1, context=8192, tp=16, weights="int8", kv="int8")
    full = est(batch=probe.max_batch, context=8192, tp=16, weights="int8", kv="int8")
    assert full.fits and not est(batch=probe.max_batch + 1, context=8192, tp=16, weights="int8", kv="int8").fits
    assert full.kv_s + full.weights_s == pytest.approx(V5E.hbm_bytes / V5E.hbm_bandwidth, rel=0.05)


def test_gqa_kv_replication_and_batch_sharding():
    # 8 KV heads over tp=16: one sequence's cache is replicated twice; a batch of 2+ shards by sequence too.
    one = est(batch=1, context=8192, tp=16)
    two = est(batch=2, context=8192, tp=16)
    assert one.kv_bytes_per_chip == pytest.approx(L70.kv_bytes_per_token("bf16") * 8192 / 8)
    assert two.kv_bytes_per_chip == pytest.approx(one.kv_bytes_per_chip)


def test_quantisation_changes_bytes_not_flops():
    bf = est(batch=8, context=4096, tp=8)
    q = est(batch=8, context=4096, tp=8, weights="int4", kv="int8")
    assert q.compute_s == pytest.approx(bf.compute_s)
    assert q.weights_s == pytest.approx(bf.weights_s / 4) and q.kv_s == pytest.approx(bf.kv_s / 2)
    fast = est(batch=8, context=4096, tp=8, weights="int8", compute="int8")
    assert fast.compute_s == pytest.approx(bf.compute_s / 2)


def test_moe_reads_only_routed_experts_when_told_and_every_expert_by_default():
    mix = get_model("mixtral-8x7b")
    one = est(model=mix, chip=H100, batch=1, context=1024, tp=2, moe_weights="routed")
    many = est(model=mix, chip=H100, batch=64, context=1024, tp=2, moe_weights="routed")
    dense_bytes = mix.params * 2 / 2
    assert one.weights_s * H100.hbm_bandwidth < 0.5 * dense_bytes  # 2 of 8 experts per token
    every = est(model=mix, chip=H100, batch=1, context=1024, tp=2)
    assert every.weights_s * H100.hbm_bandwidth == pytest.approx(dense_bytes, rel=0.01)
    assert many.weights_s * H100.hbm_bandwidth == pytest.approx(dense_bytes, rel=0.01)
    ep = est(model=mix, chip=H100, batch=64, context=1024, tp=2, ep=4)
    assert ep.comm_s > many.comm_s


def test_does_not_fit_reports_instead_of_failing():
    e = est(batch=64, context=32768, tp=4)
    assert not e.fits and e.max_batch < 64 and e.min_chips > 4


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"batch": 0, "context": 10}, "--batch must be a positive integer"),
        ({"batch": 1, "context": 10, "tp": 3}, "--tp 3 does not divide 64 attention heads"),
        ({"batch": 3, "context": 10, "dp": 2}, "--batch 3 does not divide over --dp 2"),
        ({"batch": 1, "context": 10, "ep": 2}, "--ep 2 needs a mixture-of-experts model"),
        ({"batch": 1, "context": 10, "weights": "int2"}, "unknown dtype 'int2'"),
    ],
)
def test_bad_input(kw, match):
    with pytest.raises(UserError, match=match):
        est(**kw)


def test_cli_keys_and_warning(capsys):
    assert (
        main(
            [
                "infer",
                "estimate",
                "--model",
                "llama3-70b",
                "--hardware",
                "v5e",
                "--chips",
                "16",
                "--batch",
                "32",
                "--context",
                "8192",
                "--weights",
                "int8",
                "--kv",
                "int8",
                "--prefill-len",
                "2048",
                "--json",
            ]
        )
        == 0
    )
    d = json.loads(capsys.readouterr().out)
    for key in (
        "param_bytes",
        "kv_bytes",
        "total_bytes",
        "fits",
        "min_chips",
        "max_batch",
        "decode_step_s",
        "compute_s",
        "memory_s",
        "comm_s",
        "tokens_per_s",
        "tokens_per_s_per_chip",
        "prefill_s",
        "time_to_first_token_s",
        "cost_per_million_tokens_usd",
        "tp_max_degree",
        "latency_bound_collectives",
    ):
        assert key in d
    assert d["tp"] == 16 and d["cost_per_million_tokens_usd"] > 0
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "lab",
            "infer",
            "estimate",
            "--model",
            "llama3-8b",
            "--hardware",
            "h100",
            "--chips",
            "1",
            "--batch",
            "1",
            "--context",
            "100000",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0 and "warning: --context 100000 exceeds" in r.stderr


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--batch", "0", "--context", "10"], "--batch"),
        (["--batch", "1", "--context", "-5"], "--context"),
        (["--batch", "1", "--context", "10", "--weights", "int3"], "'int3' is not a storage dtype"),
        (["--batch", "1", "--context", "10", "--tp", "3"], "--tp x --dp x --ep must equal --chips 8"),
    ],
)
def test_cli_bad_input_exit_2(argv, needle):
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "lab",
            "infer",
            "estimate",
            "--model",
            "llama3-8b",
            "--hardware",
            "h100",
            "--chips",
            "8",
            *argv,
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 2 and needle in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_serving_commands(capsys, tmp_path):
    png = tmp_path / "sweep.png"
    assert (
        main(
            [
                "infer",
                "sweep",
                "--model",
                "llama3-70b",
                "--hardware",
                "v5e",
                "--weights",
                "int8",
                "--kv",
                "int8",
                "--context",
                "2048",
                "--chips",
                "8,16",
                "--png",
                str(png),
                "--json",
            ]
        )
        == 0
    )
    d = json.loads(capsys.readouterr().out)
    assert png.read_bytes()[:4] == b"\x89PNG" and d["png"] == str(png)
    assert main(["infer", "topology", "--model", "llama3-70b", "--hardware", "v5e", "--json"]) == 0
    rows = {r["weights"]: r["slice_chips"] for r in json.loads(capsys.readouterr().out)["rows"]}
    assert (rows["bf16"], rows["int8"], rows["int4"]) == (16, 8, 4)  # applied-inference.md: 4x4, 4x2, 2x2
    assert (
        main(
            [
                "infer",
                "disaggregate",
                "--model",
                "llama3-70b",
                "--hardware",
                "v5e",
                "--chips",
                "16",
                "--batch",
                "32",
                "--context",
                "8192",
                "--prefill-len",
                "8192",
                "--generate",
                "512",
                "--mfu",
                "0.4",
                "--ideal",  # the book's roofline
                "--json",
            ]
        )
        == 0
    )
    ratio = json.loads(capsys.readouterr().out)["prefill_servers_per_decode_server"]
    assert ratio == pytest.approx(3, rel=0.1)  # the book: P = 3G
    png2 = tmp_path / "mem.png"
    assert main(["study", "memory-tech", "--png", str(png2), "--json"]) == 0
    mem = json.loads(capsys.readouterr().out)
    assert png2.read_bytes()[:4] == b"\x89PNG" and mem["findings"]


def test_a_gpu_decode_step_pays_its_kernels_fixed_costs():
    import dataclasses

    from lab.core.hardware import get_chip
    from lab.core.models import get_model
    from lab.predict.inference.estimate import InferConfig, decode_step
    from lab.predict.inference.ops import decode_ops

    m = get_model("llama2-70b")
    cfg = InferConfig(model=m, chip=get_chip("a100-80gb"), batch=1, context=512, tp=8, achievable=True)
    d = decode_step(cfg)
    # 80 layers x (14 kernels x 0.9 us of graph gap + 8 small kernels x 1.5 us), microbenchmarks.md O2, O3
    assert d["overhead_s"] == pytest.approx(80 * (14 * 0.9e-6 + 8 * 1.5e-6))
    assert d["step_s"] == pytest.approx(d["kv_s"] + max(d["weights_s"], d["compute_s"]) + d["comm_s"] + d["overhead_s"])
    ops = decode_ops(cfg)
    assert sum(o["time_s"] for o in ops) == pytest.approx(d["step_s"])
    assert next(o for o in ops if o["name"] == "kernel launches")["time_s"] == d["overhead_s"]
    assert decode_step(dataclasses.replace(cfg, achievable=False))["overhead_s"] == 0.0  # the ideal roofline
    tpu = dataclasses.replace(cfg, chip=get_chip("tpu-v5p"))
    assert decode_step(tpu)["overhead_s"] == 100e-6  # no per-op figure for TPUs: the step's dispatch (O4)


def test_a_decode_steps_matmuls_run_at_the_tile_factor_of_their_rows():
    """The decode batch is every product's row count: 128 rows on a 128-wide tile reach half the GEMM ceiling
    (A100 bf16: 82.2%, microbenchmarks.md G9), as the training estimator's matmuls do, and each projection's K and N
    take their tile factors too (FLOP-weighted); the ideal roofline does not change, and the named ops still add up
    to the step."""
    import dataclasses

    from lab.predict.inference.estimate import decode_step
    from lab.predict.inference.ops import decode_ops

    m = get_model("llama2-70b")
    cfg = InferConfig(model=m, chip=get_chip("a100-80gb"), batch=128, context=512, tp=8, achievable=True)
    d = decode_step(cfg)
    flops = d["matmul_flops"] + d["attention_flops"]
    # llama2-70b over tp=8, (k, n) per chip: QKV (8192, (8192 + 2 x 1024) / 8), out (1024, 8192), gate and up
    # (8192, 3584) each, down (3584, 8192); weighted by k x n, their times add
    products = [(8192, 1280, 1), (1024, 8192, 1), (8192, 3584, 2), (3584, 8192, 1)]
    shape = sum(k * n * c for k, n, c in products) / sum((k + 128) * (n + 128) * c for k, n, c in products)
    assert shape == pytest.approx(0.9385, abs=5e-4)
    assert d["compute_s"] == pytest.approx(flops / (0.822 * 128 / 256 * shape * 312e12), rel=1e-9)
    ideal = decode_step(dataclasses.replace(cfg, achievable=False))
    assert ideal["compute_s"] == pytest.approx(flops / 312e12, rel=1e-9)
    assert sum(o["time_s"] for o in decode_ops(cfg)) == pytest.approx(d["step_s"])
    one = decode_step(dataclasses.replace(cfg, batch=1))  # one row: the weights bound it, as before
    assert one["compute_s"] < one["weights_s"]


def test_decode_weights_stream_at_the_skinny_gemm_share_of_each_gpus_own_copy_rate():
    """G16 (DeepGEMM M=64 on H800, HBM3 as H100's): 68% of HBM, which is 0.68 / 0.87 of H100's STREAM copy (H2);
    an A100 takes that share of its own copy rate (H1, 79%), an H200 of its 84% (H3); TPUs their copy rate (TPU7x's
    87%, T3 of microbenchmarks-added.md); the ideal roofline reads the weights at the full bandwidth."""
    import dataclasses

    from lab.predict.inference.estimate import decode_step

    m = get_model("llama2-70b")
    a100 = InferConfig(model=m, chip=get_chip("a100-80gb"), batch=1, context=512, tp=8, achievable=True)
    d = decode_step(a100)
    assert d["weights_s"] == pytest.approx(d["weight_bytes"] / (0.68 / 0.87 * 0.79 * 2.039e12), rel=1e-9)
    assert d["weights_s"] == pytest.approx(d["weight_bytes"] / (0.6175 * 2.039e12), rel=1e-3)  # 61.7% of HBM
    h100 = decode_step(dataclasses.replace(a100, chip=get_chip("h100")))
    assert h100["weights_s"] == pytest.approx(h100["weight_bytes"] / (0.68 * 3.35e12), rel=1e-9)
    h200 = decode_step(dataclasses.replace(a100, chip=get_chip("h200")))
    assert h200["weights_s"] == pytest.approx(h200["weight_bytes"] / (0.68 / 0.87 * 0.84 * 4.8e12), rel=1e-9)
    tpu = dataclasses.replace(a100, chip=get_chip("tpu-v5p"))
    t = decode_step(tpu)
    assert t["weights_s"] == pytest.approx(t["weight_bytes"] / (0.87 * tpu.chip.hbm_bandwidth), rel=1e-9)
    ideal = decode_step(dataclasses.replace(a100, achievable=False))
    assert ideal["weights_s"] == pytest.approx(ideal["weight_bytes"] / 2.039e12, rel=1e-9)


def test_an_fp16_kv_cache_is_stored_at_bf16s_width():
    # vLLM's default cache dtype on an fp16 model is fp16: two bytes an element, as bf16
    half = est(batch=8, context=4096, tp=8, kv="fp16")
    brain = est(batch=8, context=4096, tp=8, kv="bf16")
    assert half.kv_bytes_per_chip == brain.kv_bytes_per_chip > 0 and half.decode_step_s == brain.decode_step_s
    assert est(batch=8, context=4096, tp=8, kv="int8").kv_bytes_per_chip == pytest.approx(brain.kv_bytes_per_chip / 2)


def test_a_parallel_block_decodes_with_one_tensor_parallel_sum_a_layer():
    import dataclasses

    m = get_model("llama3-70b")
    kw = dict(chip=H100, batch=1, context=2048, tp=8, achievable=True)
    seq, par = est(model=m, **kw), est(model=dataclasses.replace(m, parallel_block=True), **kw)
    assert par.comm_s == pytest.approx(seq.comm_s / 2) and par.weights_s == seq.weights_s


def test_fp4_weights_stream_at_half_of_fp8s_bytes_and_fp4_matmuls_need_a_chip_that_has_them():
    b200 = get_chip("b200")
    fp4 = est(chip=b200, batch=1, context=1024, weights="fp4", compute="fp4", achievable=True)
    fp8 = est(chip=b200, batch=1, context=1024, weights="fp8", compute="fp8", fp8_scaling="static", achievable=True)
    assert fp4.weights_s == pytest.approx(fp8.weights_s / 2)
    # weight-only fp4 (bf16 matmuls) on a GPU: the 4-bit weight-only kernel's streaming rate, as int4
    w4 = est(chip=H100, batch=1, context=1024, weights="fp4", achievable=True)
    assert w4.weights_s == est(chip=H100, batch=1, context=1024, weights="int4", achievable=True).weights_s
    with pytest.raises(UserError, match="h100 has no fp4 peak in the catalog"):
        est(chip=H100, batch=1, context=1024, weights="fp4", compute="fp4")


def test_a_sliding_window_caps_what_a_decode_step_reads_and_holds():
    mistral = get_model("mistral-7b")  # every layer windowed at 4096
    kw = dict(model=mistral, chip=H100, batch=8, achievable=True)
    at_window, past = est(context=4096, **kw), est(context=32768, **kw)
    assert past.kv_s == pytest.approx(at_window.kv_s) and past.kv_bytes == pytest.approx(at_window.kv_bytes)
    # the same dims without the window read eight times the cache at 32k
    import dataclasses

    whole = est(context=32768, **(kw | {"model": dataclasses.replace(mistral, sliding_window=0)}))
    assert whole.kv_bytes == pytest.approx(8 * past.kv_bytes)
    assert whole.kv_s > 4 * past.kv_s


def test_the_estimate_says_which_experts_a_step_reads(capsys):
    """A mixture of experts' decode step names its assumption: every expert (the default) or the routed ones, whose
    expected count at batch 1 is the experts one token chooses; a dense model has no such line."""
    base = ["infer", "estimate", "--hardware", "h100", "--chips", "2", "--batch", "1", "--context", "2048"]
    assert main([*base, "--model", "mixtral-8x7b"]) == 0
    assert "experts read           all 8 of each MoE layer every step" in capsys.readouterr().out
    assert main([*base, "--model", "mixtral-8x7b", "--moe-weights", "routed"]) == 0
    assert "experts read           2 of 8 of each MoE layer on average" in capsys.readouterr().out
    assert main([*base, "--model", "llama3-8b"]) == 0
    assert "experts read" not in capsys.readouterr().out
