"""The Transformer's compiled programs against the estimators' own collectives, FLOPs and memory (one cost model)."""

import math

import pytest

from lab.core.hardware import get_chip
from lab.core.plan import Plan, make_mesh_axes
from lab.core.rules import get_rules

MESHES = [{"data": 2, "model": 4}, {"data": 4, "model": 2}]
RULES = ["dp", "fsdp", "tp", "tp_sp", "fsdp_tp"]


def train_plan(rules: str, mesh: dict[str, int], remat: str = "none", batch: int = 8, seq: int = 32) -> Plan:
    from kernels.transformer import TINY

    return Plan(
        program="train_step",
        mesh=make_mesh_axes(mesh),
        sizes={"batch": batch, "seq": seq},
        name=f"train-{rules}",
        hardware="cpu",
        model=TINY,
        rules=get_rules(rules),
        rules_preset=rules,
        remat=remat,
    )


# Every preset on 2 x 4; on 4 x 2 tensor parallelism alone by default, every preset under -m slow (5-8 s each from
# a fresh clone).
@pytest.mark.parametrize(
    ("rules", "mesh"),
    [
        pytest.param(
            r, m, id=f"{r}-{m['data']}x{m['model']}", marks=() if m is MESHES[0] or r == "tp" else pytest.mark.slow
        )
        for r in RULES
        for m in MESHES
    ],
)
def test_train_step_matches_the_training_estimator(jax_devices, rules, mesh):
    from lab.compile.audit import audit_plan

    r = audit_plan(train_plan(rules, mesh), get_chip("cpu"))
    assert r.all_match, r.table()
    assert r.source == "training estimator"
    kinds = {e.kind for e in r.entries}
    expected = {
        "dp": {"all-reduce"},
        "fsdp": {"all-gather", "reduce-scatter", "all-reduce"},
        "tp": {"all-reduce"},
        "tp_sp": {"all-gather", "reduce-scatter", "all-reduce"},
        "fsdp_tp": {"all-gather", "reduce-scatter", "all-reduce"},
    }[rules]
    assert kinds == expected
    # The estimator's matmul and attention FLOPs are what XLA's dots do (forward and backward, within 1%).
    assert r.flops_match and r.flops_predicted > 0
    # Memory: compiled and estimated side by side, with their ratio.
    m = r.memory
    assert m["compiled_bytes"] > 0 and m["estimator_bytes"] > 0
    assert math.isclose(m["ratio"], m["compiled_bytes"] / m["estimator_bytes"])


def test_remat_policies_order_memory_in_the_estimator_and_the_compiler(jax_devices):
    from lab.compile.audit import audit_plan

    runs = {
        remat: audit_plan(train_plan("tp", MESHES[0], remat), get_chip("cpu"))
        for remat in ("none", "selective", "full")
    }
    est = [runs[k].memory["estimator_activation_bytes"] for k in ("none", "selective", "full")]
    temp = [runs[k].memory["compiled_temp_bytes"] for k in ("none", "selective", "full")]
    assert est[0] > est[1] > est[2]
    assert temp[0] > temp[2] and temp[0] >= temp[1] >= temp[2]


# By default one layout per policy: full recomputation under fsdp_tp (the third gather of the norm scales is
# FSDP's) and selective under tp_sp; the other two pairs under -m slow (6-7 s of XLA each on 2 cores).
@pytest.mark.parametrize(
    ("rules", "remat"),
    [
        ("fsdp_tp", "full"),
        ("tp_sp", "selective"),
        pytest.param("fsdp_tp", "selective", marks=pytest.mark.slow),
        pytest.param("tp_sp", "full", marks=pytest.mark.slow),
    ],
)
def test_recomputed_train_steps_match_too(jax_devices, rules, remat):
    """jax.checkpoint as XLA compiles it: full recomputation leaves the layer's last projection (its matmul and its
    row-parallel collective) out of the recomputed forward, and FSDP gathers the norm scales a third time."""
    from lab.compile.audit import audit_plan

    r = audit_plan(train_plan(rules, MESHES[0], remat), get_chip("cpu"))
    assert r.all_match, r.table()
    if rules == "fsdp_tp":
        (ag,) = [e for e in r.entries if e.kind == "all-gather"]
        assert "norm scales again, for the recomputation" in ag.op


@pytest.mark.parametrize("rules", ["tp", "dp", "single"])
def test_decode_matches_the_inference_estimator(jax_devices, rules):
    from kernels.transformer import TINY
    from lab.compile.audit import audit_plan

    plan = Plan(
        program="decode",
        mesh=make_mesh_axes({"data": 2, "model": 4}),
        sizes={"batch": 8, "prompt_len": 16, "steps": 8},
        hardware="cpu",
        dtype="bf16",
        model=TINY,
        rules=get_rules(rules),
    )
    r = audit_plan(plan, get_chip("cpu"))
    assert r.all_match, r.table()
    assert r.source == "inference estimator"
    # tp: per layer two AllReduces of [B, D] per token, the vocab-parallel embedding's AllReduce and the greedy
    # sampling's AllGather; dp and single: nothing at all.
    assert {e.kind for e in r.entries} == ({"all-reduce", "all-gather"} if rules == "tp" else set())
