"""Memory-technology study (lab.studies.memtech): generations of HBM and a bandwidth-only series."""

import itertools
import json
import math

import pytest

from lab.core.errors import UserError
from lab.core.hardware import get_chip
from lab.core.table import dumps
from lab.studies.memtech import (
    BANDWIDTH,
    GENERATIONS,
    MEMORY_BOUNDS,
    MEMORY_TECH,
    MemTechStudy,
    default_stacks,
    memory_tech,
)

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def study() -> MemTechStudy:
    return memory_tech()  # llama3-70b on h100, tp=8, largest batch that fits at 8k


@pytest.fixture(scope="module")
def fixed() -> MemTechStudy:
    # A small fixed batch at tp=2: few collectives, so the step is almost all weight reads.
    return memory_tech("llama3-70b", "h100", tp=2, batch=4)


def test_memory_tech_table_is_cited_and_ordered():
    assert [t.name for t in MEMORY_TECH] == ["HBM2e", "HBM3", "HBM3e", "HBM4"]
    for a, b in itertools.pairwise(MEMORY_TECH):
        assert b.bandwidth_per_stack > a.bandwidth_per_stack
        assert b.capacity_per_stack >= a.capacity_per_stack
    for t in MEMORY_TECH:
        assert t.source and ("JEDEC" in t.source or "announcement" in t.source)


def test_default_stacks():
    assert default_stacks(get_chip("h100"))[0] == 5
    assert default_stacks(get_chip("h200"))[0] == 6
    assert default_stacks(get_chip("b200"))[0] == 8
    assert default_stacks(get_chip("v5e"))[0] == 2
    n, src = default_stacks(get_chip("v6e"))  # not catalogued: inferred from 32 GB
    assert n == 2 and "inferred" in src


def test_rows_swap_stacks_times_per_stack_figures(study):
    gen = study.series(GENERATIONS)
    assert [r.label for r in gen] == ["HBM2e", "HBM3", "HBM3e", "HBM4"]
    for r, t in zip(gen, MEMORY_TECH, strict=True):
        assert r.hbm_bandwidth == pytest.approx(5 * t.bandwidth_per_stack)
        assert r.hbm_bytes == pytest.approx(5 * t.capacity_per_stack)
    bw = study.series(BANDWIDTH)
    h100 = get_chip("h100")
    assert [r.bandwidth_ratio for r in bw] == [1, 2, 4, 8, 16]
    for r in bw:
        assert r.hbm_bytes == h100.hbm_bytes
        assert r.batch == bw[0].batch  # capacity fixed, so the batch is too
    assert len(study.rows) == 9
    # batch=None decodes the largest batch that fits, which grows with capacity.
    assert [r.batch for r in gen] == [r.max_batch for r in gen]
    assert gen[-1].batch > gen[0].batch
    for r in study.rows:
        assert r.fits
        assert r.speedup_vs_first > 0 and math.isfinite(r.decode_step_s)


@pytest.mark.parametrize("name", ["study", "fixed"])
def test_speedup_is_monotone_in_bandwidth(name, request):
    s = request.getfixturevalue(name)
    for series in (GENERATIONS, BANDWIDTH):
        rows = s.series(series)
        assert rows[0].speedup_vs_first == 1.0 and rows[0].bandwidth_ratio == 1.0
        for a, b in itertools.pairwise(rows):
            assert b.hbm_bandwidth > a.hbm_bandwidth
            assert b.speedup_vs_first >= a.speedup_vs_first


@pytest.mark.parametrize("name", ["study", "fixed"])
def test_speedup_never_beats_the_bandwidth_ratio_when_the_batch_is_held(name, request):
    s = request.getfixturevalue(name)
    held = s.series(BANDWIDTH) + (s.series(GENERATIONS) if s.batch is not None else ())
    for r in held:
        assert r.speedup_vs_first <= r.bandwidth_ratio * (1 + 1e-9)
    # Capacity-decided batches may beat it (more sequences share the weight reads and collectives); the
    # findings say so exactly where it happens.
    for a, b in itertools.pairwise(s.series(GENERATIONS)):
        above = b.tokens_per_s_per_chip / a.tokens_per_s_per_chip > b.hbm_bandwidth / a.hbm_bandwidth * 1.001
        text = next(f for f in s.findings if f.startswith(f"{a.label} -> {b.label}:"))
        assert ("Above linear" in text) == above


def test_first_generations_are_near_linear_at_a_small_fixed_batch(fixed):
    hbm2e, hbm3 = fixed.series(GENERATIONS)[:2]
    assert hbm3.speedup_vs_first / hbm3.bandwidth_ratio > 0.8
    assert hbm2e.bound in MEMORY_BOUNDS and hbm3.bound in MEMORY_BOUNDS


def test_largest_multiplier_is_bound_by_something_other_than_hbm(study):
    last = study.series(BANDWIDTH)[-1]
    assert last.label == "bw x16"
    assert last.bound not in MEMORY_BOUNDS
    assert last.speedup_vs_first < 0.5 * last.bandwidth_ratio  # clearly sub-linear
    named = [f for f in study.findings if last.label in f and last.bound in f]
    assert named, study.findings
    # Every finding's numbers come from the rows: the step into HBM4 quotes its own ratios.
    hbm3e, hbm4 = study.series(GENERATIONS)[2:]
    step = f"x{hbm4.hbm_bandwidth / hbm3e.hbm_bandwidth:.2f}"
    assert any(f.startswith("HBM3e -> HBM4") and step in f for f in study.findings)


def test_fixed_batch_not_fitting_is_flagged():
    s = memory_tech("llama3-70b", "h100", batch=400)  # 400 x 2.7 GB does not fit 8 x 80 GB
    assert not s.series(BANDWIDTH)[0].fits
    assert any("does not fit" in f for f in s.findings)


@pytest.mark.parametrize(
    "kwargs",
    [dict(context=0), dict(batch=0), dict(tp=3), dict(tp=0), dict(weights="int3"), dict(kv="int2"), dict(stacks=0)],
)
def test_bad_inputs_are_user_errors(kwargs):
    with pytest.raises(UserError):
        memory_tech(**kwargs)


def test_table_to_dict_and_plot(study, tmp_path):
    text = study.table()
    assert "Findings" in text and "HBM4" in text and "bw x16" in text
    doc = json.loads(dumps(study.to_dict()))
    assert len(doc["rows"]) == len(study.rows)
    assert doc["findings"] == list(study.findings)
    assert doc["stacks"] == 5 and "five" in doc["stacks_source"]
    out = study.plot(tmp_path / "memtech.png")
    assert out.read_bytes()[:8] == PNG_SIGNATURE
