"""The layout planner: sorted, feasible, complete (against brute force) and clear about bad input."""

import itertools
import json
import math

import pytest

from lab.core.errors import UserError
from lab.core.hardware import get_chip
from lab.core.models import get_model
from lab.core.table import dumps
from lab.predict.planner.layouts import HEADROOM, PlanResult, _space, plan, search_space_size
from lab.predict.training.estimate import Layout, TrainConfig, check_config, estimate, memory_per_chip, state_min_chips

MI = 1024 * 1024
ALL = 10**9  # a `top` larger than any search space: every feasible configuration comes back


@pytest.fixture(scope="module")
def h100():
    return get_chip("h100")


@pytest.fixture(scope="module")
def llama70b_64(h100):
    """The headline case: llama3-70b on 64 H100, 16 Mi tokens of 8192 per step, every fitting config."""
    return plan(get_model("llama3-70b"), h100, 64, 16 * MI, 8192, top=ALL)


def _bench(name: str = "_bench_planner"):
    """A benchmark module of scripts/ (benchmarks live outside the product)."""
    import importlib
    import sys
    from pathlib import Path

    scripts = str(Path(__file__).resolve().parent.parent / "scripts")
    if scripts not in sys.path:
        sys.path.insert(0, scripts)
    return importlib.import_module(name)


def _assert_well_formed(result: PlanResult, chips: int):
    assert result.top, "a plan always has at least one result"
    assert len(result.top) <= result.feasible <= result.evaluated <= result.screened
    times = [e.step_time_s for e in result.top]
    assert times == sorted(times)
    assert all(times[0] <= t for t in times)
    for est in result.top:
        c, lay = est.config, est.config.layout
        assert est.memory.total <= est.memory.hbm_bytes
        assert lay.dp * lay.fsdp * lay.tp * lay.pp * lay.cp == chips == lay.chips
        assert lay.sequence_parallel == (lay.tp > 1)
        assert lay.zero == (1 if lay.dp > 1 else 0)
        assert lay.cp in (1, 2, 4, 8)
        assert c.batch_tokens == result.batch_tokens and c.seq_len == result.seq_len
        if lay.pp_schedule == "interleaved":
            assert lay.interleave == 2 and lay.pp > 1 and c.microbatches % lay.pp == 0
        check_config(c)  # raises on anything invalid
        assert math.isfinite(est.step_time_s) and est.step_time_s > 0


def test_top_is_sorted_and_every_result_fits(llama70b_64):
    _assert_well_formed(llama70b_64, 64)
    assert llama70b_64.feasible == len(llama70b_64.top)  # top=ALL returns every feasible configuration
    for est in llama70b_64.top:
        assert est.config.layout.tp <= 8  # tensor parallelism stays inside an 8-GPU NVLink node


def test_top_k_is_a_prefix_of_the_full_ranking(llama70b_64, h100):
    top5 = plan(get_model("llama3-70b"), h100, 64, 16 * MI, 8192, top=5)
    assert len(top5.top) == 5
    assert [e.config for e in top5.top] == [e.config for e in llama70b_64.top[:5]]
    assert top5.feasible == llama70b_64.feasible and top5.evaluated == llama70b_64.evaluated


def test_best_plan_beats_hand_written_tp8_fsdp8(llama70b_64, h100):
    model = get_model("llama3-70b")
    best = llama70b_64.top[0]
    assert best.config.layout.tp <= 8 and best.memory.fits
    hand = []
    for sp in (False, True):
        for remat in ("none", "selective", "full"):
            for mb in (1, 2):
                lay = Layout(tp=8, fsdp=8, sequence_parallel=sp)
                est = estimate(TrainConfig(model, h100, lay, 8192, 2048, microbatch=mb, remat=remat))
                if est.memory.fits:
                    hand.append(est)
    assert hand, "the hand-written layout must fit for this comparison to mean anything"
    assert best.step_time_s <= min(e.step_time_s for e in hand)
    # Layout(tp=8, fsdp=8) with sequence parallelism is in the search space, so it is among the results.
    ranked = {(e.config.layout, e.config.microbatch, e.config.remat) for e in llama70b_64.top}
    assert (Layout(tp=8, fsdp=8, sequence_parallel=True), 1, "full") in ranked


def _brute_force(model, chip, chips, seq_len, global_batch, remats, microbatches):
    """Every configuration of the planner's search space, built by hand and validated by check_config."""
    divs = [d for d in range(1, chips + 1) if chips % d == 0]
    eps = [e for e in range(1, model.experts + 1) if model.experts % e == 0]
    out = []
    for dp, fsdp, tp, pp, cp in itertools.product(divs, repeat=5):
        if dp * fsdp * tp * pp * cp != chips or tp > chip.node_size or cp not in (1, 2, 4, 8):
            continue
        for ep, (sched, v) in itertools.product(eps, [("1f1b", 1), ("interleaved", 2)]):
            if sched == "interleaved" and pp == 1:
                continue
            lay = Layout(dp, fsdp, tp, pp, cp, ep, 1 if dp > 1 else 0, tp > 1, sched, v)
            for mb, remat in itertools.product(microbatches, remats):
                cfg = TrainConfig(model, chip, lay, seq_len, global_batch, microbatch=mb, remat=remat)
                try:
                    out.append(estimate(cfg, check=True))
                except UserError:
                    continue
    return out


@pytest.mark.parametrize(
    ("name", "chips", "seq_len", "global_batch", "remats", "microbatches"),
    [
        ("llama2-7b", 8, 2048, 32, ("none", "selective", "full"), (1, 2, 4)),
        ("mixtral-8x7b", 16, 4096, 16, ("selective", "full"), (1, 2)),
    ],
)
def test_exhaustive_cross_check(h100, name, chips, seq_len, global_batch, remats, microbatches):
    model = get_model(name)
    brute = _brute_force(model, h100, chips, seq_len, global_batch, remats, microbatches)
    fits = [e for e in brute if e.memory.fits]
    assert brute and fits and len(fits) < len(brute)  # a space with both outcomes
    kw = {"top": ALL, "remats": remats, "microbatches": microbatches}
    screened = plan(model, h100, chips, global_batch * seq_len, seq_len, **kw)
    unscreened = plan(model, h100, chips, global_batch * seq_len, seq_len, screen_memory=False, **kw)
    _assert_well_formed(screened, chips)

    # The same space: every valid configuration considered, every fitting one ranked.
    assert screened.screened == unscreened.screened == unscreened.evaluated == len(brute)
    assert screened.feasible == unscreened.feasible == len(fits) == len(screened.top)
    assert screened.evaluated == len(fits)  # overflowing configurations are screened out, not priced
    key = lambda e: (e.config.layout, e.config.microbatch, e.config.remat)  # noqa: E731
    assert {key(e) for e in screened.top} == {key(e) for e in fits}
    # The planner's cached layer costs give exactly the step times of direct, checked estimate() calls.
    direct = {key(e): e.step_time_s for e in fits}
    assert all(e.step_time_s == direct[key(e)] for e in screened.top)
    assert screened.top[0].step_time_s == min(direct.values())
    assert [e.step_time_s for e in unscreened.top] == [e.step_time_s for e in screened.top]
    assert search_space_size(
        model, h100, chips, global_batch * seq_len, seq_len, remats=remats, microbatches=microbatches
    ) == len(brute)
    if model.is_moe:
        for e in screened.top:
            lay = e.config.layout
            assert model.experts % lay.ep == 0 and (lay.dp * lay.fsdp) % lay.ep == 0
        assert any(e.config.layout.ep > 1 for e in screened.top)


@pytest.mark.parametrize(("hardware", "tp_max"), [("h100", 8), ("tpu-v5e", 16)])
def test_tensor_parallel_limit_per_fabric(hardware, tp_max):
    # llama3-8b: 32 heads, 8 KV heads, so tp = 16 and 32 pass check_config; the fabric decides.
    model, chip = get_model("llama3-8b"), get_chip(hardware)
    result = plan(model, chip, 64, 64 * 4096, 4096, top=ALL, remats=("full",), microbatches=(1,))
    _assert_well_formed(result, 64)
    tps = {e.config.layout.tp for e in result.top}
    assert max(tps) == tp_max


def test_to_dict_is_strict_json(llama70b_64, h100):
    result = plan(get_model("llama2-7b"), h100, 8, 32 * 2048, 2048, top=4)
    for r in (result, llama70b_64):
        d = json.loads(dumps(r.to_dict()))
        assert d["model"] == r.model and d["hardware"] == r.hardware and d["chips"] == r.chips
        assert d["evaluated"] == r.evaluated and d["feasible"] == r.feasible
        assert d["batch_tokens"] == r.batch_tokens and d["seq_len"] == r.seq_len
        assert "seconds" in d and "configs_per_s" in d
        assert d["priced_per_s"] == d["configs_per_s"] == r.priced_per_s == r.evaluated / r.seconds
        assert d["screened_per_s"] == r.screened / r.seconds
        assert [t["rank"] for t in d["top"]] == list(range(1, len(r.top) + 1))
        assert d["top"][0]["step_time_s"] == r.top[0].step_time_s
        assert all(t["fits"] for t in d["top"])
    # A zero-second search has an infinite rate, which JSON carries as null.
    instant = PlanResult("m", "h", 1, 1, 1, 0, 0, 0.0, ())
    assert json.loads(dumps(instant.to_dict()))["configs_per_s"] is None
    assert json.loads(dumps(instant.to_dict()))["priced_per_s"] is None


def test_table_names_every_column(h100):
    result = plan(get_model("llama2-7b"), h100, 8, 32 * 2048, 2048, top=3)
    text = result.table()
    for col in ("rank", "layout", "remat", "microbatch", "step time", "likely (80%)", "tokens/s", "MFU", "HBM"):
        assert col in text
    assert result.top[0].config.layout.describe() in text
    assert result.top[0].bottleneck in text
    ties = sum(bool(t) for t in result.indistinguishable()[1:])
    full = result.top[0].memory.total > HEADROOM * result.top[0].memory.hbm_bytes
    # title, header, rule, one row per result, a line saying what ~ marks when a layout's interval overlaps, and
    # one warning when the best layout leaves under 10% of the chip's memory free
    assert len(text.splitlines()) == 3 + 3 + (1 if ties else 0) + (1 if full else 0)


def test_a_best_layout_that_fills_the_chip_is_flagged(h100):
    """llama3-8b on 8 H100s at 1 M tokens: the best layout holds 97% of the HBM (docs/training.md's planner)."""
    result = plan(get_model("llama3-8b"), h100, 8, 128 * 8192, 8192, top=3)
    best = result.top[0].memory
    assert best.total > HEADROOM * best.hbm_bytes
    assert f"!: rank 1 fills {100 * best.total / best.hbm_bytes:.0f}% of the chip's memory" in result.table()


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"batch_tokens": 16 * 8192 + 1}, "131073"),
        ({"chips": 0}, "0"),
        ({"chips": -3}, "-3"),
        ({"seq_len": 0}, "0"),
        ({"top": 0}, "top"),
        ({"remats": ("partial",)}, "'partial'"),
        ({"microbatches": (0,)}, "microbatch 0"),
        ({"optimizer": "lion"}, "'lion'"),
        ({"dtype": "fp4"}, "fp4"),
    ],
)
def test_bad_inputs_name_the_value(h100, kwargs, needle):
    args = {"chips": 8, "batch_tokens": 16 * 8192, "seq_len": 8192} | kwargs
    with pytest.raises(UserError) as exc:
        plan(get_model("llama3-8b"), h100, **args)
    assert needle in str(exc.value)
    assert "\n" not in str(exc.value)


def test_batch_not_a_multiple_suggests_valid_values(h100):
    with pytest.raises(UserError, match=r"batch_tokens 131073 is not a multiple of seq_len 8192; try 131072 or 139264"):
        plan(get_model("llama3-8b"), h100, 8, 131073, 8192)


def test_nothing_fits_names_the_chip_count_needed(h100):
    model = get_model("llama3-405b")
    with pytest.raises(UserError) as exc:
        plan(model, h100, 8, 16 * 8192, 8192)
    msg = str(exc.value)
    need = state_min_chips(TrainConfig(model, h100, Layout(), 8192, 16, microbatch=1, remat="full"))
    assert need is not None and need > 8
    assert msg.startswith("nothing fits on 8 h100: the state alone needs at least ")
    assert f"at least {need} chips" in msg


def test_no_valid_layout_suggests_a_chip_count(h100):
    # 7 chips: 7 divides neither the 64 heads nor the 80 layers, and a batch of 16 sequences
    # does not divide over 7 replicas.
    with pytest.raises(UserError) as exc:
        plan(get_model("llama3-70b"), h100, 7, 16 * 8192, 8192)
    assert "7 h100" in str(exc.value) and "try 8 chips" in str(exc.value)


def test_repeated_options_are_searched_once(h100):
    model = get_model("llama2-7b")
    once = plan(model, h100, 8, 32 * 2048, 2048, remats=("full",), microbatches=(1, 2))
    twice = plan(model, h100, 8, 32 * 2048, 2048, remats=("full", "full"), microbatches=(2, 1, 2))
    assert once.screened == twice.screened and once.evaluated == twice.evaluated
    assert once.top[0].step_time_s == twice.top[0].step_time_s


def test_benchmark_runs_and_prints_json(capsys):
    """A smoke test of scripts/bench_planner's module (one run per case; no timing is asserted)."""
    planner_bench = _bench()

    assert planner_bench.main(["--json", "--repeat", "1"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert [(c["model"], c["hardware"], c["chips"]) for c in data["cases"]] == [
        (m, h, n) for m, h, n, _, _ in planner_bench.CASES
    ]
    assert ("llama3-405b", "h100", 16384) in [(m, h, n) for m, h, n, _, _ in planner_bench.CASES]
    for c in data["cases"]:
        assert c["evaluated"] == c["priced"] >= c["feasible"] > 0 and c["screened"] >= c["evaluated"]
        assert c["priced_per_s"] == c["configs_per_s"]
        assert c["priced_per_s"] is None or c["priced_per_s"] > 0
        assert c["screened_per_s"] is None or c["screened_per_s"] >= c["priced_per_s"]
        assert c["cold_priced_per_s"] > 0 and c["cold_seconds"] > 0


def test_a_first_search_starts_with_no_collective_priced():
    """The benchmark's first searches (forget_prices) price every collective again: the memo is empty before one
    and holds what it priced after, and the result does not depend on it."""
    from lab.predict.training import step as training_step

    model, chip = get_model("llama3-8b"), get_chip("h100")
    warm = plan(model, chip, 16, 1024 * 8192, 8192)
    training_step.forget_prices()
    assert training_step._PRICED == {}
    cold = plan(model, chip, 16, 1024 * 8192, 8192)
    assert len(training_step._memo(chip)) > 0
    assert [e.step_time_s for e in cold.top] == [e.step_time_s for e in warm.top]


def test_microbatch_larger_than_the_batch_is_named(h100):
    with pytest.raises(UserError, match=r"every microbatch size \(16\) exceeds the global batch of 8 sequences"):
        plan(get_model("llama3-8b"), h100, 8, 8 * 8192, 8192, microbatches=(16,))


# ----- one cost model: the planner's numbers are estimate()'s -----------------------------------

# (model, hardware, chips, seq_len, global batch, remats, microbatches): searches with pipeline layouts among the
# results, a dense model on a GPU and on a TPU torus and a mixture of experts.
EXACT_SEARCHES = [
    ("llama3-8b", "h100", 32, 4096, 64, ("none", "selective", "full"), (1, 2, 4)),
    ("llama3-8b", "tpu-v5e", 32, 4096, 64, ("none", "selective", "full"), (1, 2)),
    ("mixtral-8x7b", "h100", 32, 4096, 32, ("selective", "full"), (1, 2)),
]


def _assert_same_estimate(planned, direct):
    assert planned.config == direct.config
    assert planned.step_time_s == direct.step_time_s
    assert planned.breakdown == direct.breakdown
    assert planned.memory == direct.memory
    assert planned.model_flops_per_step == direct.model_flops_per_step
    assert planned.hardware_flops_per_step == direct.hardware_flops_per_step
    assert planned.layer == direct.layer
    assert planned.to_dict() == direct.to_dict()


@pytest.mark.parametrize("screen_memory", [True, False])
@pytest.mark.parametrize(("name", "hardware", "chips", "seq_len", "gb", "remats", "microbatches"), EXACT_SEARCHES)
def test_every_planned_estimate_is_estimates_own(
    name, hardware, chips, seq_len, gb, remats, microbatches, screen_memory
):
    """Every configuration the planner returns carries exactly what a checked estimate() of it gives: step time,
    breakdown, memory, FLOPs, layer cost and the whole to_dict (no tolerance)."""
    model, chip = get_model(name), get_chip(hardware)
    kw = {"top": ALL, "remats": remats, "microbatches": microbatches, "screen_memory": screen_memory}
    result = plan(model, chip, chips, gb * seq_len, seq_len, **kw)
    assert any(e.config.layout.pp > 1 for e in result.top), "the search must rank pipeline layouts"
    assert any(e.config.layout.pp_schedule == "interleaved" for e in result.top)
    if model.is_moe:
        assert any(e.config.layout.ep > 1 for e in result.top)
    for est in result.top:
        _assert_same_estimate(est, estimate(est.config, check=True))


@pytest.mark.parametrize(("name", "hardware", "chips", "seq_len", "gb", "remats", "microbatches"), EXACT_SEARCHES)
def test_the_search_ranks_by_the_price_its_plans_are_given(name, hardware, chips, seq_len, gb, remats, microbatches):
    """The search ranks points by the step its cached parts sum to; what it reports is each point's Plan priced as any
    Plan is. The two are one number (no tolerance), so the ranking is the reported one."""
    from lab.predict.planner.search import Search

    model, chip = get_model(name), get_chip(hardware)
    search = Search(TrainConfig(model, chip, Layout(), seq_len, gb), remats, ALL, True)
    for lay, mbs in _space(model, chip, chips, seq_len, gb, microbatches):
        search.search(lay, mbs)
    ranked = sorted(-step for step, _, _ in search.heap)
    reported = [est.step_time_s for est in search.best()]
    assert len(reported) > 10 and reported == ranked


def _reference_plan(model, chip, chips, seq_len, gb, remats, microbatches, top, screen_memory):
    """The planner's documented search, one checked estimate() per point, nothing cached: (screened, evaluated,
    feasible, the `top` fastest that fit, ties in search order)."""
    screened = evaluated = feasible = 0
    fits = []
    for lay, mbs in _space(model, chip, chips, seq_len, gb, microbatches):
        screened += len(mbs) * len(remats)
        points = [
            TrainConfig(model, chip, lay, seq_len, gb, microbatch=mb, remat=r)
            for mb, r in itertools.product(mbs, remats)
        ]
        if screen_memory:
            state = memory_per_chip(points[0])
            if state.params + state.grads + state.optimizer > chip.hbm_bytes:
                continue
        for cfg in points:
            if screen_memory and not memory_per_chip(cfg).fits:
                continue
            est = estimate(cfg, check=True)
            evaluated += 1
            if est.memory.fits:
                feasible += 1
                fits.append(est)
    fits.sort(key=lambda e: e.step_time_s)  # stable: ties keep the search order
    return screened, evaluated, feasible, fits[:top]


@pytest.mark.parametrize("screen_memory", [True, False])
@pytest.mark.parametrize(
    ("name", "hardware", "chips", "seq_len", "gb", "remats", "microbatches"),
    [
        ("llama3-8b", "h100", 16, 4096, 32, ("none", "selective", "full"), (1, 2, 4)),
        ("mixtral-8x7b", "h100", 16, 4096, 16, ("selective", "full"), (1, 2)),
    ],
)
def test_counts_and_top_k_equal_a_brute_force_loop(
    name, hardware, chips, seq_len, gb, remats, microbatches, screen_memory
):
    model, chip = get_model(name), get_chip(hardware)
    top = 7
    screened, evaluated, feasible, best = _reference_plan(
        model, chip, chips, seq_len, gb, remats, microbatches, top, screen_memory
    )
    kw = {"top": top, "remats": remats, "microbatches": microbatches, "screen_memory": screen_memory}
    result = plan(model, chip, chips, gb * seq_len, seq_len, **kw)
    assert (result.screened, result.evaluated, result.feasible) == (screened, evaluated, feasible)
    assert evaluated < screened if screen_memory else evaluated == screened
    assert [e.config for e in result.top] == [e.config for e in best]
    for planned, direct in zip(result.top, best, strict=True):
        _assert_same_estimate(planned, direct)


def test_instruction_counts_are_the_differences_of_three_processes(monkeypatch):
    """--instructions: a case's first search is what the process making one search executes beyond the one making
    none, a later search what a second search adds; per priced configuration, of the case's own search."""
    callgrind = _bench("_callgrind")
    planner_bench = _bench()

    seen = []

    def counted(args):
        seen.append(args)
        return {"0": 1_000, "1": 5_000, "2": 7_500}[args[-1].split(",")[1]]

    monkeypatch.setattr(callgrind, "instructions", counted)
    r = planner_bench.count_case(4)
    assert seen == [[planner_bench.__file__, "--child", f"4,{k}"] for k in range(3)]
    # 1,237 layouts fit (950 before the context shards joined FSDP's and ZeRO's shard groups)
    assert (r["model"], r["chips"], r["priced"]) == ("llama3-405b", 16384, 1237)
    assert (r["first_instructions"], r["later_instructions"]) == (4_000, 2_500)
    assert r["first_per_priced"] == 4_000 / 1237 and r["later_per_priced"] == 2_500 / 1237


def test_a_counted_child_makes_the_searches_it_is_given(monkeypatch):
    planner_bench = _bench()

    calls = []
    monkeypatch.setattr(planner_bench, "plan", lambda *a: calls.append(a))
    assert planner_bench.main(["--child", "1,2"]) == 0
    model, hardware, chips, tokens, seq = planner_bench.CASES[1]
    assert [(c[0].name, c[1].name, *c[2:]) for c in calls] == [(model, hardware, chips, tokens, seq)] * 2


def test_counting_without_valgrind_says_what_to_install(monkeypatch, capsys):
    import shutil

    planner_bench = _bench()

    monkeypatch.setattr(shutil, "which", lambda name: None)
    assert planner_bench.main(["--instructions"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (
        "bench_planner: counting instructions needs valgrind on PATH (apt install valgrind); or time without it"
    )


@pytest.mark.parametrize("child", ["x", "1", "9,1", "1,two"])
def test_a_malformed_child_is_one_line_not_a_traceback(capsys, child):
    planner_bench = _bench()

    assert planner_bench.main(["--child", child]) == 2
    assert capsys.readouterr().err == f"bench_planner: --child takes CASE,SEARCHES (0-4,0-2), got {child!r}\n"
