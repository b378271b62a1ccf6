"""Every estimate's 80% interval: the development set's residuals by class (kept in a table a test holds to the model),
widened by what the estimate's B and C constants do when swapped."""

import itertools
import json
import math
import statistics

import pytest

from lab.cli.main import main
from lab.predict import intervals as iv
from lab.studies import intervals_fit, validate_public
from lab.studies.validate_public import run_public_validation


@pytest.fixture(scope="module")
def dev():
    return run_public_validation("development")


def test_the_stored_table_is_the_development_sets_residuals_as_the_model_stands(dev):
    """A model change that moves a development run's error makes this fail: rerun `shardlab validate
    --write-intervals` (the test split is never read to make the table)."""
    fresh = {c["name"]: c for c in intervals_fit.fit(dev)["classes"]}
    stored = iv.table()
    assert set(fresh) == set(stored)
    for name, c in fresh.items():
        s = stored[name]
        assert (s.runs, s.sources) == (c["runs"], c["sources"]), name
        assert (s.dof, s.k) == (c["dof"], c["k"]), name
        for k in ("mu", "s_between", "s_within"):
            assert getattr(s, k) == pytest.approx(c[k], abs=1e-9), (name, k)


def test_a_class_spread_is_between_its_sources_and_within_them():
    """Two sources, each off its own way: the centre is their mean; between them, their spread; within, each run about
    its source's mean (hand-computed from the residuals)."""
    from lab.studies.public_runs import PublicRun
    from lab.studies.validate_public import PublicRow, PublicValidation

    def run(case, source, err, group_chip="h100"):
        r = PublicRun(
            case,
            "training",
            group_chip,
            8,
            "llama3-8b",
            {},
            2048,
            8,
            1,
            "bf16",
            "none",
            1.0,
            "s/step",
            "s",
            "A",
            "x",
            source_key=source,
        )
        return PublicRow(r, 1.0 + err, err)

    errs = {"a": [-0.2, -0.1], "b": [0.1, 0.0], "c": [0.05]}
    rows = tuple(run(f"R{i}{j}", s, e) for i, (s, es) in enumerate(errs.items()) for j, e in enumerate(es))
    c = intervals_fit.fit(PublicValidation(rows))["classes"][0]
    res = {s: [-math.log(1 + e) for e in es] for s, es in errs.items()}
    means = [sum(v) / len(v) for v in res.values()]
    mu = sum(means) / 3
    between = math.sqrt(sum((m - mu) ** 2 for m in means) / 2)
    within = math.sqrt(sum((x - sum(v) / len(v)) ** 2 for v in res.values() for x in v) / (5 - 3))
    assert (c["runs"], c["sources"]) == (5, 3)
    assert c["mu"] == pytest.approx(mu) and c["s_between"] == pytest.approx(between)
    assert c["s_within"] == pytest.approx(within)


def test_an_interval_widens_with_its_constant_shifts_and_sits_on_the_class_centre():
    spread = iv.table()["GPU training"]
    plain = iv.interval(2.0, "GPU training")
    # a new source's run: the between-source spread widened by 1 + 1/k, Student's t with k - 1 degrees of freedom
    s = math.hypot(spread.s_between * math.sqrt(1 + 1 / spread.k), spread.s_within)
    q = {4: 1.533, 5: 1.476, 6: 1.440}[spread.dof]
    assert spread.dof == spread.k - 1 == spread.sources - 1
    assert plain.lo == pytest.approx(2.0 * math.exp(spread.mu - q * s))
    assert plain.hi == pytest.approx(2.0 * math.exp(spread.mu + q * s))
    wide = iv.interval(2.0, "GPU training", {"attention.h100.fa3": 0.8})
    assert wide.lo < plain.lo and wide.hi > plain.hi and wide.leaning_on[0][0] == "attention.h100.fa3"
    assert iv.interval(2.0, "GPU training", {"x": 1.0}).hi == pytest.approx(plain.hi)  # no shift, no widening


def test_train_estimate_carries_its_interval_and_says_it(capsys):
    argv = ["train", "estimate", "--model", "llama3-8b", "--hardware", "h100", "--chips", "8", "--global-batch", "32"]
    assert main([*argv, "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    lo, hi = d["step_time_interval_s"]
    assert 0 < lo < hi and d["interval"]["class"] == "GPU training" and d["interval"]["confidence"] == 0.8
    assert main(argv) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("step time"))
    assert ", likely " in line and "(80%" in line
    cpu = ["train", "estimate", "--model", "llama3-8b", "--layers", "2", "--hardware", "cpu", "--chips", "8"]
    assert main([*cpu, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["step_time_interval_s"] is None
    assert main(cpu) == 0
    assert "no interval: no published run validates this chip kind" in capsys.readouterr().out


def test_an_answer_resting_on_carried_over_constants_is_wider():
    """The same job on a TPU v4 (GEMM, ICI and copy rates carried over from v5e or assumed) and on an H100 (measured):
    the TPU's interval is relatively wider."""
    from lab.core.hardware import get_chip
    from lab.core.models import get_model
    from lab.predict.training.config import Layout, TrainConfig
    from lab.predict.training.estimate import estimate

    def width(chip):
        cfg = TrainConfig(get_model("llama3-8b"), get_chip(chip), Layout(fsdp=8), seq_len=4096, global_batch=32)
        got = iv.for_training(estimate(cfg))
        return got.hi / got.lo, got.s_constants

    (tpu, tpu_k), (gpu, gpu_k) = width("tpu-v4"), width("h100")
    assert tpu_k > gpu_k and tpu > gpu


def test_infer_estimate_has_decode_and_prefill_intervals(capsys):
    base = ["infer", "estimate", "--model", "llama3-8b", "--hardware", "h100", "--chips", "1", "--batch", "8"]
    assert main([*base, "--context", "2048", "--prefill-len", "1024", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["decode_step_interval_s"][0] < d["decode_step_interval_s"][1]
    assert d["prefill_interval_s"][0] < d["prefill_interval_s"][1]
    assert d["intervals"]["basis"] == "achievable"
    assert main([*base, "--context", "2048", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["prefill_interval_s"] is None


def test_plan_marks_the_layouts_it_cannot_tell_from_the_best(capsys):
    argv = ["plan", "--model", "llama3-70b", "--hardware", "h100", "--chips", "64", "--batch-tokens", "4Mi"]
    assert main([*argv, "--top", "8", "--json"]) == 0
    top = json.loads(capsys.readouterr().out)["top"]
    assert top[0]["indistinguishable_from_best"] is True
    best_lo, best_hi = top[0]["interval_s"]
    for row in top[1:]:
        lo, hi = row["interval_s"]
        assert row["indistinguishable_from_best"] == (lo <= best_hi and best_lo <= hi)


def test_validation_reports_how_often_the_measured_value_is_inside(dev):
    v = intervals_fit.with_intervals(dev)
    flags = [v.inside(r) for r in v.predicted]
    assert all(f is not None for f in flags) and 0 < sum(flags) <= len(flags)
    s = v.summary()
    assert s["coverage"] == pytest.approx(sum(flags) / len(flags))
    assert s["median_half_width"] > 0
    # a run priced one step at a time takes its class's one-step residuals; one served under a stated load the load
    # simulator's own, wider class (validate_public.interval_class): the development set's loads are its worst answers
    widths = {False: [], True: []}
    for r in v.predicted:
        widths[validate_public.loaded(r.run)].append(v.intervals[r.run.case_id].half_width)
    step, load = (statistics.median(widths[k]) for k in (False, True))
    assert 0 < step < 1 and load > step
    for r in v.predicted:  # inside means the measured time over the predicted lies in the stated ratio range
        got = v.intervals[r.run.case_id]
        assert v.inside(r) == (got.lo <= 1 / (1 + r.error) <= got.hi)


def test_one_case_shows_its_interval_and_an_unexpressible_one_is_refused(capsys):
    assert main(["validate", "--case", "PS03", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["case"] == "PS03" and d["interval_ratio"][0] < 1 < d["interval_ratio"][1] * 2
    assert main(["validate", "--case", "T229"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "T229 is not expressible" in err[0] and "no interval" in err[0]
    assert main(["validate", "--case", "nope"]) == 2
    assert "--case 'nope' is no published run; valid: PT01" in capsys.readouterr().err


def test_one_case_names_the_network_the_run_trained_not_the_catalog_entry_it_overrides(capsys):
    # PT14 is FlashAttention's GPT-3 1.3B: the catalog's gpt3-175b with its own dimensions and name
    assert main(["validate", "--case", "PT14"]) == 0
    head = capsys.readouterr().out.splitlines()[2]
    assert "gpt3-1.3b on 8 a100-80gb" in head and "175b" not in head


def test_students_t_quantiles_narrow_towards_the_normal():
    assert iv.t90(1) == 3.078 and iv.t90(5) == 1.476 and iv.t90(11) == 1.372  # between entries: the wider
    assert iv.t90(500) == iv.Z80
    qs = [iv.t90(d) for d in range(1, 200)]
    assert all(a >= b for a, b in itertools.pairwise(qs))
