"""``shardlab explain sharding``: each array's logical dims, mesh axes and bytes per device, the large replicated ones a
rule could shard, and every compiled collective traced to the rule that causes it. Expected values are counted by
hand from the experiment files (TINY: V=88, D=56, L=2, N=8, K=4, H=12, F=104; mesh data=2, model=4)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
from cli_runner import run_cli

from lab.run.experiment import load_experiment

ROOT = Path(__file__).resolve().parent.parent
EXPERIMENTS = ROOT / "experiments"
PARAMS = {"embed", "unembed", "final_norm"} | {
    f"layers/{n}" for n in ("attn_norm", "mlp_norm", "wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")
}
GLOBAL = {  # each parameter's elements, float32
    "embed": 88 * 56,
    "unembed": 56 * 88,
    "final_norm": 56,
    "layers/attn_norm": 2 * 56,
    "layers/mlp_norm": 2 * 56,
    "layers/wq": 2 * 56 * 8 * 12,
    "layers/wk": 2 * 56 * 4 * 12,
    "layers/wv": 2 * 56 * 4 * 12,
    "layers/wo": 2 * 8 * 12 * 56,
    "layers/w_gate": 2 * 56 * 104,
    "layers/w_up": 2 * 56 * 104,
    "layers/w_down": 2 * 104 * 56,
}


@pytest.fixture
def cli():
    return run_cli


def _plan(name: str):
    return load_experiment(EXPERIMENTS / name).plan


@pytest.fixture(scope="module")
def fsdp_tp(jax_devices):
    from lab.compile.sharding import explain_sharding

    return json.loads(json.dumps(explain_sharding(_plan("train_fsdp_tp.toml")).to_dict()))


@pytest.fixture(scope="module")
def dp(jax_devices):
    from lab.compile.sharding import explain_sharding

    return json.loads(json.dumps(explain_sharding(_plan("train_dp.toml")).to_dict()))


def _by_name(data, kind="parameter"):
    return {a["name"]: a for a in data["arrays"] if a["kind"] == kind}


def test_fsdp_tp_weights_are_split_over_both_axes_and_hold_a_shard_each(fsdp_tp):
    params = _by_name(fsdp_tp)
    assert set(params) == PARAMS
    gate = params["layers/w_gate"]  # [L, D, F]: D over data, F over model
    assert gate["logical"] == ["layers", "embed", "ffw"] and gate["spec"] == [None, "data", "model"]
    assert gate["bytes_per_device"] == 2 * 56 * 104 * 4 / (2 * 4) == 5824
    assert gate["replicated_over"] == []
    wq = params["layers/wq"]  # [L, D, N, H]
    assert wq["spec"] == [None, "data", "model", None] and wq["bytes_per_device"] == 2 * 56 * 8 * 12 * 4 / 8
    norm = params["final_norm"]  # [D]: D over data, nothing on model
    assert norm["spec"] == ["data"] and norm["bytes_per_device"] == 56 * 4 / 2 and norm["replicated_over"] == ["model"]
    # every weight but the norms splits over all 8 devices; the norms over data only
    assert sum(p["bytes_per_device"] for p in params.values()) == 4 * (
        sum(n for k, n in GLOBAL.items() if "norm" not in k) / 8 + sum(n for k, n in GLOBAL.items() if "norm" in k) / 2
    )
    state = _by_name(fsdp_tp, "optimizer state")
    assert state["mu/layers/w_gate"]["spec"] == gate["spec"] and state["nu/layers/w_gate"]["bytes_per_device"] == 5824


def test_the_saved_layer_input_is_split_by_batch_and_replicated_over_model(fsdp_tp):
    acts = _by_name(fsdp_tp, "activation")
    assert {"residual", "q", "k", "v", "mlp_hidden", "logits"} <= set(acts)  # remat none: all saved
    x = acts["residual"]  # [B, T, D] float32, B over data; one per layer
    assert x["logical"] == ["batch", "sequence", "act_embed"] and x["spec"] == ["data", None, None]
    assert x["bytes_per_device"] == 8 * 32 * 56 * 4 / 2 and x["copies"] == 2 and x["replicated_over"] == ["model"]
    q = acts["q"]  # [B, T, N, H]: B over data, N over model
    assert q["spec"] == ["data", None, "model", None] and q["bytes_per_device"] == 8 * 32 * 8 * 12 * 4 / 8
    warned = {w["array"]: w for w in fsdp_tp["warnings"]}
    assert set(warned) == {"residual"}  # 57.3 kB of the listed bytes: T or D could go over model (Megatron SP)
    assert warned["residual"]["rules"] == ['[rules] sequence = "model"', '[rules] act_embed = "model"']


def test_fsdp_gathers_and_gradient_reductions_are_traced_to_the_embed_and_batch_rules(fsdp_tp):
    cs = fsdp_tp["collectives"]
    assert cs and all(c["rules"] for c in cs), [c for c in cs if not c["rules"]]
    gathers = [c for c in cs if c["kind"] == "all-gather"]
    assert gathers and all(c["axes"] == ["data"] and c["rules"] == ["embed -> data"] for c in gathers)
    assert {n for c in gathers for n in c["arrays"]} == PARAMS  # every weight gathered before it is used
    assert all(c["source"].startswith("kernels/transformer/") for c in gathers)
    grads = [c for c in cs if c["kind"] == "all-reduce" and c["axes"] == ["data"]]
    assert grads and all(c["rules"] == ["batch -> data", "embed -> data"] for c in grads)
    model = [c for c in cs if c["axes"] == ["model"] and "/jvp()/while/" in c["op_name"]]  # the forward's layers
    by_scope = {("attention/out" if "attention/out" in c["op_name"] else "mlp/down"): c["rules"] for c in model}
    assert by_scope == {"attention/out": ["heads -> model"], "mlp/down": ["ffw -> model"]}


def test_data_parallel_replicates_every_weight_and_names_the_fsdp_rule(dp):
    params = _by_name(dp)
    assert set(params) == PARAMS
    for name, p in params.items():
        assert p["replicated_over"] == ["data", "model"] and all(e is None for e in p["spec"]), name
        assert p["bytes_per_device"] == GLOBAL[name] * 4, name
    cs = dp["collectives"]
    assert len(cs) == 2 and all(c["kind"] == "all-reduce" and c["axes"] == ["data", "model"] for c in cs)
    assert all(c["rules"] == ["batch -> data,model"] for c in cs)
    warned = {w["array"]: w for w in dp["warnings"]}
    assert warned["layers/wq"]["rules"] == ['[rules] embed = "data"', '[rules] embed = "model"']
    assert "final_norm" not in warned  # 224 B, under 1% of the bytes listed
    # heads over data would put data on two dims of q [B over data and model, T, N, H]: never suggested
    assert not any("heads" in r or "ffw" in r for w in dp["warnings"] for r in w["rules"])


def test_a_big_dim_the_rules_leave_unsharded_is_warned_with_the_rule_that_shards_it(jax_devices):
    from kernels.registry import build
    from lab.compile.sharding import arguments, placed, replication_warnings

    plan = _plan("train_fsdp_tp.toml")
    plan = dataclasses.replace(plan, rules=dataclasses.replace(plan.rules, ffw=None), rules_preset=None)
    arrays = arguments(plan, build(plan).abstract) + placed(plan)
    gate = next(a for a in arrays if a.name == "layers/w_gate")
    assert gate.spec == (None, "data", None) and gate.replicated_over == ("model",)
    assert gate.bytes_per_device == 2 * 56 * 104 * 4 / 2
    warned = {w["array"]: w for w in replication_warnings(plan, arrays)}
    for name in ("layers/w_gate", "layers/w_up", "layers/w_down", "mlp_hidden"):
        assert warned[name]["rules"] == ['[rules] ffw = "model"'], name
        assert warned[name]["replicated_over"] == ["model"]
    assert "layers/wq" not in warned  # its heads still split over model


def test_decode_from_the_command_line(cli):
    code, out, err = cli(["explain", "sharding", str(EXPERIMENTS / "decode_tp.toml"), "--json"])
    assert code == 0, err
    data = json.loads(out)
    cache = _by_name(data, "kv cache")["cache/k"]  # [L, B, S, K, H] bfloat16: B over data, K over model
    assert cache["spec"] == [None, "data", None, "model", None]
    assert cache["bytes_per_device"] == 2 * 8 * 64 * 4 * 12 * 2 / 8
    cs = data["collectives"]
    assert cs and all(c["rules"] and c["axes"] == ["model"] for c in cs)
    assert {r for c in cs if "attention/out" in c["op_name"] for r in c["rules"]} == {"heads -> model"}
    assert {r for c in cs if "/sample/" in c["op_name"] for r in c["rules"]} == {"vocab -> model"}
    text_code, text, _ = cli(["explain", "sharding", str(EXPERIMENTS / "decode_tp.toml")])
    assert text_code == 0 and "0 not explained" in text and "cache/k" in text


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (["experiments/train_fsdp_tp.toml", "--target", "v9x:2x4"], "unknown TPU generation"),
        (["experiments/train_fsdp_tp.toml", "--target", "nope"], "not a TPU topology or GPU name"),
        (["experiments/collective_all_gather.toml"], "explain sharding reads the Transformer's"),
        (["README.md"], "not an experiment file"),
        (["missing.toml"], "missing.toml"),
        (["experiments/train_fsdp_tp.toml", "--mesh", "data=3,model=4"], "data=3"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(cli, argv, said):
    code, out, err = cli(["explain", "sharding", *(str(ROOT / a) if a.endswith((".toml", ".md")) else a for a in argv)])
    assert code == 2 and out == "" and said in err and len(err.strip().splitlines()) == 1, err


def test_mesh_replaces_the_experiment_s_mesh(cli):
    """``--mesh`` (as ``run`` takes it): the explanation is of the Plan on that mesh, a parameter's shard with it:
    w_up ``[D_data, F_model]`` of 56 x 104 fp32 is 56/4 x 104/2 x 4 B on data=4,model=2."""
    code, out, err = cli(["explain", "sharding", str(EXPERIMENTS / "train_fsdp_tp.toml"), "--mesh", "data=4,model=2"])
    assert code == 0, err
    assert "on mesh data=4,model=2 " in out
    code, out, err = cli(
        ["explain", "sharding", str(EXPERIMENTS / "train_fsdp_tp.toml"), "--mesh", "data=4,model=2", "--json"]
    )
    arrays = {a["name"]: a for a in json.loads(out)["arrays"]}
    w_up = next(a for name, a in arrays.items() if name.endswith("w_up") and a["kind"] == "parameter")
    assert w_up["bytes_per_device"] == 2 * (56 // 4) * (104 // 2) * 4  # two layers, stacked


def test_a_program_xla_refuses_is_one_line_and_exit_2(cli, monkeypatch, jax_devices):
    import jax

    import lab.compile.sharding

    def refuse(plan, target=None):
        raise jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: the program needs 9 TiB\nmore detail")

    monkeypatch.setattr(lab.compile.sharding, "compile_plan", refuse)
    code, out, err = cli(["explain", "sharding", str(EXPERIMENTS / "train_dp.toml")])
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1, err
    assert "XLA could not compile train_dp on this host: RESOURCE_EXHAUSTED" in err


@pytest.mark.slow
def test_a_train_step_cross_compiled_for_a_tpu_is_traced_too(cli):
    pytest.importorskip("libtpu")
    argv = ["explain", "sharding", str(EXPERIMENTS / "train_fsdp_tp.toml"), "--target", "v5e:2x4", "--dtype", "bf16"]
    code, out, err = cli([*argv, "--json"])
    assert code == 0, err
    data = json.loads(out)
    assert data["compiled_for"] == "v5e:2x4" and data["backend"] == "tpu"
    assert _by_name(data)["layers/w_gate"]["bytes_per_device"] == 5824  # the float32 master weights
    gathers = [c for c in data["collectives"] if c["kind"] == "all-gather"]
    assert gathers and all(c["rules"] == ["embed -> data"] for c in gathers)
    assert all(c["rules"] for c in data["collectives"]), [c for c in data["collectives"] if not c["rules"]]
