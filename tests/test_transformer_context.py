"""The Transformer's train step with its sequence split over a mesh axis (rules ``context = "ctx"``: context
parallelism as GSPMD compiles it, K and V gathered for attention), on 8 emulated CPU devices: loss and gradients
against one device on several meshes, presets and remat policies, and the audit of the experiment against the
training estimator with hand-counted gathers.

Tolerances are test_transformer.py's, fixed before the first run: loss rtol 1e-5 / atol 1e-5, gradients rtol 1e-4 /
atol 1e-5.
"""

from __future__ import annotations

import dataclasses
import os

import numpy as np
import pytest

LOSS_RTOL, LOSS_ATOL = 1e-5, 1e-5
GRAD_RTOL, GRAD_ATOL = 1e-4, 1e-5
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
B, T = 8, 32

# (mesh, rules preset, remat): ctx x data x model with TP, ctx x data with DP, ctx x model with TP and sequence
# parallelism (T over ctx and model between blocks), ctx x data with FSDP
CASES = {
    "ctx2_data2_model2_tp": ({"ctx": 2, "data": 2, "model": 2}, "tp", "none"),
    "ctx4_data2_dp": ({"ctx": 4, "data": 2, "model": 1}, "dp", "none"),
    "ctx2_model4_tp_sp_full": ({"ctx": 2, "data": 1, "model": 4}, "tp_sp", "full"),
    "ctx2_data4_fsdp_selective": ({"ctx": 2, "data": 4, "model": 1}, "fsdp", "selective"),
}


# Two meshes in the default suite, all four under -m slow (the suite's 10 minutes on two cores, from a fresh clone).
@pytest.mark.parametrize(
    "case", [c if c in list(CASES)[:2] else pytest.param(c, marks=pytest.mark.slow) for c in CASES]
)
def test_loss_and_grads_match_one_device(jax_devices, case):
    import jax

    from kernels.mesh import make_mesh
    from kernels.transformer import TINY
    from kernels.transformer.loss import loss_fn
    from kernels.transformer.model import init_params, synthetic_tokens, token_sharding
    from kernels.transformer.train import make_grads_fn
    from lab.core.rules import get_rules

    shape, preset, remat = CASES[case]
    rules = dataclasses.replace(get_rules(preset), context="ctx")
    mesh = make_mesh(shape)
    params = init_params(TINY, rules, mesh, jax.random.key(2))
    tokens = synthetic_tokens(TINY, B, T, seed=2)
    loss, grads = make_grads_fn(TINY, rules, mesh, remat)(params, jax.device_put(tokens, token_sharding(rules, mesh)))
    ref_loss, ref_grads = jax.value_and_grad(loss_fn)(jax.tree.map(np.asarray, params), tokens, TINY)
    np.testing.assert_allclose(float(loss), float(ref_loss), rtol=LOSS_RTOL, atol=LOSS_ATOL)
    for got, want in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads), strict=True):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=GRAD_RTOL, atol=GRAD_ATOL)


# train_cp_dp_tp: each device holds 4 sequences (data = 2) x 16 positions (ctx = 2) and 2 of the 4 KV heads
# (model = 2): one of K and V gathered whole is [4, 32, 2, 12] float32 = 12,288 bytes; K and V, forward and
# again backward, in each of the 2 layers. Their gradients: 2 x 12,288 bytes a layer.
GATHERS = 4 * 2 * 4 * 32 * 2 * 12 * 4
KV_GRADS = 2 * 2 * 4 * 32 * 2 * 12 * 4


def test_experiment_audit_matches_the_estimator_with_hand_counted_gathers(jax_devices):
    from lab.compile.audit import audit_plan
    from lab.core.hardware import get_chip
    from lab.predict.program.estimate import estimate_program
    from lab.run.experiment import load_experiment

    exp = load_experiment(os.path.join(REPO, "experiments", "train_cp_dp_tp.toml"))
    assert exp.plan.degrees()["cp"] == 2
    r = audit_plan(exp.plan, get_chip("cpu"))
    assert r.all_match and not r.unexpected, r.table()
    by = {(e.kind, e.axes): e for e in r.entries}
    assert set(by) == {("all-reduce", ("model",)), ("all-gather", ("ctx",)), ("all-reduce", ("ctx",)),
                       ("all-reduce", ("data",))}  # fmt: skip
    gathers = by[("all-gather", ("ctx",))]
    assert gathers.predicted_bytes == gathers.compiled_bytes == GATHERS
    # over ctx: the K and V gradients, and the weight gradients (the same bytes as over data) with the loss
    over_ctx, over_data = by[("all-reduce", ("ctx",))], by[("all-reduce", ("data",))]
    assert over_ctx.compiled_bytes == over_ctx.predicted_bytes == KV_GRADS + over_data.compiled_bytes
    assert r.flops_compiled == pytest.approx(r.flops_predicted, rel=1e-9)
    assert "collective-permute(" not in r.hlo_text and "all-to-all(" not in r.hlo_text  # no shifts across shards
    names = [o.name for o in estimate_program(exp.plan, get_chip("cpu")).ops]
    assert "CP: K and V gathered over the context shards, forward and again backward" in names


# By default each experiment under one policy (the pipeline fully recomputed, the context shards selectively);
# the other two pairs under -m slow (5-10 s of XLA each on 2 cores).
@pytest.mark.parametrize(
    ("path", "remat"),
    [
        ("train_pipe_dp_tp.toml", "full"),
        ("train_cp_dp_tp.toml", "selective"),
        pytest.param("train_pipe_dp_tp.toml", "selective", marks=pytest.mark.slow),
        pytest.param("train_cp_dp_tp.toml", "full", marks=pytest.mark.slow),
    ],
)
def test_recomputed_context_and_pipeline_steps_still_audit_whole(jax_devices, path, remat):
    """Under recomputation the context shards' gathers stay four a layer (the recomputed forward's serve the
    backward) and the pipeline's collectives are unchanged: every collective and the FLOPs still match."""
    from lab.compile.audit import audit_plan
    from lab.core.hardware import get_chip
    from lab.run.experiment import load_experiment

    plan = dataclasses.replace(load_experiment(os.path.join(REPO, "experiments", path)).plan, remat=remat)
    r = audit_plan(plan, get_chip("cpu"))
    assert r.all_match and not r.unexpected, r.table()
    assert r.flops_compiled == pytest.approx(r.flops_predicted, rel=1e-9)


@pytest.mark.parametrize(
    ("mesh", "rules", "seq", "match"),
    [
        ({"ctx": 2, "data": 2, "model": 2}, {"context": "ctx"}, 31, r"seq=31 .* ctx \(2\); .* seq=30"),
        ({"ctx": 2, "data": 1, "model": 4}, {"context": "ctx", "sequence": "model"}, 36, r"ctx x model \(8\)"),
        ({"ctx": 2, "pipe": 2, "data": 2}, {"context": "ctx", "layers": "pipe"}, 32, r"context and pipeline"),
    ],
)
def test_bad_context_plans_are_refused_before_compiling(mesh, rules, seq, match):
    from lab.core.errors import UserError
    from lab.core.plan import make_mesh_axes
    from lab.run.experiment import load_experiment

    plan = load_experiment(os.path.join(REPO, "experiments", "train_cp_dp_tp.toml")).plan
    mesh = {**mesh, **{a: 1 for a in ("data", "model") if a not in mesh}}
    bad = dataclasses.replace(
        plan,
        mesh=make_mesh_axes(mesh),
        sizes={**plan.sizes, "seq": seq},
        rules=dataclasses.replace(plan.rules, **rules),
        options=dataclasses.replace(plan.options, pp_schedule="gpipe" if "layers" in rules else "1f1b"),
    )
    with pytest.raises(UserError, match=match):
        bad.validate()
