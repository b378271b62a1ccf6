"""The Transformer's train step with its layers pipelined over a mesh axis (rules ``layers = "pipe"``), on 8
emulated CPU devices: loss and gradients against one device on several meshes and remat policies, the audit of
the experiment against the training estimator with hand-counted sends, and bad plans refused before compiling.

Tolerances are test_transformer.py's, fixed before the first run: loss rtol 1e-5 / atol 1e-5 (float32 sums in
another order), gradients rtol 1e-4 / atol 1e-5 (partial sums reduced in another order).
"""

from __future__ import annotations

import dataclasses
import os

import numpy as np
import pytest

from lab.core.errors import UserError

LOSS_RTOL, LOSS_ATOL = 1e-5, 1e-5
GRAD_RTOL, GRAD_ATOL = 1e-4, 1e-5
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
B, T = 16, 32

# (mesh, rules preset, microbatches, remat): pipe x data x model, pipe x data, pipe x model (SP), and remat
CASES = {
    "pipe2_data2_model2_tp_M4": ({"pipe": 2, "data": 2, "model": 2}, "tp", 4, "none"),
    "pipe4_data2_dp_M2": ({"pipe": 4, "data": 2, "model": 1}, "dp", 2, "none"),
    "pipe2_model4_tp_sp_M2_full": ({"pipe": 2, "data": 1, "model": 4}, "tp_sp", 2, "full"),
    "pipe2_data4_dp_M1_selective": ({"pipe": 2, "data": 4, "model": 1}, "dp", 1, "selective"),
}


def _model(layers: int = 4):
    from kernels.transformer import TINY

    return dataclasses.replace(TINY, layers=layers)


def _reference(cfg, params, tokens):
    import jax

    from kernels.transformer.loss import loss_fn

    host = jax.tree.map(np.asarray, params)
    return jax.value_and_grad(loss_fn)(host, np.asarray(tokens), cfg)


# pipe x data x model in the default suite (16 s cold), all four under -m slow (the suite's 10 minutes on two
# cores, from a fresh clone).
@pytest.mark.parametrize(
    "case", [c if c in list(CASES)[:1] else pytest.param(c, marks=pytest.mark.slow) for c in CASES]
)
def test_loss_and_grads_match_one_device(jax_devices, case):
    import jax

    from kernels.mesh import make_mesh
    from kernels.transformer.model import init_params, synthetic_tokens, token_sharding
    from kernels.transformer.train import make_grads_fn
    from lab.core.rules import get_rules

    shape, preset, m, remat = CASES[case]
    cfg = _model(layers=8 if shape["pipe"] == 4 else 4)
    rules = dataclasses.replace(get_rules(preset), layers="pipe")
    mesh = make_mesh(shape)
    params = init_params(cfg, rules, mesh, jax.random.key(1))
    tokens = synthetic_tokens(cfg, B, T, seed=1)
    loss, grads = make_grads_fn(cfg, rules, mesh, remat, microbatches=m)(
        params, jax.device_put(tokens, token_sharding(rules, mesh))
    )
    ref_loss, ref_grads = _reference(cfg, params, tokens)
    np.testing.assert_allclose(float(loss), float(ref_loss), rtol=LOSS_RTOL, atol=LOSS_ATOL)
    for got, want in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads), strict=True):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=GRAD_RTOL, atol=GRAD_ATOL)
    assert float(np.abs(np.asarray(grads["layers"]["wq"])).min(axis=(1, 2, 3)).min()) > 0  # every stage's layers


# train_pipe_dp_tp: p = 2, M = 4 microbatches of 2 sequences per data replica: 4 + 2 - 2 = 4 sends each way, each a
# microbatch's [2, 32, 56] float32 activations (whole on every model rank: no sequence parallelism). Over the
# stages, the gradients of both [88 / 2, 56] tables and the [56] final norm, and the float32 loss.
SENDS = 8 * 2 * 32 * 56 * 4
ENDS = (2 * 44 * 56 + 56) * 4 + 4


def test_experiment_audit_matches_the_estimator_with_hand_counted_sends(jax_devices):
    from lab.compile.audit import audit_plan
    from lab.core.hardware import get_chip
    from lab.run.experiment import load_experiment

    exp = load_experiment(os.path.join(REPO, "experiments", "train_pipe_dp_tp.toml"))
    assert exp.plan.microbatches() == 4 and exp.plan.degrees()["pp"] == 2
    r = audit_plan(exp.plan, get_chip("cpu"))
    assert r.all_match and not r.unexpected, r.table()
    by = {(e.kind, e.axes): e for e in r.entries}
    assert set(by) == {("all-reduce", ("model",)), ("permute", ("pipe",)), ("all-reduce", ("pipe",)),
                       ("all-reduce", ("data",))}  # fmt: skip
    sends = by[("permute", ("pipe",))]
    assert sends.predicted_bytes == sends.compiled_bytes == SENDS and len(sends.instructions) == 8
    assert by[("all-reduce", ("pipe",))].compiled_bytes == by[("all-reduce", ("pipe",))].predicted_bytes == ENDS
    assert r.flops_compiled == pytest.approx(r.flops_predicted, rel=1e-9)


def test_the_estimate_counts_the_idle_steps_the_spmd_pipeline_computes():
    """5 steps of each stage's 2 layers for 4 microbatches: the FLOPs of 5/4 of the layer work, the bubble the
    same (p - 1) / (M + p - 1) = 1/5 of the step as GPipe's; Megatron's pipeline (spmd_pipeline off) computes 4."""
    from lab.core.hardware import get_chip
    from lab.predict.program.estimate import train_config
    from lab.predict.training.estimate import estimate, step_ops
    from lab.run.experiment import load_experiment

    plan = load_experiment(os.path.join(REPO, "experiments", "train_pipe_dp_tp.toml")).plan
    cfg = train_config(plan, get_chip("cpu"))
    assert cfg.spmd_pipeline and cfg.pipeline_steps == 5 and cfg.microbatches == 4
    lab = {o["name"]: o for o in step_ops(estimate(cfg))}
    megatron = {o["name"]: o for o in step_ops(estimate(dataclasses.replace(cfg, spmd_pipeline=False)))}
    assert lab["mlp/up"]["flops"] == pytest.approx(megatron["mlp/up"]["flops"] * 5 / 4, rel=1e-12)
    e = estimate(cfg)
    idle = e.breakdown["bubble_s"] / (e.step_time_s - e.breakdown["optimizer_s"] - e.breakdown["comm_dp_s"])
    assert idle == pytest.approx(1 / 5, rel=1e-9)


@pytest.mark.parametrize(
    ("options", "rules", "match"),
    [
        ({"pp_schedule": "1f1b"}, {}, r'pp_schedule = "1f1b": the lab\'s pipelined train step runs GPipe and the'),
        ({"pp_schedule": "interleaved", "interleave": 3}, {}, r"layers=4 do not cut into 2 stages x interleave 3"),
        ({"stage_split": (1, 2)}, {}, r"stage_split = \[1, 2\] must give each of the 2 stages of 'pipe' its layers"),
        ({"stage_split": (1, 1, 2)}, {}, r"it has 3 entries adding up to 4\); e.g. \[2, 2\]"),
        ({"stage_split": (3, 1), "pp_schedule": "1f1b"}, {"layers": None}, r"stage_split = \[3, 1\] splits pipeline"),
        (
            {"stage_split": (2, 2), "pp_schedule": "interleaved", "interleave": 2, "microbatch": 2},
            {},
            r"stage_split with the interleaved schedule is priced, not run",
        ),
        (
            {"pp_schedule": "interleaved", "interleave": 2, "microbatch": 8},
            {},
            r"in groups of the 2 stages; 1 microbatches is not a multiple of 2",
        ),
        ({}, {"batch": ("data", "pipe")}, r"layers = 'pipe' and batch = \('data', 'pipe'\): .* holds stages only"),
        ({"microbatch": 3}, {}, r"microbatch = 3 does not divide the 16 // 2 = 8 sequences"),
        ({}, {"layers": ("pipe", "data")}, r"the lab pipelines over one mesh axis"),
    ],
)
def test_bad_pipelined_plans_are_refused_before_compiling(options, rules, match):
    from lab.run.experiment import load_experiment

    plan = load_experiment(os.path.join(REPO, "experiments", "train_pipe_dp_tp.toml")).plan
    bad = dataclasses.replace(
        plan,
        options=dataclasses.replace(plan.options, **options),
        rules=dataclasses.replace(plan.rules, **rules),
    )
    with pytest.raises(UserError, match=match):
        bad.validate()


# The circular schedule: (mesh, preset, microbatches, remat) with 8 layers in p stages x 2 chunks.
CIRCULAR = {
    "pipe2_data2_model2_tp_M4": ({"pipe": 2, "data": 2, "model": 2}, "tp", 4, "none"),
    "pipe4_data2_dp_M4_full": ({"pipe": 4, "data": 2, "model": 1}, "dp", 4, "full"),
}


@pytest.mark.parametrize("case", [pytest.param(c, marks=pytest.mark.slow) for c in CIRCULAR])  # audited by default
def test_the_circular_schedule_matches_one_device(jax_devices, case):
    """The stored layers are stage by stage (interleaved_order): the reference reads them in the model's order,
    and its gradients are compared in the stored one."""
    import jax

    from kernels.mesh import make_mesh
    from kernels.transformer.loss import interleaved_order
    from kernels.transformer.model import init_params, synthetic_tokens, token_sharding
    from kernels.transformer.train import make_grads_fn
    from lab.core.rules import get_rules

    shape, preset, m, remat = CIRCULAR[case]
    cfg, rules, mesh = _model(layers=8), dataclasses.replace(get_rules(preset), layers="pipe"), make_mesh(shape)
    params = init_params(cfg, rules, mesh, jax.random.key(1))
    tokens = synthetic_tokens(cfg, B, T, seed=1)
    loss, grads = make_grads_fn(cfg, rules, mesh, remat, microbatches=m, interleave=2)(
        params, jax.device_put(tokens, token_sharding(rules, mesh))
    )
    order = interleaved_order(8, shape["pipe"], 2)
    host = jax.tree.map(np.asarray, params)
    in_model_order = dict(host, layers=jax.tree.map(lambda w: w[np.argsort(order)], host["layers"]))
    ref_loss, ref_grads = _reference(cfg, in_model_order, tokens)
    ref_grads = dict(ref_grads, layers=jax.tree.map(lambda g: np.asarray(g)[order], ref_grads["layers"]))
    np.testing.assert_allclose(float(loss), float(ref_loss), rtol=LOSS_RTOL, atol=LOSS_ATOL)
    for got, want in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads), strict=True):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=GRAD_RTOL, atol=GRAD_ATOL)


def test_interleaved_order_by_hand():
    # p = 2 stages, v = 2 chunks of 2 layers: stage 0 holds chunks 0 and 2 (layers 0, 1, 4, 5), stage 1 chunks 1
    # and 3 (layers 2, 3, 6, 7)
    from kernels.transformer.loss import interleaved_order

    assert interleaved_order(8, 2, 2).tolist() == [0, 1, 4, 5, 2, 3, 6, 7]
    assert interleaved_order(8, 4, 2).tolist() == [0, 4, 1, 5, 2, 6, 3, 7]


# Uneven stages: (mesh, preset, split, microbatches, remat); every stage stores as many layers as the largest.
UNEVEN = {
    "pipe2_data2_model2_tp_split2_3": ({"pipe": 2, "data": 2, "model": 2}, "tp", (2, 3), 4, "none"),
    "pipe4_data2_dp_split1_2_2_1_full": ({"pipe": 4, "data": 2, "model": 1}, "dp", (1, 2, 2, 1), 2, "full"),
}


@pytest.mark.parametrize("case", [c if "pipe2" in c else pytest.param(c, marks=pytest.mark.slow) for c in UNEVEN])
def test_uneven_stages_match_one_device_and_leave_the_padding_untouched(jax_devices, case):
    import jax

    from kernels.mesh import make_mesh
    from kernels.transformer.loss import split_order
    from kernels.transformer.model import init_params, synthetic_tokens, token_sharding
    from kernels.transformer.train import make_grads_fn
    from lab.core.rules import get_rules

    shape, preset, split, m, remat = UNEVEN[case]
    cfg = _model(layers=sum(split))
    stored = dataclasses.replace(cfg, layers=len(split) * max(split))
    rules, mesh = dataclasses.replace(get_rules(preset), layers="pipe"), make_mesh(shape)
    params = init_params(stored, rules, mesh, jax.random.key(1))
    tokens = synthetic_tokens(cfg, B, T, seed=1)
    loss, grads = make_grads_fn(stored, rules, mesh, remat, microbatches=m, stage_split=split)(
        params, jax.device_put(tokens, token_sharding(rules, mesh))
    )
    order = split_order(split)
    real, pad = np.nonzero(order >= 0)[0], np.nonzero(order < 0)[0]
    rows = real[np.argsort(order[real])]  # the stored rows of the model's layers, in its order
    host = jax.tree.map(np.asarray, params)
    ref_loss, ref_grads = _reference(cfg, dict(host, layers=jax.tree.map(lambda w: w[rows], host["layers"])), tokens)
    np.testing.assert_allclose(float(loss), float(ref_loss), rtol=LOSS_RTOL, atol=LOSS_ATOL)
    got_layers = jax.tree.map(np.asarray, grads["layers"])
    for g in jax.tree.leaves(got_layers):
        assert not np.any(g[pad])  # the padding does not take part
    got = dict(grads, layers=jax.tree.map(lambda g: g[rows], got_layers))
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(ref_grads), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=GRAD_RTOL, atol=GRAD_ATOL)


def test_split_order_by_hand():
    from kernels.transformer.loss import split_order

    assert split_order((1, 2, 2, 1)).tolist() == [0, -1, 1, 2, 3, 4, 5, -1]
    assert split_order((2, 3)).tolist() == [0, 1, -1, 2, 3, 4]


# train_pipe_uneven: 6 layers split 1, 2, 2, 1 over pipe = 4, every stage stacking 2. Each data replica reduces its
# stage's 2 stored layers (TINY's 33,712 parameters each: norms 2 x 56, Wq and Wo 56 x 96, Wk and Wv 56 x 48, three
# MLP matrices 56 x 104) and both [88, 56] tables and the [56] final norm, float32, and the float32 loss.
LAYER = 2 * 56 + 2 * 56 * 96 + 2 * 56 * 48 + 3 * 56 * 104
UNEVEN_DP = (2 * LAYER + 2 * 88 * 56 + 56) * 4 + 4


def test_the_uneven_experiment_audits_the_busiest_stage(jax_devices):
    from lab.compile.audit import audit_plan
    from lab.core.hardware import get_chip
    from lab.predict.program.estimate import train_config
    from lab.run.experiment import load_experiment

    plan = load_experiment(os.path.join(REPO, "experiments", "train_pipe_uneven.toml")).plan
    assert plan.stored_layers() == 8 and LAYER == 33_712
    cfg = train_config(plan, get_chip("cpu"))
    assert cfg.layout.stage_split == (1, 2, 2, 1) and cfg.layout.stage_layers(6) == 2
    r = audit_plan(plan, get_chip("cpu"))
    assert r.all_match and not r.unexpected, r.table()
    dp = {(e.kind, e.axes): e for e in r.entries}[("all-reduce", ("data",))]
    assert dp.predicted_bytes == dp.compiled_bytes == UNEVEN_DP
    assert r.flops_compiled == pytest.approx(r.flops_predicted, rel=1e-9)


# train_pipe_interleaved: p = 2, v = 2, M = 4: 4 x 2 + 2 - 1 = 9 steps, a wrap-around send after each but the last,
# each way: 16 permutes of a microbatch's [2, 32, 56] float32 activations.
RING_SENDS = 16 * 2 * 32 * 56 * 4


def test_the_circular_experiment_audits_with_hand_counted_sends(jax_devices):
    from lab.compile.audit import audit_plan
    from lab.core.hardware import get_chip
    from lab.predict.program.estimate import train_config
    from lab.run.experiment import load_experiment

    plan = load_experiment(os.path.join(REPO, "experiments", "train_pipe_interleaved.toml")).plan
    cfg = train_config(plan, get_chip("cpu"))
    assert cfg.spmd_pipeline and cfg.layout.v == 2 and cfg.pipeline_steps == 4 + 1 / 2  # 9 steps of half a stage
    r = audit_plan(plan, get_chip("cpu"))
    assert r.all_match and not r.unexpected, r.table()
    sends = {(e.kind, e.axes): e for e in r.entries}[("permute", ("pipe",))]
    assert sends.predicted_bytes == sends.compiled_bytes == RING_SENDS and len(sends.instructions) == 16
    assert r.flops_compiled == pytest.approx(r.flops_predicted, rel=1e-9)


def test_decode_does_not_run_pipelined():
    from lab.core.plan import make_mesh_axes
    from lab.run.experiment import load_experiment

    plan = load_experiment(os.path.join(REPO, "experiments", "decode_tp.toml")).plan
    rules = dataclasses.replace(plan.rules, layers="pipe")
    one = dataclasses.replace(plan, mesh=make_mesh_axes({"data": 2, "model": 4, "pipe": 1}), rules=rules)
    one.validate()  # a pipe axis of one device is no pipeline
    two = dataclasses.replace(one, mesh=make_mesh_axes({"data": 1, "model": 4, "pipe": 2}))
    with pytest.raises(UserError, match=r"layers = \['pipe'\]: decode runs unpipelined; leave layers out"):
        two.validate()


def test_fsdp_inside_the_stages_audits_as_one_gather_and_one_reduction_a_step(jax_devices):
    """pipe x data x model with the weights FSDP-sharded over data: the stage's weights are loop-invariant in the
    pipeline's loop, so XLA gathers them whole once before it and all-reduces their summed gradients once after it.
    By hand, one device's fp32 weights (the experiment's dims, TP over model = 2): a layer's Q 56x96/2, K and V
    56x48/2 each, O 96x56/2, gate and up 2x56x104/2, down 104x56/2, two norm scales of 56 = 16,912; a stage holds
    2 layers, and every stage the two vocab-parallel tables (88x56/2 each) and the final norm (56): 38,808."""
    from lab.compile.audit import audit_plan
    from lab.core.hardware import get_chip
    from lab.core.rules import get_rules
    from lab.run.experiment import load_experiment

    plan = load_experiment(os.path.join(REPO, "experiments", "train_pipe_dp_tp.toml")).plan
    plan = dataclasses.replace(plan, rules=dataclasses.replace(get_rules("fsdp_tp"), layers="pipe"))
    r = audit_plan(plan, get_chip("cpu"))
    assert r.all_match and not r.unexpected, r.table()
    by_kind = {(e.kind, e.axes): e for e in r.entries}
    stage = 38_808 * 4
    gather = by_kind[("all-gather", ("data",))]
    assert gather.predicted_bytes == gather.compiled_bytes == stage and len(gather.instructions) >= 1
    reduce = by_kind[("all-reduce", ("data",))]
    assert reduce.predicted_bytes == reduce.compiled_bytes == stage + 4  # and the float32 loss
    assert ("reduce-scatter", ("data",)) not in by_kind
