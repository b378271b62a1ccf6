"""The circular (interleaved) pipeline on 8 emulated CPU devices: loss and gradients against one device on several
meshes, the audit of both experiments with hand-counted permutes, bytes and FLOPs, the bubble V times smaller than
GPipe's as the training estimator prices it, and errors before anything compiles.

Tolerances are fixed, those of tests/test_pipeline.py: float32 rtol 1e-5, atol 1e-6. The counts below are written
out by hand from the schedule (M V + p - 1 steps, one wrap-around permute after each but the last), not taken from
the estimator.
"""

from __future__ import annotations

import os
import re

import numpy as np
import pytest

from lab.core.errors import UserError

F32_RTOL, F32_ATOL = 1e-5, 1e-6
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SIZES = {"B": 32, "D": 8, "F": 16, "L": 16, "M": 4, "V": 2}

CASES = {
    "data2_pipe4_V2": ({"data": 2, "pipe": 4}, SIZES),
    "pipe8_V2_M8": ({"data": 1, "pipe": 8}, {**SIZES, "M": 8}),
    "data4_pipe2_V3_M6": ({"data": 4, "pipe": 2}, {**SIZES, "B": 48, "L": 12, "M": 6, "V": 3}),
    "data2_pipe4_V1": ({"data": 2, "pipe": 4}, {**SIZES, "L": 8, "V": 1}),  # one chunk: GPipe with a ring
}


def test_the_schedule_visits_every_microbatch_and_repeat_once_in_order():
    from kernels.pipeline_circular import item

    p, m, v = 4, 8, 3
    items = [item(j, p, v) for j in range(m * v)]
    assert sorted(items) == [(mb, r) for mb in range(m) for r in range(v)]
    for j, (mb, r) in enumerate(items):  # repeat r + 1 of a microbatch comes p items (one ring pass) after r
        if r < v - 1:
            assert items[j + p] == (mb, r + 1)


def test_chunks_stack_round_robin_and_unstack_in_model_order():
    from kernels.pipeline_circular import stack_chunks, unstack_chunks

    layers = np.arange(12)[:, None]  # layer l holds the number l
    stacked = stack_chunks(layers, 2, 3)  # p = 2, V = 3, Lc = 2
    assert stacked[0, :, :, 0].tolist() == [[0, 1], [4, 5], [8, 9]]  # stage 0: chunks 0, 2, 4
    assert stacked[1, :, :, 0].tolist() == [[2, 3], [6, 7], [10, 11]]  # stage 1: chunks 1, 3, 5
    assert np.asarray(unstack_chunks(stacked)).tolist() == layers.tolist()


# V = 3 over data x pipe (15 s from a fresh clone) under -m slow; V = 2 and V = 1 in the default suite.
@pytest.mark.parametrize(
    "case", [pytest.param(c, marks=pytest.mark.slow) if c == "data4_pipe2_V3_M6" else c for c in CASES]
)
def test_loss_and_gradients_match_the_single_device_reference(jax_devices, case):
    import jax
    from jax.sharding import NamedSharding

    from kernels.mesh import make_mesh
    from kernels.pipeline import batch_spec
    from kernels.pipeline_circular import check_mesh, circular_loss, init_inputs, reference_loss, weight_spec

    shape, sizes = CASES[case]
    mesh = make_mesh(shape)
    check_mesh(mesh, sizes)
    args = init_inputs(sizes, shape["pipe"], seed=1)
    specs = (weight_spec(), weight_spec(), batch_spec(mesh))
    placed = [jax.device_put(a, NamedSharding(mesh, s)) for a, s in zip(args, specs, strict=True)]
    value_and_grad = jax.value_and_grad(circular_loss(mesh, sizes["M"], sizes["V"]), argnums=(0, 1))
    loss, (g1, g2) = jax.jit(value_and_grad)(*placed)
    ref_loss, (ref_g1, ref_g2) = jax.value_and_grad(reference_loss, argnums=(0, 1))(*args)
    np.testing.assert_allclose(float(loss), float(ref_loss), rtol=F32_RTOL, atol=F32_ATOL)
    np.testing.assert_allclose(np.asarray(g1), np.asarray(ref_g1), rtol=F32_RTOL, atol=F32_ATOL)
    np.testing.assert_allclose(np.asarray(g2), np.asarray(ref_g2), rtol=F32_RTOL, atol=F32_ATOL)
    assert float(np.abs(np.asarray(g1)).min()) > 0  # every layer of every chunk got a gradient


def test_train_step_from_a_plan_is_the_reference_sgd_step(jax_devices):
    from kernels.pipeline_circular import reference_step
    from kernels.registry import build
    from lab.core.plan import kernel_plan

    built = build(kernel_plan("pipeline_circular", {"data": 2, "pipe": 4}, SIZES))
    loss, w1, w2 = built.fn(*built.args)
    ref_loss, ref_w1, ref_w2 = reference_step(*built.host_args)
    np.testing.assert_allclose(float(loss), float(ref_loss), rtol=F32_RTOL, atol=F32_ATOL)
    np.testing.assert_allclose(np.asarray(w1), ref_w1, rtol=F32_RTOL, atol=F32_ATOL)
    np.testing.assert_allclose(np.asarray(w2), ref_w2, rtol=F32_RTOL, atol=F32_ATOL)


# circular4: p = 4, V = 2, M = 4: 11 steps, 10 passes each way; b = 64 / (2 * 4) = 8 rows; Lc = 2 layers per chunk;
# the gradients of 2 chunks x 2 layers x 2 matrices of 256 x 1024 float32; every step runs one chunk, forward and
# backward (12 b D F a layer), less the input gradient of step 0's first layer (2 b D F).
CIRCULAR4 = (20, 20 * 8 * 256 * 4, 2 * 2 * 2 * 256 * 1024 * 4, 12 * 8 * 256 * 1024 * 2 * 11 - 2 * 8 * 256 * 1024)
# circular2: p = 2, V = 3, M = 4: 13 steps, 12 passes each way; b = 64 / (4 * 4) = 4 rows; Lc = 2.
CIRCULAR2 = (24, 24 * 4 * 256 * 4, 2 * 3 * 2 * 256 * 1024 * 4, 12 * 4 * 256 * 1024 * 2 * 13 - 2 * 4 * 256 * 1024)


@pytest.mark.parametrize(
    ("path", "hand", "bubble"),
    [("pipeline_circular4.toml", CIRCULAR4, (3, 11)), ("pipeline_circular2.toml", CIRCULAR2, (1, 13))],
)
def test_experiment_audit_finds_the_hand_counted_permutes(pipeline_audit, path, hand, bubble):
    from lab.core.hardware import get_chip
    from lab.predict.program.estimate import estimate_program

    r, plan = pipeline_audit(path, *hand)  # conftest: the audit against these hand counts
    permutes = hand[0]
    p = plan.shape["pipe"]  # every permute is the ring: the last stage sends to the first
    pairs = re.findall(r"collective-permute\(.*?source_target_pairs=(\{[{},0-9]*\})", r.hlo_text)
    assert len(pairs) == permutes  # forward: the last stage sends to the first; backward, the transpose
    if p > 2:  # (with two stages both directions hold both pairs)
        assert sum(f"{{{p - 1},0}}" in x for x in pairs) == sum(f"{{0,{p - 1}}}" in x for x in pairs) == permutes // 2
    (note,) = estimate_program(plan, get_chip("cpu")).notes
    assert f"bubble (p-1)/(V M+p-1) = {bubble[0]}/{bubble[1]} = {bubble[0] / bubble[1]:.4f}" in note


@pytest.mark.parametrize(("m", "p", "v"), [(4, 4, 2), (4, 2, 4), (8, 4, 4)])
def test_train_estimate_prices_the_interleaved_bubble_the_kernel_estimate_notes(m, p, v):
    """One formula (lab.predict.axis_costs): the training estimator's interleaved bubble is the share of the step
    the circular kernel's estimate says a stage idles, (p - 1) / (V M + p - 1), written here by hand."""
    from lab.core.hardware import get_chip
    from lab.core.models import get_model
    from lab.core.plan import kernel_plan
    from lab.predict.program.estimate import estimate_program
    from lab.predict.training.estimate import Layout, TrainConfig, estimate

    hand = (p - 1) / (v * m + p - 1)
    sizes = {"B": 64 * m, "D": 256, "F": 1024, "L": p * v * 2, "M": m, "V": v}
    kernel = estimate_program(kernel_plan("pipeline_circular", {"data": 8 // p, "pipe": p}, sizes), get_chip("h100"))
    assert kernel.detail["bubble"] == pytest.approx(hand, rel=1e-12)
    model = get_model("llama3-8b")  # 32 layers: p x V divides them in every case here
    lay = Layout(dp=2, pp=p, pp_schedule="interleaved", interleave=v)
    e = estimate(TrainConfig(model, get_chip("h100"), lay, 4096, 2 * m, microbatch=1))
    idle = e.breakdown["bubble_s"] / (e.step_time_s - e.breakdown["optimizer_s"] - e.breakdown["comm_dp_s"])
    assert idle == pytest.approx(hand, rel=1e-9)


# ----- bad input, before anything compiles -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("mesh", "sizes", "match"),
    [
        (
            {"data": 2, "pipe": 4},
            {**SIZES, "L": 12},
            r"L=12 layers do not cut into pipe x V = 4 x 2 chunks; use a multiple of 8, e.g. L=8",
        ),
        (
            {"data": 2, "pipe": 4},
            {**SIZES, "M": 6, "B": 48},
            r"M=6 microbatches is not a multiple of mesh axis pipe \(4 stages\); .* e.g. M=4",
        ),
        ({"data": 8, "pipe": 1}, SIZES, r"pipe=1; a circular pipeline needs at least 2 stages"),
        ({"data": 2, "pipe": 4}, {**SIZES, "V": 0}, r"dim V=0 must be a positive integer"),
        (
            {"data": 2, "pipe": 4},
            {**SIZES, "B": 20},
            r"B=20 does not divide into mesh axis data x M microbatches \(2 x 4 = 8\); use a multiple of 8, e.g. B=16",
        ),
    ],
)
def test_bad_sizes_are_user_errors_naming_the_value(jax_devices, mesh, sizes, match):
    from kernels.mesh import make_mesh
    from kernels.registry import get_kernel
    from lab.core.plan import kernel_plan

    with pytest.raises(UserError, match=match):  # the Plan, before JAX is asked for anything
        kernel_plan("pipeline_circular", mesh, sizes).validate()
    with pytest.raises(UserError, match=match):  # the kernel built directly on a mesh
        get_kernel("pipeline_circular").build(make_mesh(mesh), sizes)
