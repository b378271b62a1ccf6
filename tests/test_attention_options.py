"""The Transformer's ``attention`` option (lab/core/attention.py, kernels/transformer/attention.py): the Plan and
experiment files read it, bad values are one line, the Pallas path computes what the einsum softmax does, and the
estimator prices (and the audit holds) the kernel's FLOPs from lab/core/pallas_cost.py.

Fixed tolerances, float32: the loss to rtol 1e-6, every gradient to atol 1e-6 (the online softmax reorders sums;
gradients are of order 1e-2 to 1). Decode: the greedy tokens are identical. The audit of
``experiments/attention_pallas.toml`` must be ``all match``; cross-compiled for a v5e (libtpu) under ``slow``.
"""

from __future__ import annotations

import dataclasses
import importlib.util
from pathlib import Path

import pytest

from lab.core.attention import Attention, check_backend
from lab.core.errors import UserError
from lab.core.pallas_cost import flash_cost, flash_dkv_cost, flash_dq_cost
from lab.run.experiment import load_experiment

EXPERIMENT = Path(__file__).resolve().parent.parent / "experiments" / "attention_pallas.toml"


def _with_options(tmp_path, **options) -> Path:
    """attention_pallas.toml with [options] keys replaced (or added)."""
    lines = [ln for ln in EXPERIMENT.read_text().splitlines() if ln.split("=")[0].strip() not in options]
    at = lines.index("[options]") + 1
    lines[at:at] = [f"{k} = {v!r}" if isinstance(v, int) else f'{k} = "{v}"' for k, v in options.items()]
    path = tmp_path / "exp.toml"
    path.write_text("\n".join(lines) + "\n")
    return path


def test_the_experiment_reads_the_option_and_the_default_is_xla():
    plan = load_experiment(EXPERIMENT).plan
    assert (plan.options.attention, plan.options.attention_block_q, plan.options.attention_block_k) == (
        "pallas",
        16,
        8,
    )
    assert Attention().impl == "xla" and not Attention().fused
    assert Attention("pallas", 128, 128).blocks(32) == (32, 32)  # clipped to the sequence
    assert Attention("pallas", 16, 8).blocks(32) == (16, 8)


@pytest.mark.parametrize(
    "options, match",
    [
        ({"attention": "flash"}, "must be one of xla, pallas, splash, cudnn"),
        ({"attention_block_q": 12}, "attention_block_q = 12 does not divide the sequence length 32"),
        ({"attention_block_k": 4}, "attention_block_k = 4 cannot be tiled"),
        ({"attention_block_q": 0}, "attention_block_q"),
    ],
)
def test_bad_options_are_one_line(tmp_path, options, match):
    with pytest.raises(UserError, match=match) as err:
        load_experiment(_with_options(tmp_path, **options))
    assert "\n" not in str(err.value)


def test_kv_heads_must_follow_the_heads(tmp_path):
    path = _with_options(tmp_path)
    path.write_text(path.read_text().replace('preset = "tp"', 'preset = "tp"\nkv_heads = []'))
    with pytest.raises(UserError, match="kv_heads = \\[\\] and heads = \\['model'\\]") as err:
        load_experiment(path)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize(
    "impl, platform, match",
    [
        ("splash", "cpu", "splash.*TPU kernel"),
        ("cudnn", "tpu", "cudnn.*NVIDIA GPU"),
        ("cudnn", "cpu", "cudnn.*NVIDIA GPU"),
        ("pallas", "gpu", "not for GPUs"),
    ],
)
def test_backends_that_cannot_run_a_kernel_refuse_it(impl, platform, match):
    with pytest.raises(UserError, match=match) as err:
        check_backend(impl, platform)
    assert "\n" not in str(err.value)
    check_backend("pallas", "cpu")  # interpreted
    check_backend("splash", "tpu")
    check_backend("cudnn", "cuda")


def test_splash_on_the_host_is_refused_before_tracing(tmp_path, jax_devices):
    from kernels.registry import build

    plan = load_experiment(_with_options(tmp_path, attention="splash")).plan
    with pytest.raises(UserError, match="splash") as err:
        build(plan)
    assert "\n" not in str(err.value)


def test_the_estimate_prices_the_kernels_block_pairs(tmp_path):
    """Per device (4 sequences: batch 8 over data=2; 2 heads: 8 over model=4): forward + dq + dk/dv of the lab's
    kernel, per layer, as the estimator's attention op; causal block pairs skipped with smaller blocks."""
    from lab.core.hardware import get_chip
    from lab.predict.program.estimate import estimate_program

    plan = load_experiment(EXPERIMENT).plan
    chip = get_chip("cpu")
    for bq, bk in ((128, 128), (16, 8)):
        opts = dataclasses.replace(plan.options, attention_block_q=bq, attention_block_k=bk)
        est = estimate_program(dataclasses.replace(plan, options=opts), chip)
        (op,) = [o for o in est.ops if o.name == "attention/scores"]
        b, t, n, k, h = 4, 32, 2, 1, 12
        args = (b, t, t, n, k, h, min(bq, t), min(bk, t), True, 4)
        per_layer = sum(f(*args)["flops"] for f in (flash_cost, flash_dq_cost, flash_dkv_cost))
        assert op.flops == 2 * per_layer  # two layers
    xla = estimate_program(load_experiment(_with_options(tmp_path, attention="xla")).plan, chip)
    (dense,) = [o for o in xla.ops if o.name == "attention/scores"]
    assert dense.flops == 3 * 2 * 4 * b * n * t * t * h  # the einsum's forward and backward, no block skipped


def test_pallas_loss_and_gradients_equal_the_einsum_softmax(jax_devices):
    """The train step's loss and every gradient, attention_pallas.toml's Plan (data=2 x model=4, interpreted)."""
    import jax
    import numpy as np

    from kernels.transformer.model import init_params, synthetic_tokens, transformer_mesh
    from kernels.transformer.train import make_grads_fn
    from lab.core.attention import from_options

    plan = load_experiment(EXPERIMENT).plan
    cfg, rules, mesh = plan.model, plan.rules, transformer_mesh(plan.shape)
    params = init_params(cfg, rules, mesh, jax.random.key(0))
    tokens = synthetic_tokens(cfg, plan.sizes["batch"], plan.sizes["seq"])
    loss, grads = make_grads_fn(cfg, rules, mesh, attention=from_options(plan.options))(params, tokens)
    ref_loss, ref_grads = make_grads_fn(cfg, rules, mesh)(params, tokens)
    np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-6)
    for g, r in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads), strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=0, atol=1e-6)


def test_pallas_decode_gives_the_einsum_tokens(jax_devices):
    """Prefill by the flash kernel (8 x 16 blocks of a 16-token prompt), each step by the paged decode kernel over
    the cache read as pages of 16 positions: the greedy tokens of the einsum softmax, on data=2 x model=4."""
    import jax
    import numpy as np

    from kernels.transformer.decode import make_generate
    from kernels.transformer.model import TINY, init_params, synthetic_tokens, transformer_mesh
    from lab.core.rules import PRESETS

    mesh, rules = transformer_mesh({"data": 2, "model": 4}), PRESETS["tp"]
    params = init_params(TINY, rules, mesh, jax.random.key(0))
    prompt = synthetic_tokens(TINY, 4, 16)
    ours = make_generate(TINY, rules, mesh, 4, attention=Attention("pallas", 8, 16))(params, prompt)
    ref = make_generate(TINY, rules, mesh, 4)(params, prompt)
    np.testing.assert_array_equal(np.asarray(ours), np.asarray(ref))


def _audit(target=None, dtype=None):
    from lab.compile.audit import audit_plan
    from lab.core.hardware import get_chip

    plan = load_experiment(EXPERIMENT).plan
    if dtype:
        plan = dataclasses.replace(plan, dtype=dtype)
    chip = get_chip("cpu" if target is None else target.chip)
    return audit_plan(plan, chip, target)


def test_the_audit_of_attention_pallas_matches_on_the_host(jax_devices):
    """Interpreted, the kernels are plain HLO loops whose dots the audit counts on the grid steps that run them
    (lab/compile/hlo_branches.py): 2 layers x (forward 4 + dq 6 + dk/dv 8) x 4 sequences x 2 heads x 6 visible
    16 x 8 block pairs of 8 x 16 x 8 x 12 on each device, as the estimate says."""
    r = _audit()
    assert r.all_match and not r.unexpected, r.table()
    xla = load_experiment(EXPERIMENT).plan  # the same step with the einsum softmax: 3 x 4 instead of 18 per element
    xla = dataclasses.replace(xla, options=dataclasses.replace(xla.options, attention="xla"))
    from lab.core.hardware import get_chip
    from lab.predict.program.estimate import estimate_program

    dense = 2 * 4 * 2 * 32 * 32 * 12  # layers x sequences x heads x T x S x H
    kernels = 2 * 18 * 4 * 2 * 6 * 16 * 8 * 12  # 6 of the 8 block pairs
    assert r.flops_compiled == r.flops_predicted == estimate_program(xla, get_chip("cpu")).flops - 12 * dense + kernels
    assert 'custom_call_target="tpu_custom_call"' not in r.hlo_text


@pytest.mark.slow  # libtpu compiles the train step with its three Mosaic kernels: ~10 s on 2 cores
@pytest.mark.skipif(importlib.util.find_spec("libtpu") is None, reason="libtpu is not installed")
def test_the_audit_of_attention_pallas_matches_cross_compiled_for_a_v5e():
    """Each kernel is one ``tpu_custom_call`` per layer scan body; the audit takes its FLOPs from the kernel's
    cost estimate in the backend config, which XLA's dots cannot see."""
    from lab.compile.target import parse_target

    r = _audit(parse_target("v5e:2x4"), "bf16")
    assert r.all_match and not r.unexpected, r.table()
    assert r.hlo_text.count('custom_call_target="tpu_custom_call"') == 3  # forward, dq, dk/dv in the layer loop
