"""``shardlab explain overlap``: what the compiled schedule (and a run's trace) puts beside each collective, against
what the estimator assumed hidden.

The synthetic modules follow XLA's printed format; every expected number below is worked out by hand from the text
and the events written here. Mesh for axis names: ``{"data": 2, "model": 4}``, device d at (d // 4, d % 4): groups
along model are {0,1,2,3},{4,5,6,7}, along data {0,4},{1,5},{2,6},{3,7}.
"""

from __future__ import annotations

import contextlib
import io
import json
from collections import namedtuple
from dataclasses import replace
from pathlib import Path

import pytest

from lab.cli.main import main
from lab.compile.overlap import Assumed, estimator_view, schedule_overlap, trace_overlap

ROOT = Path(__file__).resolve().parent.parent
EXPERIMENTS = ROOT / "experiments"
MESH = {"data": 2, "model": 4}
DATA = "replica_groups={{0,4},{1,5},{2,6},{3,7}}"
MODEL = "replica_groups={{0,1,2,3},{4,5,6,7}}"

# the entry: an async all-gather over data with one fusion scheduled between start and done, then a synchronous
# all-reduce over model, then a loop of 3 trips whose body has an async all-reduce with a dot and a fusion between
SCHEDULED = f"""HloModule jit_step, is_scheduled=true

%add (x: f32[], y: f32[]) -> f32[] {{
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %sum = f32[] add(%x, %y)
}}

%fused_mul (p0: f32[64]) -> f32[64] {{
  %p0 = f32[64] parameter(0)
  ROOT %m = f32[64] multiply(%p0, %p0)
}}

%body (arg: (s32[], f32[64,64])) -> (s32[], f32[64,64]) {{
  %arg = (s32[], f32[64,64]) parameter(0)
  %i = s32[] get-tuple-element(%arg), index=0
  %w = f32[64,64] get-tuple-element(%arg), index=1
  %all-reduce-start.2 = f32[64,64] all-reduce-start(%w), channel_id=3, {MODEL}, to_apply=%add
  %dot.1 = f32[64,64] dot(%w, %w), lhs_contracting_dims={{1}}, rhs_contracting_dims={{0}}
  %bitcast.1 = f32[64,64] bitcast(%dot.1)
  %fusion.2 = f32[64] fusion(%bitcast.1), kind=kLoop, calls=%fused_mul
  %all-reduce-done.2 = f32[64,64] all-reduce-done(%all-reduce-start.2)
  %one = s32[] constant(1)
  %next = s32[] add(%i, %one)
  ROOT %out = (s32[], f32[64,64]) tuple(%next, %all-reduce-done.2)
}}

%cond (arg.1: (s32[], f32[64,64])) -> pred[] {{
  %arg.1 = (s32[], f32[64,64]) parameter(0)
  %i.1 = s32[] get-tuple-element(%arg.1), index=0
  %three = s32[] constant(3)
  ROOT %lt = pred[] compare(%i.1, %three), direction=LT
}}

ENTRY %main (p: f32[64], q: f32[64,64]) -> (f32[128], f32[64], (s32[], f32[64,64])) {{
  %p = f32[64] parameter(0)
  %q = f32[64,64] parameter(1)
  %all-gather-start.1 = (f32[64], f32[128]) all-gather-start(%p), channel_id=1, {DATA}, dimensions={{0}}
  %fusion.1 = f32[64] fusion(%p), kind=kLoop, calls=%fused_mul
  %copy.1 = f32[64] copy(%fusion.1)
  %all-gather-done.1 = f32[128] all-gather-done(%all-gather-start.1)
  %all-reduce.1 = f32[64] all-reduce(%copy.1), channel_id=2, {MODEL}, to_apply=%add
  %zero = s32[] constant(0)
  %init = (s32[], f32[64,64]) tuple(%zero, %q)
  %while.1 = (s32[], f32[64,64]) while(%init), condition=%cond, body=%body
  ROOT %t = (f32[128], f32[64], (s32[], f32[64,64])) tuple(%all-gather-done.1, %all-reduce.1, %while.1)
}}
"""
PRICES = {"fusion.1": 3e-6, "dot.1": 10e-6, "fusion.2": 2e-6}
VIEW = {
    "all-gather-start.1": Assumed("FSDP: weights", 5e-6, "layer"),
    "all-reduce.1": Assumed("DP gradients", 4e-6, "backward"),
    "all-reduce-start.2": Assumed("TP AllReduces", 45e-6, None),
}


def _by_name(rows):
    return {c.name: c for c in rows}


def test_an_async_pair_overlaps_the_compute_scheduled_between_its_start_and_its_done():
    rows = _by_name(schedule_overlap(SCHEDULED, MESH, PRICES, VIEW))
    assert set(rows) == {"all-gather-start.1", "all-reduce.1", "all-reduce-start.2"}
    ag = rows["all-gather-start.1"]
    # entry positions: p 0, q 1, start 2, fusion.1 3, copy.1 4, done 5; a copy is not compute
    assert (ag.kind, ag.axes, ag.start, ag.done, ag.times) == ("all-gather", ("data",), 2, 5, 1.0)
    assert (ag.start_op, ag.done_op, ag.overlapped_ops) == ("all-gather-start.1", "all-gather-done.1", ("fusion.1",))
    assert ag.bytes == 128 * 4  # an AllGather's V is its output
    assert ag.overlap_s == pytest.approx(3e-6) and ag.exposed_s == pytest.approx(5e-6 - 3e-6)
    assert ag.assumed_hidden and ag.flagged  # 2 us exposed of 5 us is over 5%


def test_a_synchronous_collective_overlaps_nothing_and_is_exposed_in_full():
    ar = _by_name(schedule_overlap(SCHEDULED, MESH, PRICES, VIEW))["all-reduce.1"]
    assert (ar.kind, ar.axes, ar.start, ar.done, ar.overlapped_ops) == ("all-reduce", ("model",), 6, 6, ())
    assert not ar.asynchronous and ar.exposed_s == pytest.approx(4e-6) == ar.time_s
    assert ar.to_dict()["assumed_hidden"] is True and ar.to_dict()["flagged"] is True


def test_a_loop_s_overlap_counts_every_trip_and_an_exposed_estimate_is_never_flagged():
    loop = _by_name(schedule_overlap(SCHEDULED, MESH, PRICES, VIEW))["all-reduce-start.2"]
    # body positions: arg 0, i 1, w 2, start 3, dot 4, bitcast 5, fusion.2 6, done 7; 3 trips of 10 + 2 us
    assert (loop.start, loop.done, loop.times, loop.overlapped_ops) == (3, 7, 3.0, ("dot.1", "fusion.2"))
    assert loop.overlap_s == pytest.approx(3 * 12e-6) and loop.exposed_s == pytest.approx(45e-6 - 36e-6)
    assert loop.assumed_hidden is False and not loop.flagged
    hidden = _by_name(
        schedule_overlap(SCHEDULED, MESH, PRICES, VIEW | {"all-reduce-start.2": Assumed("x", 30e-6, "x")})
    )
    assert hidden["all-reduce-start.2"].exposed_s == 0.0 and not hidden["all-reduce-start.2"].flagged  # 30 < 36 us


# libtpu's async collective: a start fusion, a continuation fusion computing while it is in flight, a done fusion;
# each holds a copy of the all-gather (one channel)
TPU = f"""HloModule jit_step, is_scheduled=true

%start_body (a: bf16[8,32]) -> (bf16[8,32], bf16[16,32]) {{
  %a = bf16[8,32] parameter(0)
  %ag.s = bf16[16,32] all-gather(%a), channel_id=7, {DATA}, dimensions={{0}}
  ROOT %ts = (bf16[8,32], bf16[16,32]) tuple(%a, %ag.s)
}}

%async_collective_fusion.9 (b: bf16[8,32], w: bf16[32,32]) -> (bf16[16,32], bf16[8,32]) {{
  %b = bf16[8,32] parameter(0)
  %w = bf16[32,32] parameter(1)
  %ag.c = bf16[16,32] all-gather(%b), channel_id=7, {DATA}, dimensions={{0}}
  %d = bf16[8,32] dot(%b, %w), lhs_contracting_dims={{1}}, rhs_contracting_dims={{0}}
  ROOT %tc = (bf16[16,32], bf16[8,32]) tuple(%ag.c, %d)
}}

%done_body (c: bf16[16,32]) -> bf16[16,32] {{
  %c = bf16[16,32] parameter(0)
  ROOT %ag.d = bf16[16,32] all-gather(%c), channel_id=7, {DATA}, dimensions={{0}}
}}

ENTRY %main (x: bf16[8,32], w.1: bf16[32,32]) -> bf16[16,32] {{
  %x = bf16[8,32] parameter(0)
  %w.1 = bf16[32,32] parameter(1)
  %async-collective-start = (bf16[8,32], bf16[16,32]) fusion(%x), kind=kCustom, calls=%start_body
  %gte.1 = bf16[8,32] get-tuple-element(%async-collective-start), index=0
  %fusion.9 = (bf16[16,32], bf16[8,32]) fusion(%gte.1, %w.1), kind=kCustom, calls=%async_collective_fusion.9
  %fusion.10 = bf16[32,32] fusion(%w.1), kind=kLoop, calls=%start_body
  %gte.2 = bf16[16,32] get-tuple-element(%fusion.9), index=0
  ROOT %async-collective-done = bf16[16,32] fusion(%gte.2), kind=kCustom, calls=%done_body
}}
"""


def test_libtpu_s_async_collective_fusions_are_one_collective_from_start_to_done():
    (ag,) = schedule_overlap(TPU, MESH, {"fusion.9": 1e-6, "fusion.10": 1e-6})
    # positions: x 0, w.1 1, start 2, gte.1 3, fusion.9 4, fusion.10 5, gte.2 6, done 7
    assert (ag.kind, ag.axes, ag.start, ag.done) == ("all-gather", ("data",), 2, 7)
    assert (ag.start_op, ag.done_op) == ("async-collective-start", "async-collective-done")
    assert ag.overlapped_ops == ("fusion.9", "fusion.10")  # the continuation computes while the gather is in flight
    assert ag.time_s is None and ag.exposed_s is None and ag.assumed_hidden is None  # no estimate joins it


def test_the_estimator_view_splits_an_entry_by_bytes_and_pools_what_xla_lowered_across_kinds():
    ops = {"grads": (8e-6, "backward", 256.0), "loss": (1e-6, None, 4.0), "tp": (6e-6, None, 100.0)}
    entries = [
        {"op": "grads + loss", "instructions": ["all-reduce.1"], "axes": ["model"], "note": ""},
        {"op": "tp", "instructions": ["all-reduce-start.2"], "axes": ["model"], "note": "lowered across kinds: x"},
    ]
    view = estimator_view(entries, ops, SCHEDULED)
    assert view["all-reduce.1"] == Assumed("grads + loss", 9e-6, "backward")  # 256 of 260 bytes hidden
    pooled = [dict(e, note="lowered across kinds: x") for e in entries]
    view = estimator_view(pooled, ops, SCHEDULED)
    # one pool over model: 15 us over 64 * 4 B (all-reduce.1) and 3 trips of 64 * 64 * 4 B (the loop's)
    small, large = 64 * 4, 3 * 64 * 64 * 4
    assert view["all-reduce.1"].time_s == pytest.approx(15e-6 * small / (small + large))
    assert view["all-reduce-start.2"].time_s == pytest.approx(15e-6 * large / (small + large))
    assert view["all-reduce.1"].hidden == "backward"  # 256 of the pool's 360 estimated bytes are hidden


Event = namedtuple("Event", "name device step start_us dur_us")


def _events():
    """Two devices, two steps 100 us apart; per step, microseconds: the all-gather starts at 0 (1 us) and is done
    at 6 (2 us) with fusion.1 between (device 0: 1..6, device 1: 1..8, covering the done); all-reduce.1 at 10 for
    4 us; dot.1 at 14 for 2 us. Idle: 8..10 on both devices. A stray event outside every step is left out."""
    out = [Event("fusion.1", 0, -1, 500.0, 90.0)]
    for step in (0, 1):
        t = 100.0 * step
        for device, fusion in ((0, 5.0), (1, 7.0)):
            out += [
                Event("all-gather-start.1", device, step, t, 1.0),
                Event("fusion.1", device, step, t + 1, fusion),
                Event("all-gather-done.1", device, step, t + 6, 2.0),
                Event("all-reduce.1", device, step, t + 10, 4.0),
                Event("dot.1", device, step, t + 14, 2.0),
            ]
    return out


def test_the_trace_s_exposed_time_is_what_no_other_op_covers_and_idle_gaps_are_what_nothing_runs_in():
    rows = schedule_overlap(SCHEDULED, MESH, PRICES, VIEW)
    t = trace_overlap(_events(), rows, "cpu")
    assert t.steps == 2
    # all-gather span 0..8: device 0 covered 1..6 (exposed 3 us), device 1 covered 1..8 (exposed 1 us)
    assert t.collectives["all-gather-start.1"] == pytest.approx((8e-6, 2e-6))
    assert t.collectives["all-reduce.1"] == pytest.approx((4e-6, 4e-6))
    assert t.idle == {0: pytest.approx((2e-6, 2e-6)), 1: pytest.approx((2e-6, 2e-6))}
    got = t.collectives
    measured = [replace(c, measured_s=got[c.name][0], measured_exposed_s=got[c.name][1]) for c in rows if c.name in got]
    data = t.to_dict(measured)
    assert data["per_axis"]["data"]["exposed_s"] == pytest.approx(2e-6)
    assert data["per_axis"]["model"]["time_s"] == pytest.approx(4e-6)
    assert {c["name"]: c["flagged"] for c in data["collectives"]} == {"all-gather-start.1": True, "all-reduce.1": True}


def _run(argv: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(argv)
        except SystemExit as exc:
            code = exc.code
    return code, out.getvalue(), err.getvalue()


@pytest.fixture(scope="module")
def host_run(jax_devices, tmp_path_factory):
    """train_dp run on the host (1 warm-up, 2 profiled steps), then explained with its run."""
    from lab.run.pipeline import run_experiment

    folder = tmp_path_factory.mktemp("runs")
    exp = EXPERIMENTS / "train_dp.toml"
    result = run_experiment(str(exp), str(folder), quiet=True, hardware="cpu", overrides={"warmup": 1, "repeats": 2})
    code, out, err = _run(["explain", "overlap", str(exp), "--run", str(result.run_dir), "--json"])
    assert code == 0, err
    return json.loads(out), result.run_dir


def test_on_the_host_every_collective_is_synchronous_and_exposed(host_run):
    data, _ = host_run
    assert data["backend"] == "cpu" and data["synchronous"] is True
    rows = data["collectives"]
    # train_dp: gradient AllReduces over both mesh axes (and the loss mean): nothing else communicates
    assert rows and {(c["kind"], tuple(c["axes"])) for c in rows} == {("all-reduce", ("data", "model"))}
    for c in rows:
        assert c["start"] == c["done"] and c["overlapped_ops"] == [] and not c["asynchronous"]
        assert c["exposed_s"] == c["time_s"]
    hidden = [c for c in rows if c["assumed_hidden"]]
    assert hidden and all(c["hidden_under"] == "backward" and c["flagged"] for c in hidden)  # DP: behind the backward
    assert set(data["flagged"]) == {c["name"] for c in hidden}


def test_the_host_run_s_trace_is_read_against_the_same_schedule(host_run):
    data, _ = host_run
    t = data["trace"]
    assert t["same_schedule"] is True and t["backend"] == "cpu" and t["steps"] == 2
    assert {c["name"] for c in t["collectives"]} == {c["name"] for c in data["collectives"]}
    for c in data["collectives"]:
        assert 0 < c["measured_exposed_s"] <= c["measured_s"]
    assert len(t["idle"]) == 8 and all(d["idle_s"] >= 0 for d in t["idle"])
    assert t["pipeline_bubble"] is None  # train_dp does not pipeline


def test_the_table_says_plainly_that_xla_cpu_collectives_are_synchronous(host_run):
    _, run_dir = host_run
    code, out, err = _run(["explain", "overlap", str(EXPERIMENTS / "train_dp.toml"), "--run", str(run_dir)])
    assert code == 0, err
    assert "XLA:CPU's collectives are synchronous" in out and "FLAGGED" in out and "idle gaps:" in out


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (["--target", "v9x:2x4"], "unknown TPU generation"),
        (["--run", "/nonexistent/run"], "is not a folder"),
        (["--run", str(ROOT / "experiments")], "is not a finished run"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(argv, said):
    code, out, err = _run(["explain", "overlap", str(EXPERIMENTS / "train_dp.toml"), *argv])
    assert code == 2 and out == "" and said in err and len(err.strip().splitlines()) == 1, err


def test_a_run_of_another_program_is_refused(tmp_path):
    (tmp_path / "tensorboard").mkdir()
    (tmp_path / "hlo.txt").write_text("HloModule x\n")
    (tmp_path / "report.json").write_text(json.dumps({"kernel": "tp_mlp", "mesh": {"X": 2, "Y": 4}}))
    code, _, err = _run(["explain", "overlap", str(EXPERIMENTS / "train_dp.toml"), "--run", str(tmp_path)])
    assert code == 2 and "ran tp_mlp" in err and "not train_dp" in err and len(err.strip().splitlines()) == 1


def test_a_program_that_does_not_compile_is_one_line_and_exit_2(jax_devices, monkeypatch):
    import jax

    import lab.compile.audit

    def refuse(plan, target=None):
        raise jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: the program needs 9 TiB\nmore detail")

    monkeypatch.setattr(lab.compile.audit, "compile_plan", refuse)
    code, out, err = _run(["explain", "overlap", str(EXPERIMENTS / "train_dp.toml")])
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1
    assert "train_dp does not compile on this host: RESOURCE_EXHAUSTED: the program needs 9 TiB" in err


@pytest.mark.slow
def test_a_tpu_schedule_overlaps_its_permutes_and_shows_the_fsdp_gathers_exposed():
    """train_fsdp_tp cross-compiled for v5e:2x4: libtpu leaves the small FSDP gathers synchronous, which the
    estimator hides behind the layer's compute; the padded reduce-scatter's overhang permutes are async pairs."""
    pytest.importorskip("libtpu")
    argv = ["explain", "overlap", str(EXPERIMENTS / "train_fsdp_tp.toml"), "--target", "v5e:2x4", "--dtype", "bf16"]
    code, out, err = _run([*argv, "--json"])
    assert code == 0, err
    data = json.loads(out)
    assert data["compiled_for"] == "v5e:2x4" and data["synchronous"] is False
    permutes = [c for c in data["collectives"] if c["kind"] == "permute"]
    assert permutes and all(c["asynchronous"] and c["done"] > c["start"] and c["overlapped_ops"] for c in permutes)
    gathers = [c for c in data["collectives"] if c["kind"] == "all-gather"]
    assert gathers and all(c["assumed_hidden"] and c["flagged"] and not c["asynchronous"] for c in gathers)
