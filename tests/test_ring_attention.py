"""Ring attention on 8 emulated CPU devices: numerics against one device, the audit of both experiments, errors.

Tolerances are fixed: float32 rtol 1e-5, atol 1e-5 (softmax weights sum to one, so outputs are averages of
standard-normal values; the online softmax reorders the sums); bfloat16 rtol 2e-2, atol 5e-2 (inputs rounded to
8 bits of mantissa, probabilities rounded once before the second matmul).

The bytes and FLOPs the audit must find are written out here by hand, not taken from the estimator.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

from lab.core.errors import UserError

F32_RTOL, F32_ATOL = 1e-5, 1e-5
BF16_RTOL, BF16_ATOL = 2e-2, 5e-2
SIZES = {"B": 4, "T": 64, "H": 2, "D": 8}  # small: 8 query positions per device on context = 8
MESHES = {
    "data2_context4": {"data": 2, "context": 4},
    "context8": {"data": 1, "context": 8},
    "data4_context2": {"data": 4, "context": 2},
}
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _qkv(sizes, seed=0):
    rng = np.random.default_rng(seed)
    shape = tuple(sizes[d] for d in ("B", "T", "H", "D"))
    return tuple(rng.standard_normal(shape, dtype=np.float32) for _ in range(3))


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("mesh_name", list(MESHES))
def test_matches_the_single_device_reference(jax_devices, mesh_name, causal):
    import jax
    from jax.sharding import NamedSharding

    from kernels.mesh import make_mesh
    from kernels.ring_attention import qkv_spec, reference_attention, ring_attention

    mesh = make_mesh(MESHES[mesh_name])
    sharding = NamedSharding(mesh, qkv_spec(mesh))
    q, k, v = _qkv(SIZES)
    out = ring_attention(mesh, causal=causal)(*(jax.device_put(x, sharding) for x in (q, k, v)))
    ref = reference_attention(q, k, v, causal=causal)
    assert out.shape == ref.shape and out.dtype == np.float32
    assert out.sharding.is_equivalent_to(sharding, 4)
    np.testing.assert_allclose(np.asarray(out), ref, rtol=F32_RTOL, atol=F32_ATOL)


def test_reference_is_causal():
    """The last query sees every key; the first sees only itself, so its output is its own value."""
    from kernels.ring_attention import reference_attention

    q, k, v = _qkv({"B": 1, "T": 16, "H": 1, "D": 4})
    out = reference_attention(q, k, v)
    np.testing.assert_allclose(out[:, 0], v[:, 0], rtol=F32_RTOL, atol=F32_ATOL)
    full = reference_attention(q, k, v, causal=False)
    np.testing.assert_allclose(out[:, -1], full[:, -1], rtol=F32_RTOL, atol=F32_ATOL)


@pytest.mark.parametrize(("dtype", "rtol", "atol"), [("fp32", F32_RTOL, F32_ATOL), ("bf16", BF16_RTOL, BF16_ATOL)])
def test_built_from_a_plan_matches_its_reference(jax_devices, dtype, rtol, atol):
    """The registry path: a Plan (mesh completed with data = 1), standard-normal inputs in the Plan's dtype."""
    from kernels.registry import build
    from lab.core.plan import kernel_plan

    plan = kernel_plan("ring_attention", {"context": 4}, SIZES, dtype)
    assert plan.shape == {"context": 4, "data": 1}
    built = build(plan)
    out = built.fn(*built.args)
    assert out.dtype == ("float32" if dtype == "fp32" else "bfloat16")
    ref = built.reference(*built.host_args)
    np.testing.assert_allclose(np.asarray(out, np.float32), ref, rtol=rtol, atol=atol)


# ----- the audit: bytes and FLOPs by hand ----------------------------------------------------------------------


def _hand(b, t, h, d, data, c, nbytes=4):
    """Per device: c - 1 permutes of K and V blocks [B/data, T/c, H, D]; c blocks of two matmuls of 2*(T/c)^2*D
    FLOPs per (batch, head), every block computed (the causal skip is a select, not a saving)."""
    bl, tl = b // data, t // c
    permute = (c - 1) * 2 * bl * tl * h * d * nbytes
    flops = c * 2 * (2 * bl * h * tl * tl * d)
    return permute, flops


@pytest.mark.parametrize(
    ("path", "c", "permute_bytes", "flops"),
    [
        # 3 steps x (K, V) x [2, 256, 8, 64] fp32; 4 blocks x 2 matmuls x 2*2*8*256*256*64
        ("ring_attention_context4.toml", 4, 3 * 2 * 2 * 256 * 8 * 64 * 4, 4 * 2 * 2 * 2 * 8 * 256 * 256 * 64),
        # 7 steps x (K, V) x [4, 128, 8, 64] fp32; 8 blocks x 2 matmuls x 2*4*8*128*128*64
        ("ring_attention_context8.toml", 8, 7 * 2 * 4 * 128 * 8 * 64 * 4, 8 * 2 * 2 * 4 * 8 * 128 * 128 * 64),
    ],
)
def test_experiment_audit_finds_the_hand_counted_permutes(jax_devices, path, c, permute_bytes, flops):
    from lab.compile.audit import audit_plan
    from lab.core.hardware import get_chip
    from lab.run.experiment import load_experiment

    exp = load_experiment(os.path.join(REPO, "experiments", path))
    s, mesh = exp.plan.sizes, exp.plan.shape
    assert (permute_bytes, flops) == _hand(s["B"], s["T"], s["H"], s["D"], mesh["data"], mesh["context"])
    r = audit_plan(exp.plan, get_chip("cpu"))
    assert r.all_match and not r.unexpected, r.table()
    (e,) = r.entries
    assert (e.kind, e.axes) == ("permute", ("context",))
    assert e.predicted_bytes == permute_bytes and e.compiled_bytes == permute_bytes, r.table()
    assert len(e.instructions) == c - 1  # K and V stacked: one collective-permute per ring step
    assert r.flops_compiled == flops and r.flops_predicted == flops
    assert "all-gather(" not in r.hlo_text and "all-reduce(" not in r.hlo_text


def test_estimate_prices_the_ring_overlapped_with_the_blocks():
    from lab.core.hardware import get_chip
    from lab.core.plan import kernel_plan
    from lab.predict.program.estimate import estimate_program

    sizes = {"B": 4, "T": 1024, "H": 8, "D": 64}
    for dtype, nbytes in (("fp32", 4), ("bf16", 2)):
        plan = kernel_plan("ring_attention", {"data": 2, "context": 4}, sizes, dtype)
        est = estimate_program(plan, get_chip("h100"))
        attn, ring = est.ops
        assert (attn.name, attn.kind, attn.scope) == ("attention/ring", "attention", "attention/ring")
        assert attn.flops == est.flops == 4 * 2 * 256 * 1024 * 8 * 64  # not halved: see the estimator's docstring
        assert (ring.kind, ring.axes, ring.calls) == ("permute", ("context",), 3)
        assert ring.bytes == 3 * 2 * 2 * 256 * 8 * 64 * nbytes
        assert est.step_time_s == max(attn.time_s, ring.time_s)
    alone = estimate_program(kernel_plan("ring_attention", {"data": 4, "context": 1}, sizes), get_chip("h100"))
    assert [o.kind for o in alone.ops] == ["attention"] and alone.collectives() == []


# ----- bad input, before anything compiles -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("mesh", "sizes", "match"),
    [
        (
            {"data": 2, "context": 4},
            {**SIZES, "T": 66},
            r"T=66 does not divide over mesh axis context \(4 devices\); use a multiple of 4, e.g. T=64",
        ),
        (
            {"data": 4, "context": 2},
            {**SIZES, "B": 6},
            r"B=6 does not divide over mesh axis data \(4 devices\); use a multiple of 4, e.g. B=4",
        ),
        ({"data": 2, "context": 4}, {**SIZES, "H": 0}, r"dim H=0 must be a positive integer"),
    ],
)
def test_bad_sizes_are_user_errors_naming_the_value(jax_devices, mesh, sizes, match):
    from kernels.mesh import make_mesh
    from kernels.registry import get_kernel
    from lab.core.plan import kernel_plan

    with pytest.raises(UserError, match=match):  # the Plan, before JAX is asked for anything
        kernel_plan("ring_attention", mesh, sizes).validate()
    with pytest.raises(UserError, match=match):  # the kernel built directly on a mesh
        get_kernel("ring_attention").build(make_mesh(mesh), sizes)


def test_bad_experiment_file_names_its_line(tmp_path):
    from lab.run.experiment import load_experiment

    f = tmp_path / "bad.toml"
    f.write_text(
        '# bad T\n[experiment]\nprogram = "ring_attention"\n[mesh]\ndata = 2\ncontext = 4\n'
        "[sizes]\nB = 4\nT = 1022\nH = 8\nD = 64\n"
    )
    with pytest.raises(UserError, match=r"bad.toml:\d+: .*T=1022 does not divide .* e.g. T=1020"):
        load_experiment(f)


def test_a_mesh_without_a_context_axis_is_refused(jax_devices):
    from kernels.mesh import make_mesh
    from kernels.registry import get_kernel

    with pytest.raises(UserError, match=r"needs a mesh axis named 'context'; the mesh has X, Y"):
        get_kernel("ring_attention").build(make_mesh({"X": 2, "Y": 4}), SIZES)
