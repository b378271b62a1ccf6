"""The development set (public runs looked at while the model changed) and the measured pieces of the efficiency model.

The efficiency numbers are checked against the microbenchmark figures they restate (shared/reference/
microbenchmarks.md), computed here from the published TFLOP/s and GB/s, not read back from the code.
"""

import itertools
import json
import math

import pytest

from lab.cli.main import main
from lab.core.hardware import get_chip
from lab.core.models import get_model
from lab.predict import efficiency as eff
from lab.studies.public_runs import SOURCE_KEYS
from lab.studies.validate_public import RUNS, run_public_validation, split_runs


@pytest.fixture(scope="module")
def public():
    return run_public_validation()


def test_every_public_run_is_cited_and_either_predicted_or_counted_with_its_reason(public):
    runs = split_runs("development")  # the modules' runs and the sources moved here from the test split
    assert len({r.case_id for r in runs}) == len(runs) > len(RUNS)
    for row in public.rows:
        run = row.run
        assert run.source and run.grade in ("A", "B", "C") and run.measured > 0
        assert run.context_at in ("mean", "end") and run.kv_dtype in (None, "bf16", "fp16", "fp8", "int8", "int4")
        assert run.split == "development" and (run.source_name in SOURCE_KEYS.values() or run.source_key)
        if run.expressible is None:
            assert row.error is not None and row.predicted is not None, row.detail
        else:
            assert row.error is None and row.detail.startswith("not expressible: ")
    s = public.summary()
    assert s["runs"] == len(runs) and s["answered"] + s["not_expressible"] + s["refused"] == len(runs)
    groups = {r.run.group for r in public.rows}
    assert {"GPU training", "TPU training", "GPU serving", "TPU serving"} <= groups


def test_the_means_with_and_without_the_unexpressible_runs_and_per_source(public):
    """The per-run mean counts the answered runs; the mean with the unexpressible ones prices them anyway (their
    reason ignored); the per-source mean weighs each source once, whatever its row count."""
    s = public.summary()
    answered = [abs(r.error) for r in public.rows if r.error is not None]
    forced = [abs(r.forced_error) for r in public.rows if r.error is None and r.forced_error is not None]
    assert forced, "the eager generate rows price anyway"
    assert s["mean_abs_error"] == pytest.approx(sum(answered) / len(answered), rel=1e-12)
    assert s["mean_abs_error_with_unexpressible"] == pytest.approx(
        (sum(answered) + sum(forced)) / (len(answered) + len(forced)), rel=1e-12
    )
    by_source: dict[str, list[float]] = {}
    for r in public.rows:
        if r.error is not None:
            by_source.setdefault(r.run.source_name, []).append(abs(r.error))
    means = [sum(v) / len(v) for v in by_source.values()]
    assert s["per_source_mean_abs_error"] == pytest.approx(sum(means) / len(means), rel=1e-12)
    assert "per source" in public.headline() and "development" in public.headline()


def test_the_error_reads_as_a_time_whatever_the_source_measured(public):
    """Negative means optimistic in every row: a throughput or an MFU is inverted before the ratio."""
    for row in public.predicted:
        run = row.run
        if run.unit in ("s/step", "s/token", "s/prefill"):
            assert math.isclose(row.error, row.predicted / run.measured - 1, rel_tol=1e-12)
        else:
            assert math.isclose(row.error, run.measured / row.predicted - 1, rel_tol=1e-12)


def test_the_cli_reports_the_development_set_under_its_name(capsys):
    assert main(["validate", "--group", "development", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert set(data) == {"split", "rows", "classes", "sources", "summary"} and data["split"] == "development"
    assert data["summary"]["targets"]["mean_abs_error"] == 0.15
    assert main(["validate", "--group", "development"]) == 0
    text = capsys.readouterr().out
    assert text.startswith("Development set: published runs looked at while the model changed (in-sample")
    assert "never fitted" not in text


# ----- the measured pieces ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("chip", "dtype", "tflops", "peak"),
    [
        ("a100-80gb", "bf16", 256.5, 312),  # G9: sustained, 16384^3 after 10k warm-up (G1's best shape: 271.2)
        ("h100", "bf16", 755.0, 989),  # H200's MSMF, the same die and power (G2's best-shape burst: 794.5)
        ("h200", "bf16", 755.0, 989),  # MSMF (ml-engineering at 0359db8)
        ("h100", "fp8", 1377.3, 1979),  # G11: sustained at 16384^3 (G3's best shape: 1402.6)
        ("h200", "fp8", 1366.3, 1979),  # G13: sustained at 16384^3 (G4's best shape: 1453.4; MSMF 1354)
        ("b200", "bf16", 1439.0, 2250),  # MSMF (G6's burst: 1745)
        ("b200", "fp8", 2788.0, 4500),  # MSMF (G7's burst: 3432.5)
        ("tpu-v5e", "bf16", 181.8, 197),  # G26
    ],
)
def test_gemm_ceilings_are_the_measured_sustained_rates(chip, dtype, tflops, peak):
    assert eff.gemm_ceiling(get_chip(chip), dtype) == pytest.approx(tflops / peak, abs=0.001)


def test_fp8_is_priced_at_its_measured_gain_not_twice_bf16():
    h100 = get_chip("h100")
    n = 16384.0
    gain = eff.matmul_time(h100, n, n, n, "bf16") / eff.matmul_time(h100, n, n, n, "fp8")
    assert gain == pytest.approx(1377.3 / 755.0, rel=1e-3)  # G11 / MSMF: 1.82x, sustained both


def test_hbm_and_collective_fractions_are_the_measured_ones():
    assert eff.hbm_fraction(get_chip("h100")) == pytest.approx(2.90e12 / 3.35e12, abs=0.005)  # H2 copy
    assert eff.hbm_fraction(get_chip("a100-80gb")) == pytest.approx(1.61e12 / 2.039e12, abs=0.005)  # H1 copy
    h200 = get_chip("h200")
    assert eff.collective_fraction(h200, "all-gather", 8, "node") == pytest.approx(361.4 / 450, abs=0.01)  # C6
    assert eff.collective_fraction(h200, "all-reduce", 8, "node") == pytest.approx(480.0 / 450, abs=0.01)  # C6 NVLS
    assert eff.collective_fraction(h200, "all-reduce", 4, "node") < 1.0  # NVLS needs more GPUs (C7)
    assert eff.collective_fraction(h200, "all-gather", 64, "cross-node") == pytest.approx(0.72, abs=0.03)  # C14/C17


def test_a_skinny_fp8_gemm_with_dynamic_activation_scales_takes_its_measured_share_of_bf16s_time():
    """bf16 / fp8 TFLOP/s at M = 1, 16, 64, 128 rows on H100 (vLLM PRs #49363 and #17126, per-token dynamic
    activation scales): the fp8 GEMM takes their mean ratio of the bf16 GEMM's time; static scales take the byte
    ratio, 0.5; a TPU (nothing published) and fp8 weights computing in bf16 keep the plain byte ratio too."""
    bf16 = (2.870333, 46.541434, 182.588263, 352.560566, 2.513023, 39.110705, 160.586644, 307.854920)
    fp8 = (4.733311, 71.740831, 275.078859, 505.737658, 4.059088, 66.707845, 287.609822, 506.953838)
    measured = sum(b / f for b, f in zip(bf16, fp8, strict=True)) / len(bf16)
    h100, v5e, n = get_chip("h100"), get_chip("tpu-v5e"), 2e9  # bf16 bytes of the weights; fp8 holds half
    base = eff.decode_weights_time(h100, n, "bf16", "bf16")
    assert eff.decode_weights_time(h100, n / 2, "fp8", "fp8") / base == pytest.approx(measured, abs=0.005)
    assert eff.decode_weights_time(h100, n / 2, "fp8", "fp8", "static") / base == pytest.approx(0.5, rel=1e-12)
    assert eff.decode_weights_time(h100, n / 2, "fp8", "bf16") / base == pytest.approx(0.5, rel=1e-12)
    tpu = eff.decode_weights_time(v5e, n / 2, "fp8", "fp8") / eff.decode_weights_time(v5e, n, "bf16", "bf16")
    assert tpu == pytest.approx(0.5, rel=1e-12)


def test_attention_kernels_run_at_their_measured_rates():
    h100 = get_chip("h100")
    assert eff.attention_efficiency(h100, "fa2") == pytest.approx(327.9 / 989, abs=0.01)  # A13
    assert eff.attention_efficiency(get_chip("a100-80gb"), "fa2") == pytest.approx(179.5 / 312, abs=0.01)  # A13
    assert eff.attention_efficiency(get_chip("tpu-v5e"), "fa2") is None  # nothing published: the matmul model


def test_an_uneven_pipeline_split_with_embedding_and_loss_slots():
    """Llama 3.1 405B's 126 layers on 8 stages x 8 chunks: 128 slots with the embedding and the loss (the MLPerf
    405B configuration), 16 layers on the busiest stage; without the slots it is refused, naming them."""
    from lab.core.errors import UserError
    from lab.core.models import get_model
    from lab.predict.training.config import Layout, TrainConfig
    from lab.predict.training.estimate import estimate

    m, h100 = get_model("llama3-405b"), get_chip("h100")
    kw = dict(tp=8, pp=8, cp=2, dp=4, pp_schedule="interleaved", interleave=8, sequence_parallel=True)
    slots = Layout(**kw, pp_embedding_slots=True)
    assert slots.stage_layers(126) == 16 and Layout(pp=6).stage_layers(126) == 21
    cfg = TrainConfig(m, h100, slots, seq_len=8192, global_batch=1152, microbatch=1, dtype="fp8")
    est = estimate(cfg)
    # 16 layers run on the busiest stage: it does the work of 128/8 layers per microbatch, not 126/8
    per_layer = est.layer.fwd + est.layer.bwd + est.layer.recompute
    assert est.breakdown["compute_s"] == pytest.approx(cfg.microbatches * 16 * per_layer, rel=1e-9)
    with pytest.raises(UserError, match=r"does not divide 126 layers.*or --pp-embedding-slots"):
        estimate(TrainConfig(m, h100, Layout(**kw), seq_len=8192, global_batch=1152, microbatch=1))
    with pytest.raises(UserError, match=r"layers plus the embedding and loss slots \(128\)"):
        estimate(TrainConfig(m, h100, Layout(pp=6, dp=8, pp_embedding_slots=True), seq_len=8192, global_batch=48))


def test_a_per_token_figure_over_a_whole_generate_call_includes_its_prefill(public):
    """BLOOM's DeepSpeed-Inference figure is the benchmark script's 'Throughput per token including tokenize': whole
    generate() calls over the new tokens, so the prediction is the prefill (which yields the first token) plus
    generated - 1 decode steps at the mean context, over generated; the other serving rows are one decode step."""
    import dataclasses

    from lab.core.models import get_model
    from lab.predict.inference.estimate import InferConfig, estimate_inference

    flagged = {r.case_id for r in RUNS if r.per_token_includes_prefill}
    bloom = {"PS04", "PS05", "PS06", "PS07", "PS08", "PS09"}
    assert bloom <= flagged
    rows = {r.run.case_id: r for r in public.rows}
    for case in sorted(bloom):
        run = rows[case].run
        m = dataclasses.replace(get_model(run.model), **run.overrides)
        batch = int(run.layout["batch"])
        cfg = InferConfig(
            model=m,
            chip=get_chip("a100-80gb"),
            batch=batch,
            context=8 + 100 // 2,
            tp=8,
            prefill_len=8,
            achievable=True,
            tp_allreduce="nccl",  # DeepSpeed-Inference's all-reduce is torch.distributed's (AR7)
        )
        est = estimate_inference(cfg)
        assert est.prefill_s is not None and est.prefill_s > 0
        assert rows[case].predicted == pytest.approx((est.prefill_s + 99 * est.decode_step_s) / 100, rel=1e-12)
    ps01 = rows["PS01"]
    cfg = InferConfig(
        model=get_model("llama2-70b"),
        chip=get_chip("a100-80gb"),
        batch=1,
        context=512 + 25,
        tp=8,
        achievable=True,
        tp_allreduce="nccl",  # PyTorch's (AR7)
    )
    assert ps01.predicted == pytest.approx(estimate_inference(cfg).decode_step_s, rel=1e-12)


def test_a_figure_logged_at_the_end_of_generation_is_priced_at_the_full_cache(public):
    """SGLang's last logged decode throughput (1024 in / 512 out) is a step at 1536 cached tokens, turned into a step
    as batch / tokens/s; its fp8 rows keep a bf16 KV cache; its tensor parallelism is PyTorch's DTensor, whose sums are
    NCCL's."""
    from lab.core.models import get_model
    from lab.predict.inference.estimate import InferConfig, estimate_inference

    rows = {r.run.case_id: r for r in public.rows}
    for case, batch, tp, dtype, tokens in (("PS31", 32, 1, "bf16", 2799.0), ("PS35", 32, 4, "fp8", 6159.0)):
        row = rows[case]
        assert row.run.measured == pytest.approx(batch / tokens, rel=1e-12)
        cfg = InferConfig(
            model=get_model("llama3-8b"),
            chip=get_chip("h100"),
            batch=batch,
            context=1024 + 512,
            tp=tp,
            weights=dtype,
            kv="bf16",
            compute=dtype,
            achievable=True,
            tp_allreduce="nccl",
        )
        assert row.predicted == pytest.approx(estimate_inference(cfg).decode_step_s, rel=1e-12)


def test_each_serving_source_is_taken_whole_or_by_its_stated_rule():
    """LMDeploy's llama2-70b table is every (batch, in, out) of its grid; SGLang's bf16 and fp8 columns are every row
    of the teaser table; the vLLM DBRX rows are both TP degrees at every batch; HF's fp16 rows every batch."""
    by = {}
    for r in RUNS:
        if r.kind == "serving":
            by.setdefault(r.source, []).append(r)
    lmdeploy = next(v for k, v in by.items() if "lmdeploy" in k)
    grid = {(r.layout["batch"], r.layout["prompt"], r.layout["generated"]) for r in lmdeploy}
    ios = {(1, 128), (128, 128), (128, 2048), (2048, 128), (2048, 2048)}
    assert len(lmdeploy) == 20 and grid == {(b, i, o) for b in (1, 16, 32, 64) for i, o in ios}
    sglang = next(v for k, v in by.items() if "SGLang" in k)
    assert {(r.layout["batch"], r.layout["tp"], r.dtype) for r in sglang} == {
        (b, tp, d) for b, tp in ((1, 1), (32, 1), (32, 4)) for d in ("bf16", "fp8")
    }
    dbrx = next(v for k, v in by.items() if "DBRX" in k)
    assert {(r.layout["tp"], r.layout["batch"]) for r in dbrx} == {(tp, b) for tp in (4, 8) for b in (8, 16, 32, 64)}
    hf = next(v for k, v in by.items() if "optimum" in k)
    assert sorted(r.layout["batch"] for r in hf) == [1, 2, 4, 8, 16]
    assert all(r.expressible is None and r.elementwise == "eager" for r in hf)  # priced as eager generate


# ----- collectives by message size, TP overlap and fp8 casts ---------------------------------------------------

# nccl-tests all-reduce on 8 GPUs, bus bandwidth in GB/s (Azure AI-benchmarking-guide, microbenchmarks.md C1, C3)
AZURE_BUSBW = {
    "h100": {2**20: 43.70, 2**24: 234.45, 2**26: 361.78, 2**28: 423.38},
    "a100-80gb": {2**20: 36.22, 2**24: 109.22, 2**27: 174.18, 2**30: 228.10},
}


@pytest.mark.parametrize("chip", sorted(AZURE_BUSBW))
def test_an_eight_gpu_all_reduce_takes_the_time_the_size_sweep_measured(chip):
    """Between 1 MiB and 1 GiB the achievable time is the sweep's: bytes x 2(n-1)/n over its bus bandwidth."""
    c = get_chip(chip)
    for nbytes, busbw in AZURE_BUSBW[chip].items():
        measured = nbytes * 2 * 7 / 8 / (busbw * 1e9)
        assert eff.comm_time(c, "all-reduce", nbytes, 8) == pytest.approx(measured, rel=0.02), nbytes


def test_a_smaller_group_reads_the_sweep_where_its_pieces_are_as_large():
    """4 GPUs moving 8 MiB send the pieces 8 GPUs moving 16 MiB do: the bandwidth term takes the 16 MiB share of the
    plateau (234.45 / 478.87 on H100); a B200 (no nccl-tests sweep) and point-to-point sends keep the plateau."""
    h100 = get_chip("h100")
    nbytes = 8 * 2**20
    ring = nbytes * 2 * 3 / 4 / h100.link_bandwidth / eff.collective_fraction(h100, "all-reduce", 4, "node")
    assert eff.comm_time(h100, "all-reduce", nbytes, 4) == pytest.approx(ring / (234.45 / 478.87), rel=1e-6)
    assert eff.nvlink_ramp(get_chip("b200"), "all-reduce", nbytes, 4) == 1.0
    assert eff.nvlink_ramp(h100, "permute", nbytes, 4) == 1.0


@pytest.mark.parametrize("chip", ["a100-80gb", "h100", "h200"])
def test_a_larger_collective_never_takes_less_time(chip):
    c = get_chip(chip)
    for group in (2, 4, 8):
        times = [eff.comm_time(c, "all-gather", 2 ** (k / 4), group) for k in range(40, 140)]
        assert all(b >= a * (1 - 1e-12) for a, b in itertools.pairwise(times)), group  # flat where the sweep is


def _gpt3_tp4(**kw):
    from lab.core.models import get_model
    from lab.predict.training.config import Layout, TrainConfig

    lay = Layout(dp=2, tp=4, sequence_parallel=True)
    return TrainConfig(get_model("gpt3-175b"), get_chip("h100"), lay, seq_len=2048, global_batch=8, **kw)


def test_tp_comm_overlap_hides_each_collective_under_its_own_gemm():
    """Four sites (QKV, attention out, MLP up, MLP down), one collective each way: forward under the GEMM, backward
    under its input-gradient half; what a GEMM does not cover is exposed, the covered part costs 18.9% (GPU)."""
    from lab.predict.training.estimate import _compute_ops, layer_cost

    cfg = _gpt3_tp4(dtype="fp8", tp_comm_overlap=True)
    plain = layer_cost(_gpt3_tp4(dtype="fp8"))
    ops = {o[0]: o for o in _compute_ops(cfg)}
    per_call = plain.tp_comm / 8  # 4 AllGathers and 4 ReduceScatters of the same activations, selective recompute
    expected = 0.0
    for site in ("qkv", "out_proj", "mlp.up", "mlp.down"):
        for gemm in (ops[site][2], ops[site][3] / 2):
            expected += max(0.0, per_call - gemm) + 0.189 * min(per_call, gemm)
    assert layer_cost(cfg).tp_comm == pytest.approx(expected, rel=1e-9)
    assert layer_cost(cfg).tp_comm < 0.5 * plain.tp_comm


def test_tp_comm_overlap_needs_sequence_parallelism():
    from lab.core.errors import UserError
    from lab.core.models import get_model
    from lab.predict.training.config import Layout, TrainConfig
    from lab.predict.training.estimate import estimate

    cfg = TrainConfig(get_model("gpt3-175b"), get_chip("h100"), Layout(dp=2, tp=4), 2048, 8, tp_comm_overlap=True)
    with pytest.raises(UserError, match=r"--tp-comm-overlap .* --sequence-parallel"):
        estimate(cfg)
    assert all(r.tp_comm_overlap for r in RUNS if r.stack.startswith("NVIDIA NeMo"))


def test_fp8_training_pays_transformer_engines_casts():
    """GPT-3 175B at TP 4 (MHA, GeLU, d = 12288), per token on a TP rank: forward transposes of the QKV and MLP-up
    inputs (2 B x d each, the norms wrote them in fp8) and of the MLP-down input (2 B x 4d/4, the activation did),
    a cast and a transpose of the attention output (4 B x d/4); backward, the output gradients (3d/4 + d + 4d/4 + d)
    cast and transposed (4 B): 7d + 15d = 22 d bytes a token, each of the step's layer runs."""
    from lab.predict.training.estimate import _compute_ops, estimate, step_ops

    d, tokens = 12288, 2048
    cfg = _gpt3_tp4(dtype="fp8")
    ops = {o[0]: o for o in _compute_ops(cfg)}
    fwd_s, bwd_s = ops["fp8.casts"][2], ops["fp8.casts"][3]
    assert fwd_s == pytest.approx(eff.memory_time(cfg.chip, 7 * d * tokens), rel=1e-12)
    assert bwd_s == pytest.approx(eff.memory_time(cfg.chip, 15 * d * tokens), rel=1e-12)
    runs = cfg.microbatches * cfg.model.layers  # selective recomputation repeats no cast
    reported = next(r for r in step_ops(estimate(cfg)) if r["name"] == "fp8.casts")
    assert reported["bytes"] == pytest.approx(runs * 22 * d * tokens, rel=1e-12)
    assert "fp8.casts" not in {o[0] for o in _compute_ops(_gpt3_tp4())}


def test_across_nodes_the_nic_share_slows_the_bandwidth_term_not_the_latency():
    """A 16 KiB all-reduce over 16 H100s (two nodes) costs its latency, not latency / 0.125 (C14's share at 16 MiB and
    below is of the NIC's line rate); a 1 GiB one its bandwidth term at 70% of the NIC."""
    from lab.predict.collectives import collective_time

    h100 = get_chip("h100")
    small = collective_time("all-reduce", 16 * 2**10, (16,), h100, scope="cross-node")
    assert eff.comm_time(h100, "all-reduce", 16 * 2**10, 16, scope="cross-node") == pytest.approx(small.time_s)
    big = collective_time("all-reduce", 2**30, (16,), h100, scope="cross-node")
    got = eff.comm_time(h100, "all-reduce", 2**30, 16, scope="cross-node")
    assert got == pytest.approx(max(big.time_s, big.bandwidth_s / 0.70), rel=1e-9)


def test_the_step_ops_say_what_tp_overlap_hides():
    from lab.predict.training.estimate import estimate, step_ops

    for overlap, hidden in ((False, {None}), (True, {"gemm"})):
        ops = step_ops(estimate(_gpt3_tp4(dtype="fp8", tp_comm_overlap=overlap)))
        sp = [r for r in ops if r.get("role") == "tp" and r["name"].startswith("SP ") and "again" not in r["name"]]
        assert len(sp) == 2 and {r["hidden"] for r in sp} == hidden


def test_a_run_under_a_stated_load_is_priced_by_the_serving_simulator():
    """A loaded run's prediction is the simulated requests' mean (or median, where its source printed that) TTFT or
    TPOT, with the requests its source sent and closed-loop clients as stated."""
    import dataclasses

    from lab.core.serving import Lengths, poisson_requests, summarize
    from lab.predict.inference.estimate import InferConfig
    from lab.predict.inference.serve import pool_for, simulate
    from lab.studies.validate_public import predict

    base = next(r for r in split_runs("development") if r.case_id == "T202")  # TTFT, 8 clients, 150 requests, median
    assert base.layout["concurrency"] == 8 and base.layout["requests"] == 150 and base.statistic == "median"
    cfg = InferConfig(model=get_model("llama3-8b"), chip=get_chip("h100"), batch=1, context=22000, achievable=True)
    requests = poisson_requests(150, math.inf, Lengths(20000), Lengths(2000))
    s = summarize(simulate(cfg, requests, pool_for(cfg), concurrency=8))
    assert predict(base).predicted == pytest.approx(s["ttft_s"]["p50"], rel=1e-12)
    as_mean = dataclasses.replace(base, statistic="mean", unit="s/token")
    assert predict(as_mean).predicted == pytest.approx(s["tpot_s"]["mean"], rel=1e-12)
