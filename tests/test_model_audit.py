"""The JAX Transformer's compiled train step against the training estimator's collectives and memory."""

import math

import pytest

MESHES = [{"data": 2, "model": 4}, {"data": 4, "model": 2}]
RULES = ["dp", "fsdp", "tp", "tp_sp", "fsdp_tp"]


@pytest.mark.parametrize("mesh", MESHES, ids=lambda m: f"{m['data']}x{m['model']}")
@pytest.mark.parametrize("rules", RULES)
def test_train_step_collectives_match_the_estimator(jax_devices, rules, mesh):
    from kernels.transformer import TINY
    from lab.compile.model_audit import audit_train

    r = audit_train(TINY, rules, mesh, batch=8, seq=32, remat="none")
    assert r.all_match, r.table()
    kinds = {e.kind for e in r.entries}
    expected = {
        "dp": {"all-reduce"},
        "fsdp": {"all-gather", "reduce-scatter", "all-reduce"},
        "tp": {"all-reduce"},
        "tp_sp": {"all-gather", "reduce-scatter", "all-reduce"},
        "fsdp_tp": {"all-gather", "reduce-scatter", "all-reduce"},
    }[rules]
    assert kinds == expected
    # Memory: compiled and estimated side by side, with their ratio.
    m = r.memory
    assert m["compiled_bytes"] > 0 and m["estimator_bytes"] > 0
    assert math.isclose(m["ratio"], m["compiled_bytes"] / m["estimator_bytes"])


def test_remat_policies_order_memory_in_the_estimator_and_the_compiler(jax_devices):
    from kernels.transformer import TINY
    from lab.compile.model_audit import audit_train

    runs = {
        remat: audit_train(TINY, "tp", MESHES[0], batch=8, seq=32, remat=remat)
        for remat in ("none", "selective", "full")
    }
    est = [runs[k].memory["estimator_activation_bytes"] for k in ("none", "selective", "full")]
    temp = [runs[k].memory["compiled_temp_bytes"] for k in ("none", "selective", "full")]
    assert est[0] > est[1] > est[2]
    assert temp[0] > temp[2] and temp[0] >= temp[1] >= temp[2]
