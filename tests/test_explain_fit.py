"""``shardlab explain memory --fit``: the ladder of fixes compiled until one fits, and the largest batch per remat
policy. Every verdict the tests hold it to comes from an independent compile (``compile_plan`` + ``xla_peak``) or
from numbers worked by hand, never from the code under test."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest
from cli_runner import run_cli

from lab.core.hardware import get_chip
from lab.run.experiment import load_experiment

EXPERIMENTS = Path(__file__).resolve().parent.parent / "experiments"
TRAIN = str(EXPERIMENTS / "train_fsdp_tp.toml")
DECODE = str(EXPERIMENTS / "decode_tp.toml")
HBM = 1_000_000  # train_fsdp_tp as written holds 1.32 MB per device on the host, with selective remat 834 kB


def _xla_bytes(plan) -> float:
    """XLA's bytes per device of the Plan's program, compiled here, apart from the ladder."""
    from lab.compile.audit import compile_plan
    from lab.compile.memory import xla_peak

    return xla_peak(compile_plan(plan)[1])[0]


def _counting(monkeypatch) -> list[str]:
    """Every Plan :mod:`lab.compile.fit` compiles, as its TOML text, in order."""
    import lab.compile.fit as fit

    seen: list[str] = []
    real = fit.compile_plan

    def counted(plan, target=None):
        seen.append(plan.to_toml())
        return real(plan, target)

    monkeypatch.setattr(fit, "compile_plan", counted)
    return seen


def _one_line(code: int, err: str) -> str:
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


# ----- the ladder, compiled ----------------------------------------------------------------------------------------


def test_a_plan_that_does_not_fit_gets_a_fix_that_recompiled_fits(jax_devices, monkeypatch):
    """The CLI names the cheapest rung that fits; the test builds that Plan itself from the named changes and
    compiles it: it fits, and the Plan as written does not. (The batch search is held to its own test below.)"""
    import lab.compile.fit as fit

    monkeypatch.setattr(fit, "_batches", lambda *a: iter(()))
    seen = _counting(monkeypatch)
    code, out, err = run_cli(["explain", "memory", TRAIN, "--fit", "--hbm", str(HBM), "--json"])
    assert code == 0, err
    got = json.loads(out)
    assert got["hbm_bytes"] == HBM and got["answer"] == "remat selective"
    assert got["answer_changes"] == {"remat": "selective"}
    plan = load_experiment(TRAIN).plan
    as_written, fixed = _xla_bytes(plan), _xla_bytes(dataclasses.replace(plan, remat="selective"))
    assert as_written > HBM >= fixed
    rungs = {r["name"]: r for r in got["rungs"]}
    assert rungs["as written"]["status"] == "does not fit" and rungs["as written"]["xla_bytes"] == as_written
    assert rungs["remat selective"]["status"] == "fits" and rungs["remat selective"]["xla_bytes"] == fixed
    assert rungs["remat full"]["status"] == "not compiled"  # the ladder stops at the first that fits
    assert rungs["offload"]["status"] == "not available"
    from lab.predict.program.estimate import estimate_program

    est = estimate_program(plan, get_chip("cpu")).memory["total"]
    assert rungs["as written"]["estimated_bytes"] == est and rungs["as written"]["estimator_fits"] == (est <= HBM)
    assert len(seen) == len(set(seen)) == got["compiles"] == 2  # as written, then selective: each once


def test_the_batch_search_compiles_each_plan_once_and_its_answer_is_the_last_that_fits(jax_devices, monkeypatch):
    """decode_tp (one policy: decode has no backward pass): the rung as written is the search's first point,
    read back, not compiled again; the largest batch fits and the next multiple of the data axis does not."""
    from lab.compile.fit import Compiles, fit_ladder

    plan = load_experiment(DECODE).plan
    hbm = 1.5 * _xla_bytes(plan)  # room for about half as many sequences again (the weights are a floor)
    seen = _counting(monkeypatch)
    cache = Compiles()
    result = fit_ladder(plan, get_chip("cpu"), hbm=hbm, cache=cache)
    assert result.rungs[result.answer].name == "as written"
    (batch,) = result.batches
    assert batch.policy == "none" and batch.step == 2  # batch over data = 2
    assert len(seen) == len(set(seen)) == result.compiles == len(batch.tried)  # the rung's own compile included
    assert result.reused >= 1 and plan.sizes["batch"] in batch.tried
    b = batch.xla
    assert b is not None and b % 2 == 0 and not batch.capped

    def at(n):
        return dataclasses.replace(plan, sizes={**plan.sizes, "batch": n})

    assert _xla_bytes(at(b)) <= hbm < _xla_bytes(at(b + 2))
    again = fit_ladder(plan, get_chip("cpu"), hbm=hbm, cache=cache)  # the same cache: nothing compiles again
    assert again.compiles == result.compiles and len(seen) == result.compiles


def test_no_fix_that_fits_is_one_line_and_exit_2(jax_devices):
    code, _, err = run_cli(["explain", "memory", DECODE, "--fit", "--hbm", "1000"])
    line = _one_line(code, err)
    assert "no fix on the ladder fits" in line and "1 kB per device" in line and "Traceback" not in line


@pytest.mark.parametrize(
    ("extra", "says"), [(["--hbm", "1e6"], "--hbm"), (["--fit", "--png", "fit.png"], "--png")], ids=["hbm", "png"]
)
def test_hbm_without_fit_and_png_with_fit_are_refused_in_one_line(extra, says, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code, _, err = run_cli(["explain", "memory", TRAIN, *extra])
    assert says in _one_line(code, err)


# ----- the rungs, JAX-free -----------------------------------------------------------------------------------------


def _rungs(path: str, target=None) -> dict:
    from lab.compile.fit import ladder

    return {s.name: s for s in ladder(load_experiment(EXPERIMENTS / path).plan, target)}


def test_more_fsdp_puts_the_weights_on_every_data_parallel_axis_over_full_remat():
    steps = _rungs("train_dp.toml")  # preset dp: batch over data and model, weights replicated
    fsdp = steps["more FSDP"]
    assert fsdp.plan is not None and fsdp.plan.rules.axes("embed") == ("data", "model")
    assert fsdp.plan.remat == "full" and fsdp.changes == {"remat": "full", "rules.embed": ["data", "model"]}
    assert fsdp.plan.degrees()["fsdp"] == 8 and fsdp.plan.degrees()["dp"] == 1
    skipped = _rungs("train_fsdp_tp.toml")["more FSDP"]  # weights already over data, the only batch axis
    assert skipped.plan is None and "already" in skipped.why_not


def test_a_smaller_microbatch_only_where_the_layers_are_pipelined():
    steps = _rungs("train_pipe_dp_tp.toml")  # microbatch = 2 sequences per replica
    micro = steps["smaller microbatch"]
    assert micro.plan is not None and micro.plan.options.microbatch == 1 and micro.plan.microbatches() == 8
    assert _rungs("train_fsdp_tp.toml")["smaller microbatch"].plan is None
    decode = _rungs("decode_tp.toml")
    assert decode["remat selective"].plan is None and "no backward pass" in decode["remat selective"].why_not


def test_the_next_topology_doubles_the_chips_and_the_data_axis():
    from lab.compile.target import parse_target

    step = _rungs("train_fsdp_tp.toml", parse_target("v5e:2x4"))["next topology"]
    assert step.target.name == "v5e:4x4" and step.plan.shape == {"data": 4, "model": 4}
    assert step.changes == {"remat": "full", "target": "v5e:4x4", "mesh.data": 4}
    assert _rungs("train_fsdp_tp.toml")["next topology"].plan is None  # the host's devices do not grow


# ----- the search, on memory worked by hand ------------------------------------------------------------------------


def _oracle(memory):
    calls: list[int] = []

    def f(b: int) -> float:
        calls.append(b)
        return memory(b)

    return f, calls


@pytest.mark.parametrize("start", [2, 8, 64, 200])
def test_the_largest_batch_of_a_straight_line_is_found_in_a_few_compiles(start):
    from lab.compile.fit import largest_batch

    f, calls = _oracle(lambda b: 100 + 10 * b)  # fits 555 up to b = 45.5: the largest even batch is 44
    assert largest_batch(f, 555, 2, start) == (44, False)
    assert len(calls) <= 4 and len(set(calls)) == len(calls) and all(c % 2 == 0 for c in calls)


def test_the_search_bisects_where_memory_is_not_a_line():
    from lab.compile.fit import largest_batch

    f, calls = _oracle(lambda b: b**3)  # 1000**3 <= 1e9 < 1004**3: the largest multiple of 4 is 1000
    assert largest_batch(f, 1e9, 4, 8) == (1000, False)
    # the line through 8 and 16 overshoots to 2.2M: a bracket of 2**19 steps, closed in a few bisections' worth
    assert len(calls) <= 2 * math.ceil(math.log2(2232148 / 4)) and len(set(calls)) == len(calls)
    f, calls = _oracle(lambda b: 1e6 if b < 40 else math.inf)  # a step (a program the compiler refuses)
    assert largest_batch(f, 1e7, 8, 8) == (32, False)


def test_the_search_says_none_fits_and_stops_at_its_cap():
    from lab.compile.fit import largest_batch

    assert largest_batch(lambda b: 1e9, 1e6, 2, 8) == (None, False)
    assert largest_batch(lambda b: 1.0, 1e6, 2, 8, cap=64) == (128, True)


# ----- the whole command, real size of the search ------------------------------------------------------------------


@pytest.mark.slow
def test_every_policy_s_largest_batch_fits_and_the_next_does_not(jax_devices):
    code, out, err = run_cli(["explain", "memory", TRAIN, "--fit", "--hbm", str(HBM), "--json"])
    assert code == 0, err
    got = json.loads(out)
    plan = load_experiment(TRAIN).plan
    assert [b["policy"] for b in got["batches"]] == ["none", "selective", "full"]
    for b in got["batches"]:
        n = b["xla"]

        def at(batch, policy=b["policy"]):
            return dataclasses.replace(plan, remat=policy, sizes={**plan.sizes, "batch": batch})

        assert n is not None and _xla_bytes(at(n)) <= HBM < _xla_bytes(at(n + b["step"])), b
    # the two rungs compiled (as written, selective) are their policies' first points, read back; remat full was
    # not compiled as a rung (a cheaper one fits) but its search compiled it at the Plan's batch: the rung shows it
    assert got["reused"] == 2
    full = next(r for r in got["rungs"] if r["name"] == "remat full")
    assert full["xla_bytes"] == _xla_bytes(dataclasses.replace(plan, remat="full")) and "batch search" in full["note"]


@pytest.mark.slow
def test_for_a_tpu_the_next_topology_is_named_and_recompiled_it_fits(jax_devices, monkeypatch):
    """Cross-compiled for v5e:2x4 in bf16 the tiny model holds about 4.6 MB per device whatever its remat; at 4.6 MB
    only twice the chips (v5e:4x4, data = 4) fits. The test compiles that Plan for v5e:4x4 itself."""
    pytest.importorskip("libtpu")
    import lab.compile.fit as fit
    from lab.compile.audit import compile_plan
    from lab.compile.memory import xla_peak
    from lab.compile.target import parse_target
    from lab.core.plan import make_mesh_axes

    monkeypatch.setattr(fit, "_batches", lambda *a: iter(()))
    hbm = 4_600_000
    argv = ["explain", "memory", TRAIN, "--target", "v5e:2x4", "--dtype", "bf16", "--fit", "--hbm", str(hbm), "--json"]
    code, out, err = run_cli(argv)
    assert code == 0, err
    got = json.loads(out)
    assert got["answer"] == "next topology"
    assert got["answer_changes"] == {"remat": "full", "target": "v5e:4x4", "mesh.data": 4}
    from lab.run.overrides import override

    plan, _ = override(load_experiment(TRAIN).plan, dtype="bf16")
    plan = dataclasses.replace(plan, hardware="tpu-v5e")

    def tpu(p, name):
        return xla_peak(compile_plan(p, parse_target(name))[1])[0]

    assert all(tpu(dataclasses.replace(plan, remat=r), "v5e:2x4") > hbm for r in ("none", "selective", "full"))
    grown = dataclasses.replace(plan, remat="full", mesh=make_mesh_axes({"data": 4, "model": 4}))
    assert tpu(grown, "v5e:4x4") <= hbm
