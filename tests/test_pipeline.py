"""The pipelined MLP (GPipe over a pipe axis) on 8 emulated CPU devices: loss and gradients against one device, the
train step, the audit of both experiments, the bubble, errors.

Tolerances are fixed: float32 rtol 1e-5, atol 1e-6, for the loss and for both weights' gradients (and the updated
weights). The inputs keep activations of order one (x standard normal, W1 ~ N(0, 1/D), W2 ~ N(0, 1/(F L))); the
sharded program and the reference run the same layers on the same rows, so only the order of float32 sums differs
(the weight gradients are summed over microbatches, steps and the data axis instead of in one matmul).

The bytes, calls, FLOPs and bubbles the audit and the estimate must show are written out here by hand, not taken
from the estimator.
"""

from __future__ import annotations

import os
import re

import numpy as np
import pytest

from lab.core.errors import UserError

F32_RTOL, F32_ATOL = 1e-5, 1e-6
SIZES = {"B": 32, "D": 8, "F": 16, "L": 8, "M": 4}
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# (mesh, sizes, split): split None is the even L / p
CASES = {
    "data2_pipe4": ({"data": 2, "pipe": 4}, SIZES, None),
    "pipe8": ({"data": 1, "pipe": 8}, SIZES, None),
    "data4_pipe2": ({"data": 4, "pipe": 2}, {**SIZES, "M": 8}, None),
    "data2_pipe4_split1221": ({"data": 2, "pipe": 4}, {**SIZES, "L": 6}, (1, 2, 2, 1)),
    "data2_pipe4_split3113_M2": ({"data": 2, "pipe": 4}, {**SIZES, "M": 2}, (3, 1, 1, 3)),  # fewer microbatches
}


def _placed(mesh, args):
    import jax
    from jax.sharding import NamedSharding

    from kernels.pipeline import batch_spec, weight_spec

    specs = (weight_spec(), weight_spec(), batch_spec(mesh))
    return [jax.device_put(a, NamedSharding(mesh, s)) for a, s in zip(args, specs, strict=True)]


# data x pipe once in the default suite (data4_pipe2), data2_pipe4 under -m slow (8 s from a fresh clone).
@pytest.mark.parametrize("case", [pytest.param(c, marks=pytest.mark.slow) if c == "data2_pipe4" else c for c in CASES])
def test_loss_and_gradients_match_the_single_device_reference(jax_devices, case):
    import jax

    from kernels.mesh import make_mesh
    from kernels.pipeline import check_mesh, init_inputs, pipeline_loss, reference_grads

    shape, sizes, split = CASES[case]
    mesh = make_mesh(shape)
    split = check_mesh(mesh, sizes, split)
    args = init_inputs(sizes, split, seed=1)
    value_and_grad = jax.jit(jax.value_and_grad(pipeline_loss(mesh, sizes["M"]), argnums=(0, 1)))
    loss, (g1, g2) = value_and_grad(*_placed(mesh, args))
    ref_loss, ref_g1, ref_g2 = reference_grads(*args, split)
    assert loss.shape == () and loss.dtype == np.float32 and 0.1 < float(loss) < 100.0
    np.testing.assert_allclose(np.asarray(loss), ref_loss, rtol=F32_RTOL, atol=F32_ATOL)
    for got, want in ((g1, ref_g1), (g2, ref_g2)):
        assert np.abs(want).max() > 1e-3  # gradients that say something
        np.testing.assert_allclose(np.asarray(got), want, rtol=F32_RTOL, atol=F32_ATOL)
    for stage, n in enumerate(split):  # the identity padding gets no gradient: it stays the identity
        assert not np.asarray(g1)[stage, n:].any() and not np.asarray(g2)[stage, n:].any()


def test_reference_padding_layers_are_the_identity():
    from kernels.pipeline import init_inputs, reference_loss, stack_layers

    rng = np.random.default_rng(0)
    w1 = rng.standard_normal((3, 4, 6), dtype=np.float32)
    w2 = rng.standard_normal((3, 6, 4), dtype=np.float32)
    s1, s2 = stack_layers(w1, w2, (2, 1))
    assert s1.shape == (2, 2, 4, 6) and not s1[1, 1].any() and not s2[1, 1].any()
    np.testing.assert_array_equal(s1[1, 0], w1[2])
    x = rng.standard_normal((5, 4), dtype=np.float32)
    wider = np.concatenate([s1, np.zeros_like(s1)], axis=1), np.concatenate([s2, np.zeros_like(s2)], axis=1)
    assert float(reference_loss(s1, s2, x, (2, 1))) == float(reference_loss(*wider, x, (4, 3)))
    w1, w2, x = init_inputs(SIZES, (2, 2, 2, 2))
    assert w1.shape == (4, 2, 8, 16) and w2.shape == (4, 2, 16, 8) and x.shape == (32, 8)


def test_train_step_from_a_plan_is_the_reference_sgd_step(jax_devices):
    """The registry path: a Plan (mesh completed with data = 1), its inputs, its reference (loss, updated weights);
    the runner carries the updated weights into the next call, so the loss falls."""
    from kernels.registry import build
    from lab.core.plan import kernel_plan

    plan = kernel_plan("pipeline_mlp", {"pipe": 4}, SIZES)
    assert plan.shape == {"pipe": 4, "data": 1}
    built = build(plan)
    assert [s.shape for s in built.abstract] == [(4, 2, 8, 16), (4, 2, 16, 8), (32, 8)]
    out = built.fn(*built.args)
    for got, want in zip(out, built.reference(*built.host_args), strict=True):
        np.testing.assert_allclose(np.asarray(got), want, rtol=F32_RTOL, atol=F32_ATOL)
    run = built.runner()
    losses = [float(run()[0]) for _ in range(3)]
    assert losses[0] == pytest.approx(float(out[0]), rel=F32_RTOL) and losses[2] < losses[0]


# ----- the audit and the estimate: bytes, calls, FLOPs and the bubble by hand ----------------------------------


# p = 4, M = 4: 7 steps; b = 64 / (2 * 4) = 8 rows. 6 activations [8, 256] fp32 down, 6 cotangents back. Gradients:
# 2 layers per stage of W1 and W2, 2 * 2 * 256 * 1024 fp32, over data. FLOPs: 12 * b * D * F per layer and step
# (forward 2 matmuls, backward 4), 2 layers x 7 steps, less the input gradient of step 0 (nothing was received).
GPIPE4 = (12, 12 * 8 * 256 * 4, 2 * 2 * 256 * 1024 * 4, 12 * 8 * 256 * 1024 * 2 * 7 - 2 * 8 * 256 * 1024)
# p = 2, M = 8: 9 steps; b = 64 / (4 * 8) = 2 rows; 8 passes each way; 4 layers per stage.
GPIPE2 = (16, 16 * 2 * 256 * 4, 2 * 4 * 256 * 1024 * 4, 12 * 2 * 256 * 1024 * 4 * 9 - 2 * 2 * 256 * 1024)


@pytest.mark.parametrize(("path", "hand"), [("pipeline_gpipe4.toml", GPIPE4), ("pipeline_gpipe2.toml", GPIPE2)])
def test_experiment_audit_finds_the_hand_counted_permutes(pipeline_audit, path, hand):
    r, plan = pipeline_audit(path, *hand)  # conftest: the audit against these hand counts
    assert plan.sizes["B"] == 64 and plan.dtype == "fp32"
    assert "all-gather(" not in r.hlo_text and "all-to-all(" not in r.hlo_text


@pytest.mark.parametrize(
    ("mesh", "sizes"),
    [
        ({"data": 1, "pipe": 8}, SIZES),  # no data axis: no gradient AllReduce, the loss over pipe
        ({"data": 8, "pipe": 1}, {**SIZES, "M": 2}),  # no pipeline: no permutes, M input gradients dropped
        ({"data": 2, "pipe": 4}, {**SIZES, "M": 1}),  # one microbatch: 3 of 4 steps idle
    ],
)
def test_the_audit_matches_on_other_meshes(jax_devices, mesh, sizes):
    from lab.compile.audit import audit_kernel

    r = audit_kernel("pipeline_mlp", mesh, sizes)
    assert r.all_match and not r.unexpected, r.table()


def _bubble(note: str) -> tuple[int, int, float]:
    found = re.search(r"bubble \(p-1\)/\(M\+p-1\) = (\d+)/(\d+) = ([0-9.]+)", note)
    assert found, note
    return int(found[1]), int(found[2]), float(found[3])


@pytest.mark.parametrize(
    ("mesh", "m", "p"),
    [({"data": 2, "pipe": 4}, 4, 4), ({"data": 4, "pipe": 2}, 8, 2), ({"data": 2, "pipe": 4}, 2, 4)],
)
def test_the_estimate_notes_the_bubble(mesh, m, p):
    from lab.core.hardware import get_chip
    from lab.core.plan import kernel_plan
    from lab.predict.program.estimate import estimate_program

    sizes = {"B": 64, "D": 256, "F": 1024, "L": 8, "M": m}
    est = estimate_program(kernel_plan("pipeline_mlp", mesh, sizes), get_chip("h100"))
    (note,) = est.notes
    hand = {(4, 4): (3, 7), (8, 2): (1, 9), (2, 4): (3, 5)}[(m, p)]  # (p - 1, M + p - 1)
    num, den, value = _bubble(note)
    assert (num, den) == hand and value == pytest.approx(hand[0] / hand[1], abs=1e-4)
    assert est.detail["bubble"] == hand[0] / hand[1]
    assert ("fewer microbatches" in note) == (m < p)
    assert est.step_time_s == pytest.approx(sum(o.time_s for o in est.ops))


def test_audit_pipeline_mlp_has_its_own_default_mesh_and_sizes():
    from lab.cli.audit import _kernel_plan

    plan = _kernel_plan("pipeline_mlp")
    assert plan.shape == {"data": 2, "pipe": 4}
    assert dict(plan.sizes) == {"B": 64, "D": 256, "F": 1024, "L": 8, "M": 4}


# ----- bad input, before anything compiles -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("mesh", "sizes", "match"),
    [
        (
            {"data": 2, "pipe": 4},
            {**SIZES, "L": 6},
            r"L=6 layers do not divide over mesh axis pipe \(4 stages\); use a multiple of 4, e.g. L=4, "
            r"or give an unequal split, e.g. split=\(2, 2, 1, 1\)",
        ),
        (
            {"data": 2, "pipe": 4},
            {**SIZES, "B": 20},
            r"B=20 does not divide into mesh axis data x M microbatches \(2 x 4 = 8\); use a multiple of 8, e.g. B=16",
        ),
        ({"data": 2, "pipe": 4}, {**SIZES, "M": 0}, r"dim M=0 must be a positive integer"),
    ],
)
def test_bad_sizes_are_user_errors_naming_the_value(jax_devices, mesh, sizes, match):
    from kernels.mesh import make_mesh
    from kernels.registry import get_kernel
    from lab.core.plan import kernel_plan

    with pytest.raises(UserError, match=match):  # the Plan, before JAX is asked for anything
        kernel_plan("pipeline_mlp", mesh, sizes).validate()
    with pytest.raises(UserError, match=match):  # the kernel built directly on a mesh
        get_kernel("pipeline_mlp").build(make_mesh(mesh), sizes)


@pytest.mark.parametrize(
    ("split", "match"),
    [
        ((2, 2, 2), r"split \(2, 2, 2\) has 3 stages, but mesh axis pipe has 4; .* e.g. split=\(2, 2, 1, 1\)"),
        ((1, 2, 2, 2), r"split \(1, 2, 2, 2\) adds up to 7 layers, not L=6; e.g. split=\(2, 2, 1, 1\)"),
        ((3, 3, 0, 0), r"split \(3, 3, 0, 0\): every stage holds a positive number of layers"),
    ],
)
def test_bad_splits_are_user_errors_naming_the_value(jax_devices, split, match):
    from kernels.mesh import make_mesh
    from kernels.pipeline import build

    with pytest.raises(UserError, match=match):
        build(make_mesh({"data": 2, "pipe": 4}), {**SIZES, "L": 6}, np.float32, split=split)


def test_bad_experiment_file_names_its_line(tmp_path):
    from lab.run.experiment import load_experiment

    f = tmp_path / "bad.toml"
    f.write_text(
        '# bad L\n[experiment]\nprogram = "pipeline_mlp"\n[mesh]\ndata = 2\npipe = 4\n'
        "[sizes]\nB = 64\nD = 256\nF = 1024\nL = 10\nM = 4\n"
    )
    with pytest.raises(UserError, match=r"bad.toml:\d+: .*L=10 layers do not divide .* e.g. L=8"):
        load_experiment(f)


def test_a_mesh_without_a_pipe_axis_is_refused(jax_devices):
    from kernels.mesh import make_mesh
    from kernels.registry import get_kernel

    with pytest.raises(UserError, match=r"needs a mesh axis named 'pipe'; the mesh has X, Y"):
        get_kernel("pipeline_mlp").build(make_mesh({"X": 2, "Y": 4}), SIZES)


@pytest.mark.parametrize(("m", "p"), [(4, 4), (8, 2), (2, 4)])
def test_train_estimate_prices_the_bubble_the_kernel_estimate_notes(m, p):
    """One formula (lab.predict.axis_costs): the training estimator's bubble is the share of the step the kernel's
    estimate says a stage idles, (p - 1) / (M + p - 1), written here by hand."""
    from lab.core.hardware import get_chip
    from lab.core.models import get_model
    from lab.predict.training.estimate import Layout, TrainConfig, estimate

    cfg = TrainConfig(get_model("llama3-8b"), get_chip("h100"), Layout(dp=2, pp=p), 4096, 2 * m, microbatch=1)
    e = estimate(cfg)
    idle = e.breakdown["bubble_s"] / (e.step_time_s - e.breakdown["optimizer_s"] - e.breakdown["comm_dp_s"])
    assert idle == pytest.approx((p - 1) / (m + p - 1), rel=1e-9)
