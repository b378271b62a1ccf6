"""``experiments/decode_paged.toml``: greedy decoding with the lab's Pallas kernels (the flash kernel for the prefill,
the ragged paged decode kernel for each step; ``[options] attention = "pallas"``) gives the einsum softmax's tokens,
and the inference estimator counts the kernels' FLOPs as they compute them (lab/core/pallas_cost.py), so the host
audit is ``all match``. Interpreted on the CPU (8 emulated devices, data=2 x model=4)."""

from __future__ import annotations

import dataclasses
import importlib.util
from pathlib import Path

import pytest

from lab.core.hardware import get_chip
from lab.core.pallas_cost import flash_cost, paged_decode_cost
from lab.run.experiment import load_experiment

EXPERIMENT = Path(__file__).resolve().parent.parent / "experiments" / "decode_paged.toml"


def _plan(**options):
    plan = load_experiment(EXPERIMENT).plan
    return dataclasses.replace(plan, options=dataclasses.replace(plan.options, **options)) if options else plan


def _attention_flops(plan) -> float:
    from lab.predict.program.estimate import estimate_program

    (op,) = [o for o in estimate_program(plan, get_chip("cpu")).ops if o.name == "attention/scores"]
    return op.flops


def test_the_experiment_names_the_kernels():
    plan = _plan()
    assert plan.program == "decode"
    assert (plan.options.attention, plan.options.attention_block_q, plan.options.attention_block_k) == (
        "pallas",
        16,
        16,
    )


@pytest.mark.parametrize("bq, bk", [(16, 16), (8, 8), (16, 8), (128, 32)])
def test_the_estimate_counts_the_kernels_flops(bq, bk):
    """Per device: 4 sequences (8 over data=2), 2 query heads and 1 KV head (8 and 4 over model=4), H=12, 2 layers.
    The prefill's flash kernel over the 16-token prompt (causal pairs skipped), then 7 decode steps of the paged
    kernel over the 64-position cache in pages of block_k (clipped to 64)."""
    plan = _plan(attention_block_q=bq, attention_block_k=bk)
    b, n, k, h, layers, p, cache, steps = 4, 2, 1, 12, 2, 16, 64, 8
    bq_, bk_ = min(bq, p), min(bk, p)
    prefill = flash_cost(b, p, p, n, k, h, bq_, bk_, True, 4)["flops"]
    page = min(bk, cache)
    decode = paged_decode_cost(b, n, k, h, cache // page, page, 4)["flops"]
    assert _attention_flops(plan) == layers * (prefill + (steps - 1) * decode)


def test_one_block_a_prompt_counts_what_the_einsum_does():
    """With the prompt one block and every page of the cache read, the kernels compute the einsum's FLOPs; smaller
    prefill blocks skip the causal pairs above the diagonal (8 x 8 on 16: 3 pairs of 4)."""
    dense = _attention_flops(_plan(attention="xla"))
    assert _attention_flops(_plan()) == dense
    saved = 2 * 4 * 2 * 4 * 8 * 8 * 12  # layers x sequences x heads x one skipped 8 x 8 pair x 4 H
    assert _attention_flops(_plan(attention_block_q=8, attention_block_k=8)) == dense - saved


def test_the_xla_path_estimate_is_unchanged_by_the_blocks():
    assert _attention_flops(_plan(attention="xla", attention_block_q=8)) == _attention_flops(_plan(attention="xla"))


def test_paged_decode_gives_the_einsum_tokens(jax_devices):
    """The experiment's program, bf16, against the same program with attention = "xla": identical greedy tokens."""
    import numpy as np

    from kernels.registry import build

    ours = build(_plan())
    ref = build(_plan(attention="xla"))
    tokens = np.asarray(ours.fn(*ours.args))
    assert tokens.shape == (8, 8)
    np.testing.assert_array_equal(tokens, np.asarray(ref.fn(*ref.args)))


def test_the_audit_of_decode_paged_matches_on_the_host(jax_devices):
    from lab.compile.audit import audit_plan

    r = audit_plan(_plan(), get_chip("cpu"))
    assert r.all_match and not r.unexpected, r.table()
    assert r.flops_compiled == r.flops_predicted
    assert 'custom_call_target="tpu_custom_call"' not in r.hlo_text


@pytest.mark.slow  # libtpu compiles the prefill's flash kernel and the decode loop's paged kernel: ~5 s
@pytest.mark.skipif(importlib.util.find_spec("libtpu") is None, reason="libtpu is not installed")
@pytest.mark.parametrize("blocks", [16, 8])
def test_the_audit_of_decode_paged_matches_cross_compiled_for_a_v5e(blocks):
    """Each kernel a ``tpu_custom_call`` whose cost estimate the audit reads: the flash kernel's causal pairs (8 x 8
    blocks skip one pair of four) and the paged kernel's whole page tables."""
    from lab.compile.audit import audit_plan
    from lab.compile.target import parse_target

    plan = dataclasses.replace(_plan(attention_block_q=blocks, attention_block_k=blocks), dtype="bf16")
    r = audit_plan(plan, get_chip("tpu-v5e"), parse_target("v5e:2x4"))
    assert r.all_match and not r.unexpected, r.table()
    assert r.hlo_text.count('custom_call_target="tpu_custom_call"') >= 2
