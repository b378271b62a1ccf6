"""JAX's explicit sharding mode for the Transformer's train step (the Plan's ``sharding_mode`` option,
kernels/transformer/explicit.py) on 8 emulated CPU devices.

Every rules preset computes, in explicit mode, the loss and gradients auto mode computes; the option is read from
experiment files and a bad value is one line (exit 2 on the command line); a pipeline is refused in one line; the
audit of ``train_fsdp_tp`` in explicit mode matches the training estimator as auto mode's does.

Tolerances, fixed before the first run: float32, the loss and every gradient to rtol 1e-5 / atol 1e-6 (the same
math; the partitioner may order a cross-device sum differently).
"""

from __future__ import annotations

import dataclasses
import functools
import json
from pathlib import Path

import numpy as np
import pytest
from cli_runner import run_cli

from lab.core.errors import UserError
from lab.core.plan import Options, Plan, make_mesh_axes
from lab.core.rules import PRESETS, get_rules
from lab.run.experiment import load_experiment

RTOL, ATOL = 1e-5, 1e-6
B, T = 8, 20  # batch divides data x model = 8; T = 5 x 4 divides the model axis (sequence parallelism)
MESH = {"data": 2, "model": 4}
SINGLE = {"data": 1, "model": 1}
EXPERIMENTS = Path(__file__).resolve().parent.parent / "experiments"


def _shape(preset: str) -> dict[str, int]:
    return SINGLE if preset == "single" else MESH


@functools.cache
def _grads(preset: str, mode: str, remat: str = "none"):
    """Loss, gradients (host), the gradients' specs and the step's jaxpr text of one preset on the ``mode`` mesh."""
    import jax

    from kernels import transformer as tr
    from kernels.mesh import make_mesh

    rules = get_rules(preset)
    mesh = make_mesh(_shape(preset), explicit=mode == "explicit")
    params = tr.init_params(tr.TINY, rules, mesh, jax.random.key(0))
    tokens = jax.device_put(tr.synthetic_tokens(tr.TINY, B, T), tr.token_sharding(rules, mesh))
    fn = tr.make_grads_fn(tr.TINY, rules, mesh, remat)
    jaxpr = str(fn.trace(params, tokens).jaxpr)
    loss, grads = fn(params, tokens)
    specs = jax.tree.map(lambda g: g.sharding.spec, grads)
    return float(loss), jax.device_get(grads), specs, jaxpr


def _assert_same(got, want) -> None:
    import jax

    np.testing.assert_allclose(got[0], want[0], rtol=RTOL, atol=ATOL, err_msg="loss")
    for (path, g), w in zip(jax.tree_util.tree_leaves_with_path(got[1]), jax.tree.leaves(want[1]), strict=True):
        np.testing.assert_allclose(g, w, rtol=RTOL, atol=ATOL, err_msg=jax.tree_util.keystr(path))


@pytest.mark.parametrize("preset", list(PRESETS))
def test_every_preset_gives_auto_modes_loss_and_gradients(jax_devices, preset):
    auto, explicit = _grads(preset, "auto"), _grads(preset, "explicit")
    _assert_same(explicit, auto)
    assert explicit[2] == auto[2]  # the gradients come back placed as the parameters, in both modes
    # each mode is what it says: pins are reshards on explicit axes, sharding constraints on auto ones
    assert "sharding_constraint" in auto[3] and "sharding_constraint" not in explicit[3]
    assert explicit[3].count("reshard") > auto[3].count("reshard")  # (JAX itself reshards a constant in both)


@pytest.mark.parametrize("remat", ["selective", "full"])
def test_recomputation_under_fsdp_and_tp_gives_auto_modes_gradients(jax_devices, remat):
    _assert_same(_grads("fsdp_tp", "explicit", remat), _grads("fsdp_tp", "auto", remat))


def _run_pair(cfg, rules, shape: dict[str, int], batch: int, seq: int, **kw):
    """(loss, host gradients) in auto mode and in explicit mode, from the same key and tokens."""
    import jax

    from kernels import transformer as tr
    from kernels.mesh import make_mesh

    out = []
    for explicit in (False, True):
        mesh = make_mesh(shape, explicit=explicit)
        params = tr.init_params(cfg, rules, mesh, jax.random.key(1))
        tokens = jax.device_put(tr.synthetic_tokens(cfg, batch, seq, seed=1), tr.token_sharding(rules, mesh))
        loss, grads = tr.make_grads_fn(cfg, rules, mesh, **kw)(params, tokens)
        out.append((float(loss), jax.device_get(grads)))
    return out


@pytest.mark.parametrize("case", ["experts", "context", "pallas"])
def test_experts_context_and_an_attention_kernel_run_as_in_auto_mode(jax_devices, case):
    """The shard_map regions outside the presets: the expert layer, context parallelism (K and V resharded whole
    along T), the Pallas attention kernel (interpreted)."""
    from kernels.transformer import TINY
    from lab.core.attention import Attention

    if case == "experts":
        moe = dataclasses.replace(TINY, name="tiny-moe", experts=4, experts_per_token=2, d_ff=48)
        ep = dataclasses.replace(get_rules("tp"), batch=("data", "expert"), experts="expert")
        auto, explicit = _run_pair(moe, ep, {"data": 2, "expert": 2, "model": 2}, 8, 16)
    elif case == "context":
        cp = dataclasses.replace(get_rules("tp"), context="ctx")
        auto, explicit = _run_pair(TINY, cp, {"ctx": 2, "data": 2, "model": 2}, 8, 32)
    else:
        auto, explicit = _run_pair(TINY, get_rules("tp"), MESH, 8, 16, attention=Attention("pallas", 8, 8))
    _assert_same(explicit, auto)


def _train_plan(mode: str) -> Plan:
    from kernels.transformer import TINY

    sizes = {"batch": B, "seq": T}
    options = Options(sharding_mode=mode)
    return Plan("train_step", make_mesh_axes(MESH), sizes, model=TINY, rules=get_rules("fsdp_tp"), options=options)


def test_the_plans_train_step_runs_adamw_as_auto_mode_does(jax_devices):
    """build_train from a Plan with sharding_mode = "explicit": its mesh's axes are Explicit, the parameters and
    optimizer state keep their shardings, and three AdamW steps give auto mode's losses (the third after two updates).
    The parameters themselves are not compared: Adam's first update, lr g / (|g| + 1e-8), turns a gradient of 4.5e-8
    that the two modes sum in another order (5.8e-10 apart) into parameters 1.2e-5 apart."""
    import jax
    from jax.sharding import AxisType

    from kernels.transformer import build_train

    losses = {}
    for mode in ("auto", "explicit"):
        built = build_train(_train_plan(mode))
        mesh = jax.tree.leaves(built.abstract)[0].sharding.mesh
        assert set(mesh.axis_types) == {AxisType.Explicit if mode == "explicit" else AxisType.Auto}
        run = built.runner(built.fn.lower(*built.abstract).compile())
        losses[mode] = []
        for _ in range(3):
            out = run()
            losses[mode].append(float(out[2]))
        placed = [a.sharding.spec for a in jax.tree.leaves(out[:2])]
        assert placed == [a.sharding.spec for a in jax.tree.leaves(built.abstract[:2])]
    np.testing.assert_allclose(losses["explicit"], losses["auto"], rtol=RTOL, atol=ATOL)
    assert losses["auto"][2] < losses["auto"][0]  # the steps train


# ----- the option: read, refused, and what explicit mode does not run ------------------------------------------


def _with_options(tmp_path: Path, source: str, **options: str) -> Path:
    """An experiment file with [options] keys added (replacing any of the same name)."""
    lines = [ln for ln in (EXPERIMENTS / source).read_text().splitlines() if ln.split("=")[0].strip() not in options]
    if "[options]" not in lines:
        lines.append("[options]")
    at = lines.index("[options]") + 1
    lines[at:at] = [f'{k} = "{v}"' for k, v in options.items()]
    path = tmp_path / f"explicit_{source}"
    path.write_text("\n".join(lines) + "\n")
    return path


def test_the_option_is_read_written_and_defaults_to_auto(tmp_path):
    assert Options().sharding_mode == "auto"
    assert load_experiment(EXPERIMENTS / "train_fsdp_tp.toml").plan.options.sharding_mode == "auto"
    plan = load_experiment(_with_options(tmp_path, "train_fsdp_tp.toml", sharding_mode="explicit")).plan
    assert plan.options.sharding_mode == "explicit"
    assert plan.to_dict()["options"]["sharding_mode"] == "explicit"
    again = tmp_path / "again.toml"
    again.write_text(plan.to_toml())
    assert load_experiment(again).plan.options == plan.options


def test_a_bad_value_is_one_line():
    with pytest.raises(UserError) as err:
        Options(sharding_mode="implicit")
    assert str(err.value) == "sharding_mode 'implicit' is not one of auto, explicit"


@pytest.mark.parametrize("command", ["audit", "run"])
def test_a_bad_value_in_a_file_exits_2_with_one_line(tmp_path, command):
    path = _with_options(tmp_path, "train_fsdp_tp.toml", sharding_mode="implicit")
    code, out, err = run_cli([command, str(path)])
    assert code == 2, (out, err)
    (line,) = err.strip().splitlines()
    assert "sharding_mode" in line and "'implicit'" in line and "auto, explicit" in line, line


@pytest.mark.parametrize(
    ("source", "needle"),
    [
        ("train_pipe_dp_tp.toml", 'sharding_mode = "explicit" does not run a pipeline'),
        ("decode_tp.toml", "applies to the Transformer's train_step; decode runs in auto mode"),
    ],
)
def test_what_explicit_mode_does_not_run_is_refused_in_one_line(tmp_path, source, needle):
    path = _with_options(tmp_path, source, sharding_mode="explicit")
    code, _, stderr = run_cli(["audit", str(path)])
    assert code == 2 and needle in stderr and len(stderr.strip().splitlines()) == 1, stderr


def test_a_pipeline_on_an_explicit_mesh_is_refused_by_the_kernel(jax_devices):
    from kernels.mesh import make_mesh
    from kernels.transformer import TINY, make_grads_fn

    rules = dataclasses.replace(get_rules("tp"), layers="pipe")
    mesh = make_mesh({"pipe": 2, "data": 2, "model": 2}, explicit=True)
    with pytest.raises(UserError, match="does not run a pipeline") as err:
        make_grads_fn(dataclasses.replace(TINY, layers=4), rules, mesh, microbatches=2)
    assert "\n" not in str(err.value)


# ----- the audit ------------------------------------------------------------------------------------------------


def _audit(path: Path) -> dict:
    code, out, err = run_cli(["audit", str(path), "--json"])
    assert code == 0, err
    return json.loads(out)


def test_the_audit_of_train_fsdp_tp_in_explicit_mode_matches_as_auto_mode_does(jax_devices, tmp_path):
    auto = _audit(EXPERIMENTS / "train_fsdp_tp.toml")
    explicit = _audit(_with_options(tmp_path, "train_fsdp_tp.toml", sharding_mode="explicit"))
    assert auto["all_match"] and explicit["all_match"]
    assert not explicit["unexpected"]
    compiled = lambda r: [(e["kind"], e["axes"], e["compiled_bytes"], e["match"]) for e in r["entries"]]  # noqa: E731
    assert compiled(explicit) == compiled(auto)  # the same collectives, over the same axes, with the same bytes
    assert explicit["flops_compiled"] == pytest.approx(auto["flops_compiled"], rel=1e-6)
