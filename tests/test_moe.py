"""The MoE MLP on 8 emulated CPU devices: numerics against one device, gradients, the audit of both experiments,
the load report, errors.

Tolerances are fixed: float32 rtol 1e-5, atol 1e-5, for outputs and for the expert weights' gradients. The inputs
are scaled so outputs are of order one (x standard normal, each weight N(0, 1/fan-in)); the sharded program and the
reference make the same routing decisions and drop the same assignments, so only the order of float32 sums differs.

The bytes and FLOPs the audit must find are written out here by hand, not taken from the estimator.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

from lab.core.errors import UserError

F32_RTOL, F32_ATOL = 1e-5, 1e-5
SIZES = {"T": 256, "D": 16, "F": 32, "E": 8}  # 32 tokens per device on 8 devices, 1 to 4 experts per device
MESHES = {
    "data2_expert4": {"data": 2, "expert": 4},
    "expert8": {"data": 1, "expert": 8},
    "data4_expert2": {"data": 4, "expert": 2},
}
# capacity factor 1.25 drops some assignments of these inputs; E / k = 4 gives C = t slots per expert, so none
CAPACITY = {"drops": 1.25, "no_drops": 4.0}
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _inputs(sizes, seed=0, hot=False):
    """x, W_router, W_gate, W_up, W_down; ``hot``: every token routed to experts 0 and 1 (the most drops)."""
    t, d, f, e = (sizes[k] for k in ("T", "D", "F", "E"))
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((t, d), dtype=np.float32)
    w_router = rng.standard_normal((d, e), dtype=np.float32) / np.sqrt(d)
    if hot:
        x = np.abs(x)
        w_router = np.zeros((d, e), np.float32)
        w_router[:, 0], w_router[:, 1] = 1.0, 0.5
    gate, up = (rng.standard_normal((e, d, f), dtype=np.float32) / np.sqrt(d) for _ in range(2))
    down = rng.standard_normal((e, f, d), dtype=np.float32) / np.sqrt(f)
    return x, w_router, gate, up, down


def _placed(mesh, args):
    import jax
    from jax.sharding import NamedSharding

    from kernels.moe import in_specs

    return [jax.device_put(a, NamedSharding(mesh, s)) for a, s in zip(args, in_specs(mesh), strict=True)]


@pytest.mark.parametrize("capacity", list(CAPACITY))
@pytest.mark.parametrize("mesh_name", list(MESHES))
def test_matches_the_single_device_reference(jax_devices, mesh_name, capacity):
    from kernels.mesh import make_mesh
    from kernels.moe import load_report, moe_mlp, reference_moe, token_groups, token_spec

    mesh = make_mesh(MESHES[mesh_name])
    factor = CAPACITY[capacity]
    args = _inputs(SIZES)
    out = moe_mlp(mesh, capacity_factor=factor)(*_placed(mesh, args))
    ref = reference_moe(*args, groups=token_groups(mesh), capacity_factor=factor)
    assert out.shape == ref.shape == (SIZES["T"], SIZES["D"]) and out.dtype == np.float32
    assert out.sharding.spec == token_spec(mesh)
    np.testing.assert_allclose(np.asarray(out), ref, rtol=F32_RTOL, atol=F32_ATOL)
    report = load_report(args[0], args[1], groups=8, capacity_factor=factor)
    assert (report["dropped"] > 0) == (capacity == "drops"), report


def test_a_hot_expert_drops_past_its_capacity_and_still_matches(jax_devices):
    """Every token picks experts 0 and 1: per device 32 first choices for expert 0 and 32 second choices for
    expert 1 against C = ceil(2 * 32 * 1.25 / 8) = 10 slots each, so 22 + 22 of the 64 assignments are dropped."""
    from kernels.mesh import make_mesh
    from kernels.moe import load_report, moe_mlp, reference_moe

    args = _inputs(SIZES, hot=True)
    report = load_report(args[0], args[1], groups=8)
    assert report["capacity"] == 10
    assert report["routed"] == [256, 256, 0, 0, 0, 0, 0, 0]
    assert report["kept"] == [80, 80, 0, 0, 0, 0, 0, 0]
    assert report["dropped"] == 2 * 256 - 160 and report["dropped_fraction"] == pytest.approx(352 / 512)
    assert report["imbalance"] == pytest.approx(4.0)
    mesh = make_mesh(MESHES["data2_expert4"])
    out = moe_mlp(mesh)(*_placed(mesh, args))
    ref = reference_moe(*args, groups=8)
    np.testing.assert_allclose(np.asarray(out), ref, rtol=F32_RTOL, atol=F32_ATOL)
    assert np.abs(ref[10:32]).max() == 0.0  # tokens 10..31 of device 0 lost both choices: zero output


def test_load_report_counts_sum_to_k_tokens_minus_drops():
    from kernels.moe import load_report

    x, w_router, *_ = _inputs({**SIZES, "T": 512}, seed=3)
    for groups, factor in ((8, 1.25), (4, 1.0), (1, 0.5), (8, 4.0)):
        r = load_report(x, w_router, groups=groups, capacity_factor=factor)
        assert sum(r["routed"]) == 2 * 512
        assert sum(r["kept"]) == 2 * 512 - r["dropped"]
        assert all(k <= min(n, groups * r["capacity"]) for k, n in zip(r["kept"], r["routed"], strict=True))
        assert r["dropped_fraction"] == r["dropped"] / 1024 and 0.0 <= r["dropped_fraction"] < 1.0
        assert r["imbalance"] >= 1.0
    assert load_report(x, w_router, groups=8, capacity_factor=4.0)["dropped"] == 0  # C = 64 = tokens per group
    assert load_report(x, w_router, groups=1, capacity_factor=0.5)["capacity"] == 64  # ceil(2*512*0.5/8)


def test_expert_weight_gradients_match_the_reference(jax_devices):
    import jax

    from kernels.mesh import make_mesh
    from kernels.moe import moe_mlp, reference_moe_jax

    mesh = make_mesh(MESHES["data2_expert4"])
    args = _inputs(SIZES)
    cotangent = np.random.default_rng(1).standard_normal((SIZES["T"], SIZES["D"]), dtype=np.float32)
    fn = moe_mlp(mesh)  # capacity factor 1.25: some assignments dropped, their slots get no gradient
    x, w_router, *experts = _placed(mesh, args)

    def sharded(*w):
        return (fn(x, w_router, *w) * cotangent).sum()

    def reference(*w):
        return (reference_moe_jax(args[0], args[1], *w, groups=8) * cotangent).sum()

    got = jax.grad(sharded, argnums=(0, 1, 2))(*experts)
    want = jax.grad(reference, argnums=(0, 1, 2))(*args[2:])
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=F32_RTOL, atol=F32_ATOL)


def test_built_from_a_plan_matches_its_reference(jax_devices):
    """The registry path: a Plan (mesh completed with data = 1), its shardings and its reference (groups = 8), on
    the scaled inputs (the registry's own are standard normal throughout)."""
    import jax

    from kernels.registry import build
    from lab.core.plan import kernel_plan

    plan = kernel_plan("moe_mlp", {"expert": 8}, SIZES)
    assert plan.shape == {"expert": 8, "data": 1}
    built = build(plan)
    args = _inputs(SIZES, seed=2)
    out = built.fn(*(jax.device_put(a, s.sharding) for a, s in zip(args, built.abstract, strict=True)))
    np.testing.assert_allclose(np.asarray(out), built.reference(*args), rtol=F32_RTOL, atol=F32_ATOL)
    assert [s.shape for s in built.abstract] == [(256, 16), (16, 8), (8, 16, 32), (8, 16, 32), (8, 32, 16)]


# ----- the audit and the estimate: bytes and FLOPs by hand --------------------------------------------------------


@pytest.mark.parametrize(
    ("path", "alltoall_bytes", "flops"),
    [
        # t = 1024 / (2 * 4) = 128 tokens per device, C = ceil(2 * 128 * 1.25 / 8) = 40 slots per expert.
        # Each AllToAll: the send buffer [E, C, D] = [8, 40, 256] fp32, times the group of 4 (the collective model's
        # V); two of them. FLOPs: router 2 * 128 * 256 * 8, experts 3 matmuls * 2 * 256 * 512 * (8 * 40) slots.
        ("moe_expert4.toml", 2 * 4 * (8 * 40 * 256 * 4), 2 * 128 * 256 * 8 + 3 * 2 * 256 * 512 * 8 * 40),
        # t = 1024 / 8 = 128 again, C = 40: the same buffer, a group of 8; the same FLOPs per device.
        ("moe_expert8.toml", 2 * 8 * (8 * 40 * 256 * 4), 2 * 128 * 256 * 8 + 3 * 2 * 256 * 512 * 8 * 40),
    ],
)
def test_experiment_audit_finds_the_hand_counted_all_to_alls(jax_devices, path, alltoall_bytes, flops):
    from lab.compile.audit import audit_plan
    from lab.core.hardware import get_chip
    from lab.run.experiment import load_experiment

    exp = load_experiment(os.path.join(REPO, "experiments", path))
    assert exp.plan.sizes == {"T": 1024, "D": 256, "F": 512, "E": 8} and exp.plan.dtype == "fp32"
    r = audit_plan(exp.plan, get_chip("cpu"))
    assert r.all_match and not r.unexpected, r.table()
    (e,) = r.entries
    assert (e.kind, e.axes) == ("all-to-all", ("expert",))
    assert e.predicted_bytes == alltoall_bytes and e.compiled_bytes == alltoall_bytes, r.table()
    assert len(e.instructions) == 2  # dispatch and combine
    assert r.flops_compiled == flops and r.flops_predicted == flops
    for other in ("all-gather(", "all-reduce(", "collective-permute(", "reduce-scatter("):
        assert other not in r.hlo_text


def test_estimate_prices_route_dispatch_experts_combine_in_sequence():
    from lab.core.hardware import get_chip
    from lab.core.plan import kernel_plan
    from lab.predict.program.estimate import estimate_program

    sizes = {"T": 1024, "D": 256, "F": 512, "E": 8}
    for dtype, nbytes in (("fp32", 4), ("bf16", 2)):
        est = estimate_program(kernel_plan("moe_mlp", {"data": 2, "expert": 4}, sizes, dtype), get_chip("h100"))
        router, experts, dispatch, combine = est.ops
        assert (router.scope, experts.scope) == ("moe/router", "moe/experts")
        assert router.flops == 2 * 128 * 256 * 8 and experts.flops == 6 * 256 * 512 * 320
        assert est.flops == router.flops + experts.flops
        for op in (dispatch, combine):
            assert (op.kind, op.axes, op.calls) == ("all-to-all", ("expert",), 1)
            assert op.bytes == 4 * 8 * 40 * 256 * nbytes
        assert est.step_time_s == pytest.approx(sum(o.time_s for o in est.ops))
    # capacity 1.25 rounds up: t = 100 tokens per device, C = ceil(2 * 100 * 1.25 / 8) = ceil(31.25) = 32
    est = estimate_program(kernel_plan("moe_mlp", {"data": 2, "expert": 4}, {**sizes, "T": 800}), get_chip("h100"))
    assert est.ops[1].flops == 6 * 256 * 512 * 8 * 32 and est.ops[2].bytes == 4 * 8 * 32 * 256 * 4
    alone = estimate_program(kernel_plan("moe_mlp", {"data": 8, "expert": 1}, sizes), get_chip("h100"))
    assert [o.kind for o in alone.ops] == ["matmul", "matmul"] and alone.collectives() == []


def test_audit_moe_mlp_has_its_own_default_mesh_and_sizes():
    from lab.cli.audit import _kernel_plan

    plan = _kernel_plan("moe_mlp")
    assert plan.shape == {"data": 2, "expert": 4}
    assert dict(plan.sizes) == {"T": 1024, "D": 256, "F": 512, "E": 8}


# ----- bad input, before anything compiles -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("mesh", "sizes", "match"),
    [
        (
            {"data": 2, "expert": 4},
            {**SIZES, "E": 6},
            r"E=6 does not divide over mesh axis expert \(4 devices\); use a multiple of 4, e.g. E=4",
        ),
        (
            {"data": 2, "expert": 4},
            {**SIZES, "T": 100},
            r"T=100 does not divide over mesh axes data x expert \(8 devices\); use a multiple of 8, e.g. T=96",
        ),
        (
            {"data": 1, "expert": 8},
            {**SIZES, "E": 4},
            r"E=4 does not divide over mesh axis expert \(8 devices\); use a multiple of 8, e.g. E=8",
        ),
        ({"data": 2, "expert": 4}, {**SIZES, "F": 0}, r"dim F=0 must be a positive integer"),
    ],
)
def test_bad_sizes_are_user_errors_naming_the_value(jax_devices, mesh, sizes, match):
    from kernels.mesh import make_mesh
    from kernels.registry import get_kernel
    from lab.core.plan import kernel_plan

    with pytest.raises(UserError, match=match):  # the Plan, before JAX is asked for anything
        kernel_plan("moe_mlp", mesh, sizes).validate()
    with pytest.raises(UserError, match=match):  # the kernel built directly on a mesh
        get_kernel("moe_mlp").build(make_mesh(mesh), sizes)


def test_bad_experiment_file_names_its_line(tmp_path):
    from lab.run.experiment import load_experiment

    f = tmp_path / "bad.toml"
    f.write_text(
        '# bad E\n[experiment]\nprogram = "moe_mlp"\n[mesh]\ndata = 2\nexpert = 4\n'
        "[sizes]\nT = 1024\nD = 256\nF = 512\nE = 10\n"
    )
    with pytest.raises(UserError, match=r"bad.toml:\d+: .*E=10 does not divide .* e.g. E=8"):
        load_experiment(f)


def test_a_mesh_without_an_expert_axis_is_refused(jax_devices):
    from kernels.mesh import make_mesh
    from kernels.registry import get_kernel

    with pytest.raises(UserError, match=r"needs a mesh axis named 'expert'; the mesh has X, Y"):
        get_kernel("moe_mlp").build(make_mesh({"X": 2, "Y": 4}), SIZES)


# ----- shared experts (moe_shared_mlp) ----------------------------------------------------------------------------


def _shared_inputs(sizes, seed=0):
    """The routed layer's inputs and the shared experts' ``W_sgate, W_sup [D, S F]``, ``W_sdown [S F, D]``."""
    d, sf = sizes["D"], sizes["S"] * sizes["F"]
    rng = np.random.default_rng(seed + 100)
    gate, up = (rng.standard_normal((d, sf), dtype=np.float32) / np.sqrt(d) for _ in range(2))
    down = rng.standard_normal((sf, d), dtype=np.float32) / np.sqrt(sf)
    return (*_inputs(sizes, seed), gate, up, down)


@pytest.mark.parametrize("mesh_name", ["data2_expert4", "expert8"])
def test_shared_experts_match_the_reference_and_add_to_every_token(jax_devices, mesh_name):
    import jax
    from jax.sharding import NamedSharding

    from kernels.mesh import make_mesh
    from kernels.moe import in_specs, moe_mlp, reference_moe, reference_shared, token_groups

    sizes = {**SIZES, "S": 2}
    mesh = make_mesh(MESHES[mesh_name])
    args = _shared_inputs(sizes, seed=3)
    placed = [jax.device_put(a, NamedSharding(mesh, s)) for a, s in zip(args, in_specs(mesh, True), strict=True)]
    out = np.asarray(moe_mlp(mesh, shared=True)(*placed))
    ref = reference_moe(*args, groups=token_groups(mesh))
    np.testing.assert_allclose(out, ref, rtol=F32_RTOL, atol=F32_ATOL)
    routed = reference_moe(*args[:5], groups=token_groups(mesh))  # without the shared experts the output differs
    np.testing.assert_allclose(out - routed, np.asarray(reference_shared(args[0], *args[5:])), rtol=1e-4, atol=1e-4)
    assert np.abs(out - routed).min() > 0  # every token got the shared experts' contribution


def test_shared_experts_audit_adds_their_flops_and_no_collective(jax_devices):
    from lab.compile.audit import audit_plan
    from lab.core.hardware import get_chip
    from lab.run.experiment import load_experiment

    exp = load_experiment(os.path.join(REPO, "experiments", "moe_shared4.toml"))
    r = audit_plan(exp.plan, get_chip("cpu"))
    assert r.all_match and not r.unexpected, r.table()
    (e,) = r.entries  # the shared experts add no collective: still dispatch and combine only
    assert (e.kind, e.axes, len(e.instructions)) == ("all-to-all", ("expert",), 2)
    assert e.compiled_bytes == 2 * 4 * (8 * 40 * 256 * 4)  # as moe_expert4: t = 128, C = 40
    # moe_expert4's FLOPs plus the shared SwiGLU: 3 matmuls of 2 * t * D * (S F) on the 128 local tokens
    routed = 2 * 128 * 256 * 8 + 3 * 2 * 256 * 512 * 8 * 40
    assert r.flops_compiled == routed + 3 * 2 * 128 * 256 * (2 * 512) == r.flops_predicted


def test_shared_experts_bad_size_is_a_user_error_naming_it(jax_devices):
    from lab.core.plan import kernel_plan

    with pytest.raises(UserError, match=r"moe_shared_mlp: dim S=0 must be a positive integer"):
        kernel_plan("moe_shared_mlp", {"data": 2, "expert": 4}, {**SIZES, "S": 0}).validate()


def test_a_run_reports_the_routing_load_the_reference_counts(jax_devices, tmp_path):
    """shardlab run of an MoE experiment states the router's load (imbalance, drops) in report.json and
    report.md: the load report of the inputs it ran, counted again here by a plain loop over the routing."""
    from kernels.moe import _route
    from kernels.registry import build
    from lab.run.experiment import load_experiment
    from lab.run.pipeline import run_experiment

    path = os.path.join(REPO, "experiments", "moe_expert4.toml")
    result = run_experiment(path, str(tmp_path / "runs"), quiet=True, hardware="cpu")
    routing = result.report["routing"]
    x, w_router = build(load_experiment(path).plan).host_args[:2]  # the inputs the run drew (seed 0)
    _, experts = _route(x, w_router, 2)
    routed = np.bincount(np.asarray(experts).ravel(), minlength=8)
    assert routing["routed"] == routed.tolist() and sum(routing["kept"]) + routing["dropped"] == 2 * 1024
    assert routing["imbalance"] == pytest.approx(routed.max() / routed.mean())
    md = (result.run_dir / "report.md").read_text()
    assert f"load imbalance {routing['imbalance']:.2f}" in md and f"{routing['dropped']} assignments dropped" in md
