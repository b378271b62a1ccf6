"""The pipeline bubble read from a trace (lab.measure.bubble): op events assigned to steps by their scope and to
stages by their device, hand-counted; and a run of a pipelined experiment reporting it beside the schedule's."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest

from lab.measure.bubble import measure, step_of_ops
from lab.report.writer import bubble_line

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _ev(name: str, device: int, dur_us: float):
    return SimpleNamespace(name=name, device=device, dur_us=dur_us)


def test_steps_come_from_the_scope_forward_and_backward():
    scopes = [
        ("fusion.1", "jit(step)/pipeline/stage/step_0/while/body/dot_general"),
        ("fusion.2", "jit(step)/transpose(jvp(pipeline/stage/step_12))/while/body/closed_call/mul"),
        ("fusion.3", "jit(step)/pipeline/pass_1/collective_permute"),
        ("fusion.4", "jit(step)/pipeline/stage/step_2x/add"),  # not a step scope
        ("fusion.5", ""),
    ]
    assert step_of_ops(scopes) == {"fusion.1": 0, "fusion.2": 12}


def test_a_two_stage_gpipe_of_two_microbatches_by_hand():
    # p = 2 stages, 3 steps, W = 2 work items per stage: stage 0 works in steps 0, 1 (idle in 2), stage 1 in steps
    # 1, 2 (idle in 0). Devices 0, 2 are stage 0; 1, 3 stage 1.
    step_of = {"a": 0, "b": 1, "c": 2}
    stage_of = {0: 0, 2: 0, 1: 1, 3: 1}
    events = [_ev(n, d, t) for d in (0, 1, 2, 3) for n, t in (("a", 10.0), ("b", 10.0), ("c", 20.0))]
    events.append(_ev("not_a_step", 0, 1000.0))  # outside every step: ignored
    events.append(_ev("a", 7, 1000.0))  # a device that is not on the pipeline's mesh: ignored
    b = measure(events, step_of, stage_of)
    assert (b["stages"], b["steps"], b["work_per_stage"]) == (2, 3, 2)
    # stage 0 idles in step 2 (20 of 40 us), stage 1 in step 0 (10 of 40 us): 2 x 20 + 2 x 10 over 4 x 40
    assert b["measured"] == pytest.approx(60 / 160)
    assert b["per_stage"] == [pytest.approx(0.5), pytest.approx(0.25)]
    assert b["predicted"] == pytest.approx(1 / 3)
    said = "37.5% of the stages' compute went to steps with no work (measured, by stage: 50%, 25%)"
    assert bubble_line(b).startswith(said)
    assert measure([_ev("x", 0, 1.0)], step_of, stage_of) is None


def test_a_pipelined_run_reports_its_bubble_beside_the_schedules(jax_devices, tmp_path):
    from lab.run.pipeline import run_experiment

    path = os.path.join(REPO, "experiments", "pipeline_gpipe2.toml")
    # one warm-up and two profiled steps: the bubble is read from each step's ops, whatever their number
    overrides = {"warmup": 1, "repeats": 2}
    result = run_experiment(path, str(tmp_path / "runs"), quiet=True, hardware="cpu", overrides=overrides)
    b = result.report["pipeline_bubble"]
    # pipeline_gpipe2: 2 stages, 8 microbatches: 9 steps, each stage idle in 1 of them
    assert (b["stages"], b["steps"], b["work_per_stage"]) == (2, 9, 8)
    assert b["predicted"] == pytest.approx(1 / 9)
    assert 0 < b["measured"] < 1 and len(b["per_stage"]) == 2
    assert "pipeline bubble: " in (result.run_dir / "report.md").read_text()
