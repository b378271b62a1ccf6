"""lab.predict.attention_blocks: the block-size search of the lab's Pallas flash attention (JAX-free), and its command
``shardlab roofline attention``. Expected numbers are worked out here from the kernels' tiling rule and the cost
functions of lab/core/pallas_cost.py; the search must agree with a brute force over the same grid."""

from __future__ import annotations

import dataclasses
import importlib.util
import json

import pytest

from lab.cli.main import main
from lab.core.errors import UserError
from lab.core.hardware import get_chip
from lab.core.pallas_cost import flash_cost
from lab.predict.attention_blocks import (
    GRID_STEP_S,
    VMEM_BYTES,
    block_sizes,
    price_blocks,
    search_blocks,
    vmem_footprint,
)

SHAPE = {"b": 8, "t": 4096, "s": 4096, "n": 32, "k": 8, "h": 128}
TPUS = ("v4", "v5e", "v5p", "v6e")


def test_block_sizes_are_the_tileable_divisors():
    assert block_sizes(64) == [8, 16, 32, 64]
    assert block_sizes(96) == [8, 16, 24, 32, 48, 96]
    assert block_sizes(100) == [100]  # no multiple of 8 divides it: the whole length only
    assert block_sizes(4) == [4]


def test_the_causal_pair_count_in_closed_form_equals_the_loop():
    """flash_pairs sums each query block's visible key blocks in closed form (lab.core.pallas_cost.floor_sum): the
    same count as walking the query blocks, for every tileable pair of small lengths."""
    from lab.core.pallas_cost import flash_pairs, floor_sum, last_key_block

    for t in range(8, 200, 8):
        for bq in block_sizes(t):
            for bk in block_sizes(t):
                walked = sum(last_key_block(i, bq, bk) + 1 for i in range(t // bq))
                assert flash_pairs(t, t, bq, bk, True) == walked, (t, bq, bk)
    assert floor_sum(7, 5, 3, 2) == sum((3 * i + 2) // 5 for i in range(7))
    assert flash_pairs(2**24, 2**24, 8, 8, True) == (2**21) * (2**21 + 1) // 2  # at once, not 2M steps


def test_a_pairs_price_is_its_roofline_plus_its_grid_steps():
    chip = get_chip("v5e")
    p = price_blocks(SHAPE, 512, 256, chip, "bf16", True)
    c = flash_cost(8, 4096, 4096, 32, 8, 128, 512, 256, True, 2)
    steps = 8 * 32 * 8 * 16
    compute, memory = c["flops"] / chip.flops("bf16"), c["bytes_accessed"] / chip.hbm_bandwidth
    assert (p.flops, p.bytes, p.grid_steps) == (c["flops"], c["bytes_accessed"], steps)
    assert p.time_s == pytest.approx(max(compute, memory) + steps * GRID_STEP_S, rel=1e-12)


def test_the_footprint_pads_to_the_tiles():
    """h = 12 pads to 128 lanes; bf16 rows to 16: a 16 x 8 bf16 pair's forward holds q, o (16 x 128 x 2 each) and
    k, v (16 rows after padding) twice, the logsumexp twice and the max and sum once (16 x 128 x 4), the accumulator
    (16 x 128 x 4) and two score blocks (16 x 128 x 4)."""
    q = kv = 16 * 128 * 2
    stat = 16 * 128 * 4
    want = 2 * (2 * q + 2 * kv + stat) + 2 * stat + 16 * 128 * 4 + 2 * 16 * 128 * 4
    assert vmem_footprint(16, 8, 12, 2) == want
    assert vmem_footprint(16, 8, 12, 2, backward=True) > want


@pytest.mark.parametrize("hw", TPUS)
@pytest.mark.parametrize("backward", [False, True])
def test_the_choice_is_the_brute_force_minimum_and_fits(hw, backward):
    chip = get_chip(hw)
    r = search_blocks(SHAPE, chip, backward=backward)
    sizes = block_sizes(4096)
    every = [price_blocks(SHAPE, bq, bk, chip, "bf16", True, backward) for bq in sizes for bk in sizes]
    fits = [p for p in every if p.vmem_bytes <= VMEM_BYTES[chip.name]]
    assert r.best.time_s == min(p.time_s for p in fits)
    assert r.best.vmem_bytes <= r.vmem_limit_bytes == VMEM_BYTES[chip.name]
    # nothing valid refused: every pair that fits is listed, every other one counted as too large
    assert {(p.block_q, p.block_k) for p in r.fitting} == {(p.block_q, p.block_k) for p in fits}
    assert r.too_large == len(every) - len(fits)


def test_more_vmem_never_picks_a_slower_pair():
    chip = get_chip("v5e")
    times = [search_blocks(SHAPE, chip, vmem_bytes=mib * 2**20).best.time_s for mib in (1, 2, 4, 8, 16, 64, 256)]
    assert times == sorted(times, reverse=True)
    assert times[0] > times[-1]  # 1 MiB forces small blocks


def test_a_shape_whose_only_fitting_pairs_are_tiny_still_gets_one():
    """A 48k head dimension on a v4's 16 MiB: only blocks of 8 or 16 rows fit (bf16 pads both to 16 rows; 32 x 8
    needs 24 MiB), and the search returns one of them."""
    shape = {"b": 1, "t": 64, "s": 64, "n": 1, "k": 1, "h": 49152}
    r = search_blocks(shape, get_chip("v4"))
    assert {(p.block_q, p.block_k) for p in r.fitting} == {(8, 8), (8, 16), (16, 8), (16, 16)}
    assert r.best in r.fitting and r.too_large == len(block_sizes(64)) ** 2 - 4


@pytest.mark.parametrize(
    "shape, hw, match",
    [
        ({**SHAPE, "n": 30}, "v5e", "--kv-heads 8 does not divide --heads 30"),
        ({**SHAPE, "s": 2048}, "v5e", None),  # unmasked cross attention is fine when not causal
        (SHAPE, "h100", "lowers for TPUs"),
        (SHAPE, "v3", "no VMEM figure for tpu-v3"),
        ({**SHAPE, "h": 2**22}, "v4", "no block pair fits"),
        ({**SHAPE, "b": 0}, "v5e", "--b must be a positive integer"),
    ],
)
def test_bad_input_is_one_line(shape, hw, match):
    if match is None:
        with pytest.raises(UserError, match="causal attention needs --t == --s"):
            search_blocks(shape, get_chip(hw))
        assert search_blocks(shape, get_chip(hw), causal=False).best.block_q in block_sizes(4096)
        return
    with pytest.raises(UserError, match=match) as err:
        search_blocks(shape, get_chip(hw))
    assert "\n" not in str(err.value)


def test_the_command_prints_the_best_pair(capsys):
    argv = ["roofline", "attention", "--hardware", "v5e", "--b", "8", "--t", "4096", "--s", "4096"]
    argv += ["--heads", "32", "--kv-heads", "8", "--head-dim", "128"]
    assert main(argv) == 0
    text = capsys.readouterr().out
    best = search_blocks(SHAPE, get_chip("v5e")).best
    assert f"best: block_q={best.block_q} block_k={best.block_k}" in text
    assert main([*argv, "--backward", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["backward"] and d["best"] == dataclasses.asdict(search_blocks(SHAPE, get_chip("v5e"), backward=True).best)


def test_the_command_refuses_a_gpu_in_one_line(capsys):
    argv = ["roofline", "attention", "--hardware", "h100", "--b", "1", "--t", "64", "--heads", "1"]
    assert main([*argv, "--kv-heads", "1", "--head-dim", "8"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "lowers for TPUs" in err


@pytest.mark.slow  # libtpu compiles the three Mosaic kernels per chip: ~10-25 s each on 2 cores
@pytest.mark.skipif(importlib.util.find_spec("libtpu") is None, reason="libtpu is not installed")
@pytest.mark.parametrize("target", ["v5e:2x2", "v5p:2x2x1", "v6e:2x4"])
def test_the_choice_compiles_for_the_chip(target):
    """The search's blocks for a train step's attention (forward and backward) compile with Mosaic for each chip
    (nothing runs): libtpu accepts their VMEM."""
    import functools

    import jax
    import jax.numpy as jnp
    from jax.sharding import SingleDeviceSharding

    from kernels.pallas.flash_attention import flash_attention
    from lab.compile.target import parse_target, topology_devices, uncached

    shape = {"b": 1, "t": 4096, "s": 4096, "n": 8, "k": 2, "h": 128}
    best = search_blocks(shape, get_chip(target.split(":")[0]), backward=True).best
    device = topology_devices(parse_target(target))[0]

    def spec(heads):
        return jax.ShapeDtypeStruct((1, 4096, heads, 128), jnp.bfloat16, sharding=SingleDeviceSharding(device))

    kernel = functools.partial(flash_attention, causal=True, block_q=best.block_q, block_k=best.block_k)
    grad = jax.grad(lambda q, k, v: kernel(q, k, v).astype(jnp.float32).sum(), argnums=(0, 1, 2))
    with uncached(), jax.default_device(device):
        hlo = jax.jit(grad).lower(spec(8), spec(2), spec(2)).compile().as_text()
    assert hlo.count('custom_call_target="tpu_custom_call"') == 3
