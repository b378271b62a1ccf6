"""The trust verdict one run carries on its step line, in report.md and in report.json (lab.report.trust)."""

from __future__ import annotations

import pytest

from lab.core.limits import HOST_BUSY
from lab.report.trust import spec_words, verdict, verdict_words

BAND = 1.5 / 0.67  # the band a ratio is judged by, upper edge over lower


def _summary(spread, load, repeats=5):
    return {"spread_large": spread, "host_load": load, "repeats": repeats}


@pytest.mark.parametrize(
    ("spread", "load", "repeats", "want", "said"),
    [
        (1.10, 0.02, 5, "steady", "repeats differ by 1.10x"),
        (3.00, 0.02, 5, "UNSTEADY", "repeats differ by 3.00x, more than the band's 2.24x"),
        (1.10, 0.87, 5, "UNSTEADY", "other processes held 87% of the host"),
        (None, 0.87, 1, "UNSTEADY", "spread not measurable: one repeat"),  # the host's load alone flags it
        (None, 0.01, 1, "steady", "spread not measurable: one repeat"),
        (None, None, 5, "steady", "spread not measurable: no op of 1 MB or more"),
    ],
)
def test_the_verdict_follows_spread_and_host_load(spread, load, repeats, want, said):
    got = verdict(_summary(spread, load, repeats), BAND)
    assert got["verdict"] == want and said in "; ".join(got["reasons"])
    assert verdict_words(got).endswith("read its ratios as noise") == (want == "UNSTEADY")


def test_a_runs_own_processes_on_the_host_do_not_flag_it():
    got = verdict(_summary(1.1, 0.45), BAND, siblings=1)  # launch --local-processes 2 on one host
    assert got["verdict"] == "steady" and "this run's own 1 other included" in got["reasons"][-1]


def test_the_threshold_is_the_calibrations():
    assert verdict(_summary(1.0, HOST_BUSY - 0.01), BAND)["verdict"] == "steady"
    assert verdict(_summary(1.0, HOST_BUSY + 0.01), BAND)["verdict"] == "UNSTEADY"


def test_a_compiled_only_run_is_not_measured():
    assert verdict(_summary(None, None), BAND, compile_only=True) == {
        "verdict": "not measured",
        "reasons": ["compiled only: nothing ran"],
    }


def test_a_spec_calibrated_on_a_busy_host_says_so():
    busy = {"name": "cpu", "calibrated": True, "calibration": {"host": {"load": {"busy": True}}}}
    idle = {"name": "cpu", "calibrated": True, "calibration": {"host": {"load": {"busy": False}}}}
    assert "BUSY host" in spec_words(busy) and "shardlab calibrate" in spec_words(busy)
    assert spec_words(idle) == "cpu (calibrated)"
    assert "NOT calibrated" in spec_words({"name": "cpu", "kind": "cpu", "calibrated": False})
    assert spec_words({"name": "tpu-v5e", "kind": "tpu", "calibrated": False}) == "tpu-v5e (catalog: datasheet figures)"


def test_the_glossary_explains_the_marks_the_outputs_use():
    """Words a newcomer meets in the outputs (issue 38's list) each have an entry, and report.md points there."""
    from lab.report.writer import GLOSSARY

    text = GLOSSARY.read_text()
    for term in (
        "**spread**",
        "`!`",
        "UNSTEADY",
        "**BUSY**",
        "**n/e**",
        "**grade**",
        "**crit. int.**",
        "**bus bandwidth**",
        "**1f1b**",
        "**(hidden behind)**",
        "**coverage**",
        "**collective_factor**",
    ):
        assert term in text, term
    readme = (GLOSSARY.parents[1] / "README.md").read_text()
    assert "(docs/glossary.md)" in readme


def test_a_long_step_says_it_is_still_working_and_stops_when_it_ends():
    """issue 38: a progress line at least every 5 s during compile, audit and calibration (here every 0.05 s)."""
    import time

    from lab.core.heartbeat import still

    said = []
    with still(said.append, "compiling", every=0.05):
        time.sleep(0.5)
    n = len(said)
    assert 2 <= n <= 10 and all(s.startswith("still compiling: ") for s in said)
    time.sleep(0.15)
    assert len(said) == n  # stopped with the block
    with pytest.raises(RuntimeError), still(said.append, "failing", every=0.05):
        raise RuntimeError("the step failed")
    time.sleep(0.15)
    assert not any("failing" in s for s in said)  # an error stops it too: no line after the error


def test_the_ledger_says_where_in_the_program_each_hlo_op_is():
    """An HLO name alone (fusion.7) says nothing of where it sits: the ledger gives the estimator's named op it was
    joined to, else its source's named scopes without JAX's tracing layers."""
    from lab.report.writer import ledger_table, where_in_program

    joined = {"name": "fusion.7", "estimate_op": "mlp/up", "scope": "jit(step)/layers/mlp/up/dot_general"}
    scoped = {
        "name": "pow.1",
        "estimate_op": None,
        "scope": "jit(step)/while/body/closed_call/attention/rope/vmap()/pow",
    }
    bare = {"name": "copy.3", "estimate_op": None, "scope": ""}
    assert [where_in_program(r) for r in (joined, scoped, bare)] == ["mlp/up", "attention/rope/pow", "-"]
    rows = [
        r
        | {
            "kind": "matmul",
            "predicted_s": 1e-3,
            "measured_s": 1e-3,
            "ratio": 1.0,
            "spread": 1.1,
            "bytes": 1e6,
            "collective_bytes": 0.0,
        }
        for r in (joined, scoped, bare)
    ]
    text = ledger_table(rows)
    assert text.splitlines()[0].split()[:4] == ["op", "in", "the", "program"]
    assert "attention/rope/pow" in text and "mlp/up" in text
