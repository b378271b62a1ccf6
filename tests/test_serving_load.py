"""Serving under load: the continuous-batching scheduler and its paged pool (lab.core.serving), the simulator that
prices its steps (lab.predict.inference.serve) and ``shardlab infer serve``."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import numpy as np
import pytest
from cli_runner import run_cli

from lab.core.errors import UserError
from lab.core.hardware import get_chip
from lab.core.models import get_model
from lab.core.serving import (
    Lengths,
    PoolConfig,
    Request,
    Scheduler,
    Seq,
    Step,
    Work,
    drive,
    load_trace,
    percentiles,
    poisson_requests,
    summarize,
)
from lab.predict.inference.estimate import InferConfig, decode_step
from lab.predict.inference.serve import Slo, StepPricer, pool_for, simulate

STEP_S = 0.01


def constant(plan):
    """A runner whose every step takes STEP_S: the latencies are then counts of steps."""
    return STEP_S, None


def _served(requests, pool, replicas=1, concurrency=None, run=constant):
    return drive(requests, pool, run, replicas=replicas, concurrency=concurrency)


# ----- the scheduler ------------------------------------------------------------------------------------------------


def test_one_request_takes_one_step_to_its_first_token_and_one_per_later_token():
    s = summarize(_served([Request(0, 0.0, 16, 5)], PoolConfig(pages=8, page_size=4, token_budget=64)))
    assert s["ttft_s"]["p50"] == pytest.approx(STEP_S)
    assert s["tpot_s"]["p50"] == pytest.approx(STEP_S)
    assert s["e2e_s"]["p50"] == pytest.approx(5 * STEP_S)
    assert s["steps"] == 5
    # 16 prompt tokens and 4 decoded ones (the last token sampled is never fed back): 5 pages of 4 at the end
    assert s["kv_pool_peak_fraction"] == pytest.approx(5 / 8)


def test_a_prompt_longer_than_the_budget_is_prefilled_in_chunks():
    sched = Scheduler(PoolConfig(pages=64, page_size=4, token_budget=32))
    sched.add(Request(0, 0.0, 100, 3))
    chunks = []
    while True:
        step = sched.schedule()
        (w,) = step.work
        chunks.append((w.start, w.count, w.samples))
        sched.complete(step, 0.0)
        if w.samples:
            break
    assert chunks == [(0, 32, False), (32, 32, False), (64, 32, False), (96, 4, True)]
    assert len(sched.running[0].pages) == 25  # 100 tokens in pages of 4


def test_decodes_go_first_and_a_joining_prompt_takes_what_is_left_of_the_budget():
    sched = Scheduler(PoolConfig(pages=64, page_size=4, token_budget=10))
    sched.add(Request(0, 0.0, 3, 5))
    sched.complete(sched.schedule(), 0.0)  # request 0 prefilled, now decoding
    sched.add(Request(1, 0.0, 30, 5))
    step = sched.schedule()
    assert [(w.seq.req.rid, w.start, w.count) for w in step.work] == [(0, 3, 1), (1, 0, 9)]


def test_a_full_pool_preempts_the_latest_admitted_and_it_recomputes_its_tokens():
    pool = PoolConfig(pages=6, page_size=4, token_budget=64)
    sched = Scheduler(pool)
    a, b = sched.add(Request(0, 0.0, 8, 12)), sched.add(Request(1, 0.0, 8, 12))
    sched.complete(sched.schedule(), 0.0)  # both prefilled: 2 pages each, 2 free
    for _ in range(8):  # each grows a page at tokens 8 and 12: the pool runs out
        step = sched.schedule()
        sched.complete(step, 0.0)
        if step.preempted:
            break
    assert step.preempted == (b,) and b.computed == 0 and b.pages == [] and sched.waiting[0] is b
    assert a in sched.running and sched.preemptions == 1
    # once readmitted, b prefills its prompt and every token it had generated, then samples the next one
    while b not in sched.running:
        sched.complete(sched.schedule(), 0.0)
    assert b.generated >= 1


def test_every_request_finishes_with_its_tokens_and_the_pool_is_empty_after():
    reqs = poisson_requests(60, 200.0, Lengths(3, 40), Lengths(1, 20), seed=2)
    pool = PoolConfig(pages=16, page_size=4, max_seqs=8, token_budget=16)  # tight: preemptions
    served = _served(reqs, pool, replicas=2)
    assert served.preemptions > 0
    assert sorted(s.req.rid for s in served.seqs) == list(range(60))
    assert all(s.generated == s.req.output_len and s.pages == [] for s in served.seqs)
    assert all(s.req.arrival_s <= s.first_token_s <= s.finish_s for s in served.seqs)


def test_closed_loop_keeps_at_most_concurrency_requests_in_the_system():
    reqs = poisson_requests(30, 1.0, Lengths(8), Lengths(4), seed=0)
    served = _served(reqs, PoolConfig(pages=256, page_size=4), concurrency=3)
    spans = [(s.req.arrival_s, s.finish_s) for s in served.seqs]
    for t, _ in spans:
        assert sum(a <= t < f for a, f in spans) <= 3
    assert served.seqs[0].req.arrival_s == 0.0 and max(a for a, _ in spans) > 0.0


def test_a_request_the_pool_cannot_hold_is_refused_with_the_sizes():
    with pytest.raises(UserError, match=r"holds 32 tokens .* less than one request's 30 \+ 5"):
        _served([Request(0, 0.0, 30, 5)], PoolConfig(pages=8, page_size=4))


@pytest.mark.parametrize(
    ("text", "expected"), [("512", Lengths(512, 512)), ("128-1024", Lengths(128, 1024)), (" 7 ", Lengths(7, 7))]
)
def test_lengths_read_a_count_or_a_range(text, expected):
    assert Lengths.parse(text, "--prompt-len") == expected


@pytest.mark.parametrize("text", ["0", "-5", "9-3", "abc", "", "1.5", "3-"])
def test_bad_lengths_are_one_user_error(text):
    with pytest.raises(UserError, match="--prompt-len"):
        Lengths.parse(text, "--prompt-len")


def test_poisson_arrivals_have_the_rate_asked_for():
    reqs = poisson_requests(4000, 20.0, Lengths(1), Lengths(1), seed=5)  # seeded: the same draw every run
    gaps = np.diff([r.arrival_s for r in reqs])
    assert gaps.mean() == pytest.approx(1 / 20.0, rel=0.05)  # 4000 exponential gaps: 1.6% standard error
    assert gaps.std() == pytest.approx(1 / 20.0, rel=0.08)  # an exponential's spread equals its mean
    assert poisson_requests(3, math.inf, Lengths(1), Lengths(1))[-1].arrival_s == 0.0


@pytest.mark.parametrize("rate", [0.0, -1.0, math.nan])
def test_a_rate_of_zero_or_less_is_refused(rate):
    with pytest.raises(UserError, match="--rate"):
        poisson_requests(3, rate, Lengths(1), Lengths(1))


def test_percentiles_match_numpy():
    xs = list(np.random.default_rng(0).exponential(size=101))
    got = percentiles(xs)
    for q in (50, 90, 99):
        assert got[f"p{q}"] == pytest.approx(np.percentile(xs, q))


def test_a_trace_file_is_read_in_arrival_order_and_bad_lines_are_named(tmp_path):
    good = tmp_path / "t.jsonl"
    good.write_text(
        '{"arrival_s": 1.5, "prompt_len": 8, "output_len": 2}\n\n{"arrival_s": 0, "prompt_len": 4, "output_len": 1}\n'
    )
    assert [(r.arrival_s, r.prompt_len) for r in load_trace(good)] == [(0.0, 4), (1.5, 8)]
    bad = tmp_path / "b.jsonl"
    bad.write_text('{"arrival_s": 0, "prompt_len": 4, "output_len": 1}\n{"arrival_s": 0, "prompt_len": 4}\n')
    with pytest.raises(UserError, match="line 2"):
        load_trace(bad)


# ----- the simulator ------------------------------------------------------------------------------------------------

LLAMA = get_model("llama3-8b")
H100 = get_chip("h100")
CFG = InferConfig(model=LLAMA, chip=H100, batch=1, context=4096, achievable=True)
# a 512-token sliding window on every layer: sequences past it read, and attend to, 512 positions a layer
WINDOWED = dataclasses.replace(CFG, model=dataclasses.replace(get_model("mistral-7b"), sliding_window=512))


@pytest.mark.parametrize("cfg", [CFG, WINDOWED], ids=["whole", "windowed"])
@pytest.mark.parametrize(("batch", "context"), [(1, 128), (32, 1000), (200, 3000)])
def test_a_step_of_decodes_costs_what_the_estimator_says_for_that_batch(cfg, batch, context):
    step = Step(tuple(Work(Seq(Request(i, 0.0, context, 9)), context - 1, 1, True) for i in range(batch)))
    expected = decode_step(dataclasses.replace(cfg, batch=batch, context=context))["step_s"]
    assert StepPricer(cfg).step_s(step) == pytest.approx(expected, rel=1e-12)


def test_a_prefill_chunk_costs_more_than_the_decodes_it_joins():
    pricer = StepPricer(CFG)
    decodes = tuple(Work(Seq(Request(i, 0.0, 100, 9)), 99, 1, True) for i in range(8))
    chunk = Work(Seq(Request(99, 0.0, 2048, 9)), 0, 1024, False)
    alone, mixed = pricer.step_s(Step(decodes)), pricer.step_s(Step((*decodes, chunk)))
    # 1,032 rows: compute-bound where 8 decode rows were weight-bound; the chunk's FLOPs set the time
    flops = 1024 * LLAMA.matmul_flops_per_token(include_logits=False) / H100.flops("bf16")
    assert mixed > alone and mixed > flops


def _counting_steps(pricer):
    class Stepwise:  # the same prices without the steady shortcut: every step walked
        def __call__(self, plan):
            return pricer(plan)

    return Stepwise()


@pytest.mark.parametrize(
    ("rate", "replicas", "pool"),
    [
        (math.inf, 1, None),
        (5.0, 1, None),
        (40.0, 2, None),
        (40.0, 2, PoolConfig(pages=300, page_size=16, max_seqs=64, token_budget=512)),  # preempts
    ],
)
def test_steady_decode_runs_priced_at_once_give_exactly_the_step_by_step_result(rate, replicas, pool):
    cfg = dataclasses.replace(CFG, dp=replicas, batch=replicas)
    pool = pool or pool_for(cfg)
    reqs = poisson_requests(300, rate, Lengths(100, 900), Lengths(10, 200), seed=3)
    fast = drive(reqs, pool, StepPricer(cfg), replicas=replicas)
    slow = drive(reqs, pool, _counting_steps(StepPricer(cfg)), replicas=replicas)
    a, b = summarize(fast), summarize(slow)
    assert a["steps"] == b["steps"] and a["preemptions"] == b["preemptions"]
    assert a["kv_pool_peak_fraction"] == b["kv_pool_peak_fraction"]
    for key in ("ttft_s", "tpot_s", "e2e_s"):
        for q in ("p50", "p90", "p99"):
            assert a[key][q] == pytest.approx(b[key][q], rel=1e-9)


def test_latency_grows_with_load_and_throughput_follows_the_rate():
    pool = pool_for(CFG)
    light, heavy = (
        summarize(simulate(CFG, poisson_requests(400, r, Lengths(512), Lengths(128), seed=1), pool)) for r in (2, 40)
    )
    assert heavy["tpot_s"]["p50"] > 1.2 * light["tpot_s"]["p50"]  # a larger batch reads more KV each step
    assert heavy["throughput_tokens_per_s"] > 10 * light["throughput_tokens_per_s"]


def test_the_pool_is_what_hbm_holds_after_the_weights():
    pool = pool_for(CFG)
    free = 0.9 * H100.hbm_bytes - LLAMA.params * 2
    assert pool.pages == int(free // (LLAMA.kv_bytes_per_token("bf16") * 16))
    with pytest.raises(UserError, match="leave no room for a KV cache"):
        pool_for(dataclasses.replace(CFG, model=get_model("llama3-70b")))


@pytest.mark.parametrize(
    ("text", "targets"),
    [("ttft=0.5s,tpot=50ms", (("ttft", 0.5), ("tpot", 0.05))), ("e2e=250us", (("e2e", 2.5e-4),))],
)
def test_slo_reads_targets_with_units(text, targets):
    slo = Slo.parse(text)
    assert [n for n, _ in slo.targets] == [n for n, _ in targets]
    assert [t for _, t in slo.targets] == pytest.approx([t for _, t in targets])


@pytest.mark.parametrize(
    "text", ["ttft=0.5", "ttft=5 minutes", "latency=1s", "ttft=-1s", "ttft=nans", ",", "ttft=infs"]
)
def test_an_slo_in_unknown_units_is_refused(text):
    with pytest.raises(UserError, match="--slo"):
        Slo.parse(text)


# ----- the command --------------------------------------------------------------------------------------------------


def _cli(*argv):
    return run_cli(list(argv))


BASE = ("infer", "serve", "--model", "llama3-8b", "--hardware", "h100", "--requests", "300")


def test_infer_serve_json_has_the_percentiles_and_the_rate_an_slo_allows():
    code, out, err = _cli(*BASE, "--rate", "10", "--slo", "ttft=200ms,tpot=12ms", "--json")
    assert code == 0, err
    d = json.loads(out)
    for key in ("ttft_s", "tpot_s", "e2e_s"):
        assert set(d[key]) == {"mean", "p50", "p90", "p99"} and d[key]["p50"] <= d[key]["p90"] <= d[key]["p99"]
    assert d["requests"] == 300 and d["preemptions"] == 0 and 0 < d["kv_pool_peak_fraction"] < 1
    assert d["throughput_tokens_per_s"] == pytest.approx(10 * 128, rel=0.15)  # what arrives leaves
    # the rate found meets the SLO, and a rate 10% above it does not (the bisection's answer is an edge)
    rate = d["max_rate_meeting_slo"]
    assert 10 < rate < d["capacity_rps"]
    slo = Slo.parse("ttft=200ms,tpot=12ms")
    at = {
        r: summarize(simulate(CFG, poisson_requests(300, r, Lengths(512), Lengths(128)), pool_for(CFG)))
        for r in (rate, 1.1 * rate)
    }
    assert slo.met(at[rate]) and not slo.met(at[1.1 * rate])


def test_an_overloaded_server_reports_unbounded_queueing_not_a_number():
    code, out, err = _cli(*BASE, "--rate", "500", "--json")
    assert code == 0, err
    d = json.loads(out)
    assert d["overloaded"] and d["queueing"] == "unbounded"
    assert d["ttft_s"] == {"mean": None, "p50": None, "p90": None, "p99": None} and d["e2e_s"]["p99"] is None
    code, out, _ = _cli(*BASE, "--rate", "500")
    assert "OVERLOADED" in out and "unbounded" in out


def test_search_names_the_fewest_chips_meeting_the_target():
    code, out, err = _cli(
        "infer",
        "serve",
        "--model",
        "llama3-70b",
        "--hardware",
        "h100",
        "--requests",
        "200",
        "--rate",
        "4",
        "--slo",
        "ttft=500ms,tpot=40ms",
        "--search",
        "--json",
    )
    assert code == 0, err
    d = json.loads(out)
    rows = d["search"]
    meeting = [r for r in rows if r["meets_slo"]]
    assert d["chips"] == min(r["chips"] for r in meeting)
    assert all(not r["meets_slo"] for r in rows if r["chips"] < d["chips"])
    assert any("no room for a KV cache" in r["why"] for r in rows if r["tp"] == 1)


@pytest.mark.parametrize(
    ("extra", "needle"),
    [
        (("--rate", "0"), "--rate"),
        (("--rate", "-3"), "--rate"),
        (("--rate", "2", "--prompt-len", "9000"), "longer than llama3-8b's context"),
        (("--rate", "2", "--pages", "2"), "KV pool holds 32 tokens"),
        (("--rate", "2", "--slo", "ttft=3parsecs"), "--slo"),
        (("--rate", "2", "--concurrency", "4"), "one of them"),
        ((), "give the load"),
        (("--rate", "2", "--search"), "--search"),
        (("--rate", "2", "--requests", "200000"), "at most 100,000"),
        (("--rate", "2", "--chips", "3", "--tp", "2"), "--tp x --dp must equal --chips 3"),
    ],
)
def test_bad_serving_input_is_one_line_and_exit_2(extra, needle):
    code, _, err = _cli(*BASE, *extra)
    assert code == 2 and needle in err and len(err.strip().splitlines()) == 1, err


# ----- a serve experiment's [serve] table ---------------------------------------------------------------------------

SERVE_TP = Path(__file__).resolve().parent.parent / "experiments" / "serve_tp.toml"


def _serve_experiment(tmp_path, serve_table: str, trace: str | None = None) -> Path:
    text = SERVE_TP.read_text()
    head, _, tail = text.partition("[serve]")
    rest = tail[tail.index("[run]") :]
    path = tmp_path / "s.toml"
    path.write_text(f"{head}[serve]\n{serve_table}\n\n{rest}")
    if trace is not None:
        (tmp_path / "load.jsonl").write_text(trace)
    return path


def test_the_shipped_serve_experiment_reads_its_load():
    from lab.run.experiment import load_experiment

    load = load_experiment(SERVE_TP).serve
    assert load["rate"] == 40.0 and load["requests"] == 64
    assert load["prompt_len"] == Lengths(4, 40) and load["output_len"] == Lengths(2, 16)


def test_a_trace_gives_the_requests_of_a_serve_experiment(tmp_path):
    from lab.run.experiment import load_experiment

    rows = [{"arrival_s": 0.01 * i, "prompt_len": 5 + i, "output_len": 3} for i in range(4)]
    path = _serve_experiment(tmp_path, 'trace = "load.jsonl"', "\n".join(json.dumps(r) for r in rows))
    load = load_experiment(path).serve
    assert [r.prompt_len for r in load["trace_requests"]] == [5, 6, 7, 8] and load["requests"] == 4
    assert load["prompt_len"] == Lengths(5, 8)


@pytest.mark.parametrize(
    ("table", "trace", "needle"),
    [
        ("requests = 4", None, "needs the load"),
        ("rate = 4.0\nconcurrency = 2", None, "needs the load"),
        ("rate = 0.0", None, "positive"),
        ('rate = 4.0\nprompt_len = "40-4"', None, "token count or a range"),
        ("rate = 4.0\nprompt_len = 60\noutput_len = 10", None, "pass max_seq_len"),
        ('trace = "load.jsonl"', '{"arrival_s": 0, "prompt_len": 4}', "line 1"),
        ('trace = "load.jsonl"\nrequests = 3', '{"arrival_s": 0, "prompt_len": 4, "output_len": 2}', "drop"),
        ('trace = "missing.jsonl"', None, "cannot be read"),
    ],
)
def test_a_bad_serve_table_names_the_key_and_the_file(tmp_path, table, trace, needle):
    from lab.run.experiment import load_experiment

    with pytest.raises(UserError, match=needle) as info:
        load_experiment(_serve_experiment(tmp_path, table, trace))
    assert "s.toml:" in str(info.value)


def test_a_windowed_models_steady_runs_give_the_step_by_step_result_as_sequences_cross_the_window():
    pool = pool_for(WINDOWED)
    reqs = poisson_requests(200, 20.0, Lengths(100, 900), Lengths(10, 400), seed=5)  # prompts either side of 512
    a = summarize(drive(reqs, pool, StepPricer(WINDOWED)))
    b = summarize(drive(reqs, pool, _counting_steps(StepPricer(WINDOWED))))
    assert a["steps"] == b["steps"]
    for key in ("ttft_s", "tpot_s", "e2e_s"):
        assert a[key]["p50"] == pytest.approx(b[key]["p50"], rel=1e-9)
        assert a[key]["p99"] == pytest.approx(b[key]["p99"], rel=1e-9)
