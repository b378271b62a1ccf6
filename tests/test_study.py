"""Generations study: ordering of the generations, the attribution walk's bookkeeping, the outputs."""

import json
import math

import pytest

from lab.core.errors import UserError
from lab.core.hardware import get_chip
from lab.core.models import get_model
from lab.core.table import dumps
from lab.predict.training.estimate import estimate
from lab.studies.generations import (
    Attribution,
    GenerationRow,
    GenerationsStudy,
    _config,
    _days,
    generations,
    study_layout,
)

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def study() -> GenerationsStudy:
    return generations()


def _row(study: GenerationsStudy, hardware: str, precision: str) -> GenerationRow:
    return next(r for r in study.rows if r.hardware == hardware and r.precision == precision)


def test_rows_cover_every_chip_and_fp8_only_where_the_chip_has_it(study):
    keys = [(r.hardware, r.precision) for r in study.rows]
    assert keys == [
        ("a100-80gb", "bf16"),
        ("h100", "bf16"),
        ("h100", "fp8"),
        ("h200", "bf16"),
        ("h200", "fp8"),
        ("b200", "bf16"),
        ("b200", "fp8"),
    ]
    assert len({r.layout for r in study.rows}) == 1
    assert study.rows[0].layout == "dp=16 tp=8 pp=8 zero=1 sp interleavedx2"
    assert study.rows[0].speedup_vs_a100 == 1.0
    for r in study.rows:
        assert r.fits
        assert math.isclose(r.days, study.tokens / r.tokens_per_s / 86400, rel_tol=1e-12)
        assert 0 < r.mfu < 1


def test_each_generation_is_at_least_as_fast_as_the_previous_in_bf16(study):
    a100, h100, h200, b200 = (_row(study, hw, "bf16").days for hw in ("a100-80gb", "h100", "h200", "b200"))
    assert a100 > h100 >= h200 > b200


def test_fp8_is_faster_than_bf16_on_the_same_chip(study):
    for hw in ("h100", "h200", "b200"):
        assert _row(study, hw, "fp8").days < _row(study, hw, "bf16").days


def test_attribution_factors_multiply_to_the_total_and_end_at_the_target(study):
    model = get_model(study.model)
    base = get_chip("a100-80gb")
    layout = study_layout(model, base, study.chips, study.seq_len, study.global_batch)
    assert [a.target for a in study.attributions] == ["h100", "h200", "b200"]
    for a in study.attributions:
        assert isinstance(a, Attribution)
        steps = ["compute", "HBM", "interconnect", "memory capacity", "kernel efficiency", "precision"]
        assert [s[0] for s in a.steps] == steps
        assert math.isclose(math.prod(s[2] for s in a.steps), a.total_factor, rel_tol=1e-9)
        # The days walk: each factor is the days before over the days after.
        before = study.rows[0].days
        for _, days, factor in a.steps:
            assert math.isclose(before / days, factor, rel_tol=1e-9)
            before = days
        target = get_chip(a.target)
        own = _days(study.tokens, estimate(_config(model, target, layout, study.seq_len, study.global_batch, "fp8")))
        assert math.isclose(a.steps[-1][1], own, rel_tol=1e-9)
        assert math.isclose(a.steps[-1][1], _row(study, a.target, "fp8").days, rel_tol=1e-9)
        assert math.isclose(a.total_factor, _row(study, a.target, "fp8").speedup_vs_a100, rel_tol=1e-9)
        memory_step = dict((s[0], s[2]) for s in a.steps)["memory capacity"]
        assert memory_step == 1.0  # capacity decides fits, never time


def test_readings_state_both_numbers(study):
    assert {"per GPU", "system", "gap", "precision", "memory capacity"} <= set(study.readings)
    assert "35x" in study.readings["system"]
    assert "11-17x" in study.readings["per GPU"]
    assert "fitted" in study.readings["fitting"].lower()


def test_table_has_both_tables_and_the_readings(study):
    text = study.table()
    assert "Attribution" in text and "Readings" in text
    for hw in ("a100-80gb", "h100", "h200", "b200"):
        assert hw in text
    assert "interconnect" in text and "precision" in text


def test_plot_writes_a_png(study, tmp_path):
    out = study.plot(tmp_path / "generations.png")
    data = out.read_bytes()
    assert len(data) > 1000
    assert data[:8] == PNG_SIGNATURE


def test_to_dict_is_json(study):
    doc = json.loads(dumps(study.to_dict()))
    assert doc["chips"] == 1024
    assert len(doc["rows"]) == len(study.rows)
    assert doc["attributions"][-1]["target"] == "b200"
    assert doc["readings"]["system"] == study.readings["system"]


@pytest.mark.parametrize("chips", [1000, 32, 96])
def test_layout_that_does_not_divide_the_chips_is_a_user_error(chips):
    with pytest.raises(UserError, match="tp=8 x pp=8"):
        generations(chips=chips)


def test_falls_back_to_1f1b_when_interleaving_is_invalid():
    # 64 chips (dp=1) and a batch of 4 give 4 microbatches, not a multiple of pp=8: Megatron's interleaved
    # schedule is refused, so the study uses 1F1B.
    s = generations(chips=64, global_batch=4, hardware=("a100-80gb", "h100"))
    assert s.rows[0].layout.endswith("1f1b")
