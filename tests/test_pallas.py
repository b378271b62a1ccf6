"""The lab's Pallas kernels (kernels/pallas) in interpret mode on the CPU: numerics, cost estimates, refusals.

Tolerances are fixed up front, against plain-jnp references computed in float32 from the same inputs:

* float32: rtol 1e-5, atol 1e-5, outputs and gradients alike (the online softmax only reorders the sums; the
  outputs are averages of standard-normal values, the gradients of order 1-10).
* bfloat16: rtol 2e-2, atol 5e-2 on the outputs, atol 1e-1 on the gradients (inputs are bfloat16 for both; the
  kernels round the probabilities and ``ds`` to bfloat16 once before their matmuls, as the model's attention
  rounds its softmax output; sums of ~32 such terms).

The FLOPs and bytes the cost functions must give are counted here by hand. The TPU cross-compilation (libtpu,
no TPU needed) is ``slow``.
"""

from __future__ import annotations

import functools
import importlib.util

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels.pallas import flash_attention, paged_decode
from lab.core.errors import UserError
from lab.core.pallas_cost import flash_cost, flash_dkv_cost, flash_dq_cost, flash_pairs, paged_decode_cost

F32 = {"rtol": 1e-5, "atol": 1e-5}
BF16_OUT = {"rtol": 2e-2, "atol": 5e-2}
BF16_GRAD = {"rtol": 2e-2, "atol": 1e-1}


def _qkv(b, t, n, kv, h, dtype, seed=0):
    rng = np.random.default_rng(seed)
    q, k, v = (rng.standard_normal(shape, dtype=np.float32) for shape in ((b, t, n, h), (b, t, kv, h), (b, t, kv, h)))
    return tuple(jnp.asarray(x, dtype) for x in (q, k, v))


def _reference(q, k, v, causal):
    """The model's attention (kernels/transformer/model.py ``_attend``) in float32: GQA by reshape, a causal
    mask of ``finfo.min``, softmax over keys."""
    q, k, v = (x.astype(jnp.float32) for x in (q, k, v))
    b, t, n, h = q.shape
    s_len, kv = k.shape[1], k.shape[2]
    s = jnp.einsum("btkgh,bskh->bkgts", q.reshape(b, t, kv, n // kv, h), k) * h**-0.5
    if causal:
        s = jnp.where(jnp.tril(jnp.ones((t, s_len), bool)), s, jnp.finfo(jnp.float32).min)
    o = jnp.einsum("bkgts,bskh->btkgh", jax.nn.softmax(s, axis=-1), v)
    return o.reshape(b, t, n, h)


def _values_and_grads(attend, q, k, v):
    """o and the gradients of a fixed cotangent-weighted sum (a cotangent that is not all ones)."""
    weights = jnp.cos(jnp.arange(q.size, dtype=jnp.float32).reshape(q.shape))

    def loss(q, k, v):
        return jnp.sum(attend(q, k, v).astype(jnp.float32) * weights)

    return jax.jit(attend)(q, k, v), jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)


@pytest.mark.parametrize(
    ("causal", "block_q", "block_k", "heads", "hd"),
    [
        (True, 8, 8, (4, 2), 16),
        (True, 16, 8, (4, 2), 16),
        (False, 8, 16, (4, 1), 16),
        (False, 16, 16, (2, 2), 16),
        (True, 8, 16, (4, 2), 12),  # the lab's toy models' head dimension: any H tiles, the block spans it
    ],
    ids=["causal-8x8-gqa", "causal-16x8-gqa", "full-8x16-mqa", "full-16x16-mha", "causal-head-dim-12"],
)
def test_flash_matches_the_reference_in_float32(causal, block_q, block_k, heads, hd):
    q, k, v = _qkv(2, 32, *heads, hd, jnp.float32)
    kernel = functools.partial(flash_attention, causal=causal, block_q=block_q, block_k=block_k, interpret=True)
    o, grads = _values_and_grads(kernel, q, k, v)
    o_ref, grads_ref = _values_and_grads(functools.partial(_reference, causal=causal), q, k, v)
    assert o.shape == q.shape and o.dtype == jnp.float32
    np.testing.assert_allclose(o, o_ref, **F32)
    for name, got, want in zip(("dq", "dk", "dv"), grads, grads_ref, strict=True):
        assert got.shape == want.shape, name
        np.testing.assert_allclose(got, want, **F32, err_msg=name)


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_flash_matches_the_reference_in_bfloat16(causal):
    q, k, v = _qkv(1, 32, 4, 2, 16, jnp.bfloat16, seed=1)
    kernel = functools.partial(flash_attention, causal=causal, block_q=16, block_k=8, interpret=True)
    o, grads = _values_and_grads(kernel, q, k, v)
    o_ref, grads_ref = _values_and_grads(functools.partial(_reference, causal=causal), q, k, v)
    assert o.dtype == jnp.bfloat16 and all(g.dtype == jnp.bfloat16 for g in grads)
    np.testing.assert_allclose(o.astype(np.float32), o_ref, **BF16_OUT)
    for name, got, want in zip(("dq", "dk", "dv"), grads, grads_ref, strict=True):
        np.testing.assert_allclose(got.astype(np.float32), want, **BF16_GRAD, err_msg=name)


def _pages(b, n, kv, h, page_size, pages_per_seq, dtype, seed=2):
    """A shuffled pool of pages (two more than the batch uses) and each sequence's page table."""
    rng = np.random.default_rng(seed)
    pool = b * pages_per_seq + 2
    q = rng.standard_normal((b, n, h), dtype=np.float32)
    k, v = (rng.standard_normal((pool, page_size, kv, h), dtype=np.float32) for _ in range(2))
    table = rng.permutation(pool)[: b * pages_per_seq].reshape(b, pages_per_seq).astype(np.int32)
    return jnp.asarray(q, dtype), jnp.asarray(k, dtype), jnp.asarray(v, dtype), jnp.asarray(table)


def _paged_reference(q, k_pages, v_pages, table, lengths):
    """Gather each sequence's pages into one [B, M*page_size, K, H] cache, mask past its length, attend."""
    b, n, h = q.shape
    kv = k_pages.shape[2]
    k, v = (x.astype(jnp.float32)[table].reshape(b, -1, kv, h) for x in (k_pages, v_pages))
    s = jnp.einsum("bkgh,bskh->bkgs", q.astype(jnp.float32).reshape(b, kv, n // kv, h), k) * h**-0.5
    s = jnp.where(jnp.arange(k.shape[1]) < lengths[:, None, None, None], s, -jnp.inf)
    return jnp.einsum("bkgs,bskh->bkgh", jax.nn.softmax(s, axis=-1), v).reshape(b, n, h)


# page_size 8, 4 pages a sequence: 13 ends mid-page, 1 is one token, 32 fills the table, 8 is exactly one page,
# 0 is empty (the kernel gives zeros)
LENGTHS = [13, 1, 32, 8, 0]


@pytest.mark.parametrize(
    ("dtype", "pages_per_block", "tol"),
    [(jnp.float32, 1, F32), (jnp.float32, 2, F32), (jnp.bfloat16, 4, BF16_OUT)],
    ids=["f32-1page", "f32-2pages", "bf16-4pages"],
)
def test_paged_decode_matches_gather_then_attend(dtype, pages_per_block, tol):
    q, k, v, table = _pages(len(LENGTHS), 4, 2, 16, 8, 4, dtype)
    lengths = jnp.asarray(LENGTHS, jnp.int32)
    decode = jax.jit(functools.partial(paged_decode, pages_per_block=pages_per_block, interpret=True))
    o = decode(q, k, v, table, lengths)
    assert o.shape == q.shape and o.dtype == dtype
    want = jnp.where(lengths[:, None, None] > 0, _paged_reference(q, k, v, table, lengths), 0.0)
    np.testing.assert_allclose(o.astype(np.float32), want, **tol)


def test_causal_flops_count_the_unmasked_block_pairs():
    # T = S = 32: with 8x8 blocks the 4 query blocks see 1, 2, 3 and 4 key blocks (10 pairs of 16 possible)
    assert flash_pairs(32, 32, 8, 8, True) == 10
    assert flash_pairs(32, 32, 16, 8, True) == 2 + 4  # query rows 0-15 reach key block 1, rows 16-31 block 3
    assert flash_pairs(32, 32, 8, 16, True) == 1 + 1 + 2 + 2
    b, n, kv, h = 2, 4, 2, 16
    per_pair = 2 * 8 * 8 * h + 2 * 8 * 8 * h  # q k^T and p v of one 8x8 block pair
    assert flash_cost(b, 32, 32, n, kv, h, 8, 8, True, 4)["flops"] == b * n * 10 * per_pair
    assert flash_dq_cost(b, 32, 32, n, kv, h, 8, 8, True, 4)["flops"] == b * n * 10 * 3 * 2 * 8 * 8 * h
    assert flash_dkv_cost(b, 32, 32, n, kv, h, 8, 8, True, 4)["flops"] == b * n * 10 * 4 * 2 * 8 * 8 * h


@pytest.mark.parametrize(("block_q", "block_k"), [(8, 8), (16, 8), (8, 32)])
def test_full_attention_flops_are_the_dense_formula(block_q, block_k):
    b, t, s, n, kv, h = 2, 32, 64, 4, 2, 16
    assert flash_cost(b, t, s, n, kv, h, block_q, block_k, False, 2)["flops"] == 4 * b * n * t * s * h


def test_forward_bytes_reread_kv_per_query_block():
    # B=1, N=K=1, T=S=16, H=8, float32, 8x8 blocks, full: q and o once (2 * 16*8*4), logsumexp 16*4, and each of
    # the 2 query blocks reads both key blocks of K and of V (4 pairs x 2 x 8*8*4)
    cost = flash_cost(1, 16, 16, 1, 1, 8, 8, 8, False, 4)
    assert cost["bytes_accessed"] == 2 * 16 * 8 * 4 + 16 * 4 + 4 * 2 * 8 * 8 * 4
    # causal: 3 pairs; exp of each score and each row's rescaling per pair, one log per row
    causal = flash_cost(1, 16, 16, 1, 1, 8, 8, 8, True, 4)
    assert causal["bytes_accessed"] == 2 * 16 * 8 * 4 + 16 * 4 + 3 * 2 * 8 * 8 * 4
    assert causal["transcendentals"] == 3 * (8 * 8 + 8) + 16


def test_paged_decode_cost_from_the_table_bound():
    # B=2, N=4, K=2, H=16, 3 pages of 8 tokens a sequence, bfloat16: 48 tokens at most
    cost = paged_decode_cost(2, 4, 2, 16, 3, 8, 2)
    assert cost["flops"] == 4 * 4 * 16 * 48
    assert cost["transcendentals"] == 4 * 48 + 2 * 4 * 3
    assert cost["bytes_accessed"] == 2 * (2 * 4 * 16 * 2) + 2 * 48 * 2 * 16 * 2 + 4 * (2 * 3 + 2)


def _cost_estimates(fn, *args):
    """The ``cost_estimate`` of every pallas_call in ``fn``'s jaxpr (the backward's included)."""
    found = []

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "pallas_call":
                name = eqn.params["name"]
                found.append((getattr(name, "name", name), eqn.params["cost_estimate"]))
                continue
            for value in eqn.params.values():
                for sub in value if isinstance(value, list | tuple) else (value,):
                    inner = getattr(sub, "jaxpr", sub)  # a ClosedJaxpr's Jaxpr, or a Jaxpr
                    if hasattr(inner, "eqns"):
                        walk(inner)

    walk(jax.make_jaxpr(fn)(*args).jaxpr)
    return dict(found)


def test_each_pallas_call_carries_its_cost_function():
    q, k, v = _qkv(2, 32, 4, 2, 16, jnp.bfloat16)
    kernel = functools.partial(flash_attention, causal=True, block_q=16, block_k=8, interpret=True)
    costs = _cost_estimates(jax.grad(lambda q, k, v: kernel(q, k, v).astype(jnp.float32).sum(), (0, 1, 2)), q, k, v)
    shape = (2, 32, 32, 4, 2, 16, 16, 8, True, 2)
    for name, fn in (("fwd", flash_cost), ("dq", flash_dq_cost), ("dkv", flash_dkv_cost)):
        est = costs[f"flash_attention_{name}"]
        assert (est.flops, est.transcendentals, est.bytes_accessed) == tuple(fn(*shape).values()), name
    qd, kd, vd, table = _pages(2, 4, 2, 16, 8, 3, jnp.float32)
    est = _cost_estimates(functools.partial(paged_decode, interpret=True), qd, kd, vd, table, jnp.array([5, 24]))
    assert est["paged_decode"].flops == paged_decode_cost(2, 4, 2, 16, 3, 8, 4)["flops"]


@pytest.mark.parametrize(
    ("shapes", "kwargs", "match"),
    [
        (
            ((1, 24, 4, 16), (1, 24, 2, 16)),
            {"block_q": 16, "block_k": 8},
            "block_q 16 does not divide the query length",
        ),
        (((1, 32, 4, 16), (1, 32, 2, 16)), {"block_q": 8, "block_k": 12}, "block_k 12 does not divide the key length"),
        (((1, 32, 4, 16), (1, 32, 2, 16)), {"block_q": 4, "block_k": 8}, "must be a multiple of 8"),
        (((1, 32, 4, 16), (1, 32, 3, 16)), {"block_q": 8, "block_k": 8}, "kv_heads 3 does not divide heads 4"),
        (((1, 16, 4, 16), (1, 32, 2, 16)), {"block_q": 8, "block_k": 8}, "causal flash_attention needs T == S"),
    ],
)
def test_flash_refusals_are_one_line(shapes, kwargs, match):
    q, k = (jax.ShapeDtypeStruct(s, jnp.float32) for s in shapes)
    with pytest.raises(UserError, match=match) as err:
        flash_attention(q, k, k, causal=True, interpret=True, **kwargs)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize(
    ("q_shape", "page_shape", "pages_per_block", "match"),
    [
        ((2, 4, 16), (8, 8, 2, 16), 3, "pages_per_block 3 does not divide the page table's 4 pages"),
        ((2, 4, 16), (8, 8, 3, 16), 1, "kv_heads 3 does not divide heads 4"),
    ],
)
def test_paged_decode_refusals_are_one_line(q_shape, page_shape, pages_per_block, match):
    q, pages = jax.ShapeDtypeStruct(q_shape, jnp.float32), jax.ShapeDtypeStruct(page_shape, jnp.float32)
    table, lengths = jax.ShapeDtypeStruct((2, 4), jnp.int32), jax.ShapeDtypeStruct((2,), jnp.int32)
    with pytest.raises(UserError, match=match) as err:
        paged_decode(q, pages, pages, table, lengths, pages_per_block=pages_per_block, interpret=True)
    assert "\n" not in str(err.value)


def test_flash_lowers_inside_shard_map_over_heads(jax_devices):
    """Heads sharded over the 8 emulated devices (16 query heads, 8 KV heads: 2 and 1 per device); forward and
    backward lower for the CPU in interpret mode."""
    from jax.sharding import Mesh
    from jax.sharding import PartitionSpec as P

    mesh = Mesh(np.array(jax_devices), ("heads",))
    spec = P(None, None, "heads", None)
    kernel = functools.partial(flash_attention, causal=True, block_q=8, block_k=8, interpret=True)
    sharded = jax.shard_map(kernel, mesh=mesh, in_specs=(spec, spec, spec), out_specs=spec)
    q = jax.ShapeDtypeStruct((2, 16, 16, 8), jnp.float32)
    k = jax.ShapeDtypeStruct((2, 16, 8, 8), jnp.float32)
    lowered = jax.jit(sharded).lower(q, k, k)
    assert lowered.out_info.shape == q.shape
    grad = jax.jit(jax.grad(lambda q, k, v: sharded(q, k, v).sum(), argnums=(0, 1, 2))).lower(q, k, k)
    assert [a.shape for a in grad.out_info] == [q.shape, k.shape, k.shape]
    assert 'custom_call_target="tpu_custom_call"' not in lowered.as_text()  # interpreted: plain HLO loops
    qs, ks, vs = _qkv(2, 16, 16, 8, 8, jnp.float32)  # and the forward runs: each device its own heads
    np.testing.assert_allclose(jax.jit(sharded)(qs, ks, vs), _reference(qs, ks, vs, True), **F32)


@pytest.mark.slow  # libtpu compiles the three flash kernels and the decode kernel for a v5e: ~5 s on 2 cores
@pytest.mark.skipif(
    importlib.util.find_spec("libtpu") is None, reason="libtpu is not installed (pip install -e '.[tpu]')"
)
def test_kernels_cross_compile_for_a_v5e():
    """Mosaic lowers the kernels (not interpreted) for a v5e that is not here; each pallas_call is one
    ``tpu_custom_call`` in the compiled HLO. Pallas asks the default device which TPU it lowers for, so the
    topology's device is made the default while compiling."""
    from jax.sharding import SingleDeviceSharding

    from lab.compile.target import parse_target, topology_devices, uncached

    device = topology_devices(parse_target("v5e:2x2"))[0]

    def spec(shape, dtype=jnp.bfloat16):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=SingleDeviceSharding(device))

    def compiled(fn, *args):
        with uncached(), jax.default_device(device):
            return jax.jit(fn).lower(*args).compile()

    kernel = functools.partial(flash_attention, causal=True, block_q=128, block_k=128)
    q, k = spec((1, 256, 4, 128)), spec((1, 256, 2, 128))
    forward = compiled(kernel, q, k, k)
    assert forward.as_text().count('custom_call_target="tpu_custom_call"') == 1
    xla = forward.cost_analysis()
    xla = xla[0] if isinstance(xla, list) else xla
    ours = flash_cost(1, 256, 256, 4, 2, 128, 128, 128, True, 2)
    # the TPU compiler takes the kernel's FLOPs and transcendentals from its CostEstimate (its bytes add the
    # head-major transposes around the kernel)
    assert (xla["flops"], xla["transcendentals"]) == (ours["flops"], ours["transcendentals"])
    grad = jax.grad(lambda q, k, v: kernel(q, k, v).astype(jnp.float32).sum(), argnums=(0, 1, 2))
    assert compiled(grad, q, k, k).as_text().count('custom_call_target="tpu_custom_call"') == 3  # fwd, dq, dkv
    decode = functools.partial(paged_decode, pages_per_block=2)
    pages = spec((16, 16, 2, 128))
    hlo = compiled(decode, spec((2, 8, 128)), pages, pages, spec((2, 4), jnp.int32), spec((2,), jnp.int32)).as_text()
    assert hlo.count('custom_call_target="tpu_custom_call"') == 1


def _races_found() -> bool:
    """What JAX's TPU interpreter's race detector recorded (it prints each race and sets this flag; the flag lives in
    a private module: no public accessor in JAX 0.10 or 0.11)."""
    from jax._src.pallas.mosaic.interpret import interpret_pallas_call as tpu_interpreter

    return bool(tpu_interpreter.races is not None and tpu_interpreter.races.races_found)


@pytest.mark.slow  # the TPU interpreter simulates every DMA and semaphore: 10-20 s for these small shapes
def test_the_kernels_under_tpu_semantics_race_nothing_and_compute_the_same():
    """Pallas' TPU interpreter (VMEM, DMAs and semaphores simulated, a happens-before race detector on): the flash
    forward and backward and the paged decode give what the generic interpreter gives, with no race found."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import tpu as pltpu

    # Two simulated cores share the "parallel" grid dims, so writes from different grid steps can race.
    tpu = pltpu.InterpretParams(detect_races=True, num_cores_or_threads=2)

    def both_steps_write_block_0(x_ref, o_ref):  # the control: a kernel that races
        o_ref[...] = x_ref[...] + pl.program_id(0).astype(jnp.float32)

    pltpu.reset_tpu_interpret_mode_state()
    racy = pl.pallas_call(
        both_steps_write_block_0,
        grid=(2,),
        in_specs=[pl.BlockSpec((None, 8, 128), lambda i: (i, 0, 0))],
        out_specs=pl.BlockSpec((8, 128), lambda i: (0, 0)),
        out_shape=jax.ShapeDtypeStruct((8, 128), jnp.float32),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel",)),
        interpret=tpu,
    )
    jax.block_until_ready(racy(jnp.ones((2, 8, 128), jnp.float32)))
    assert _races_found()
    pltpu.reset_tpu_interpret_mode_state()
    q, k, v = _qkv(1, 16, 2, 1, 8, jnp.float32)
    plain, grads = _values_and_grads(functools.partial(flash_attention, block_q=8, block_k=8, interpret=True), q, k, v)
    simulated, grads_tpu = _values_and_grads(
        functools.partial(flash_attention, block_q=8, block_k=8, interpret=tpu), q, k, v
    )
    np.testing.assert_allclose(simulated, plain, **F32)
    for got, want in zip(grads_tpu, grads, strict=True):
        np.testing.assert_allclose(got, want, **F32)
    q, k, v, table = _pages(len(LENGTHS), 4, 2, 16, 8, 4, jnp.float32)
    lengths = jnp.asarray(LENGTHS, jnp.int32)
    want = paged_decode(q, k, v, table, lengths, pages_per_block=2, interpret=True)
    got = paged_decode(q, k, v, table, lengths, pages_per_block=2, interpret=tpu)
    np.testing.assert_allclose(got, want, **F32)
    assert not _races_found()
