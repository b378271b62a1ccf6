"""The user's own flax nnx model in the lab: loaded from an entry point, sharded by the Plan's rules, compiled,
audited (what it compiled to), run and reported; and the mistakes a user makes, each one line."""

import json
from pathlib import Path

import numpy as np
import pytest

from lab.cli.main import main
from lab.core.errors import UserError
from lab.run.experiment import load_experiment

ROOT = Path(__file__).resolve().parents[1]
EXP = ROOT / "experiments" / "user_flax_mlp.toml"


def test_the_experiment_loads_with_its_entry_made_absolute():
    plan = load_experiment(EXP).plan
    assert plan.program == "user_model" and plan.sizes == {"batch": 64, "d": 256, "f": 1024, "blocks": 2}
    assert plan.entry == f"{ROOT / 'experiments' / 'models' / 'tiny_flax_mlp.py'}:build"
    assert f'entry = "{plan.entry}"' in plan.to_toml()


def test_parameters_are_placed_by_the_rules_and_the_step_matches_one_device(jax_devices):
    import jax
    import jax.numpy as jnp
    from flax import nnx
    from jax.sharding import PartitionSpec as P

    from kernels.registry import build
    from kernels.user_model import load_entry

    plan = load_experiment(EXP).plan
    built = build(plan)
    state = built.abstract[0]
    # fsdp_tp: embed -> data, ffw -> model; the RMSNorm scale carries no names: replicated
    assert state["blocks"][0]["up"]["kernel"].sharding.spec == P("data", "model")
    assert state["blocks"][1]["down"]["kernel"].sharding.spec == P("model", "data")
    assert state["blocks"][0]["norm"]["scale"].sharding.spec == P(None)
    assert built.abstract[1].sharding.spec == P("data", None)  # batch -> data, act_embed replicated
    params, x = built.args
    loss, _ = built.fn(params, x)
    with nnx.use_eager_sharding(False):
        model, _ = load_entry(plan.entry)(dict(plan.sizes))
    want = jnp.mean(jnp.square(model(jnp.asarray(np.asarray(x)))))
    assert float(loss) == pytest.approx(float(jax.device_get(want)), rel=1e-5)


def test_audit_lists_what_it_compiled_to(capsys):
    assert main(["audit", str(EXP), "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    kinds = {(c["kind"], tuple(c["axes"])) for c in d["collectives"]}
    assert ("all-gather", ("data",)) in kinds and ("all-reduce", ("model",)) in kinds
    # per device: 2 blocks x 2 matmuls x 2 (fwd, and the backward's two) x batch/2 x d x f/4
    assert d["flops_compiled"] == 2 * 2 * 3 * 2 * 32 * 256 * 256 and d["all_match"] is None


def test_a_run_reports_the_roofline_of_every_compiled_op(tmp_path, capsys):
    argv = ["run", str(EXP), "--out", str(tmp_path), "--json", "--quiet"]
    assert main(argv) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["kernel"] == "user_model" and r["step_time_estimated_s"] is None and r["step_time_measured_s"] > 0
    assert r["audit"]["all_match"] is None and "user model" in r["estimate"]["note"]
    matmuls = [o for o in r["ops"] if o["kind"] == "matmul"]
    assert matmuls and all(o["predicted_s"] > 0 and o["measured_s"] for o in matmuls)


def _exp(tmp_path, entry='entry = "m.py:build"', rules='[rules]\npreset = "fsdp_tp"', code=None, sizes="d = 64"):
    (tmp_path / "m.py").write_text(code or (EXP.parent / "models" / "tiny_flax_mlp.py").read_text())
    p = tmp_path / "e.toml"
    p.write_text(
        f'[experiment]\nprogram = "user_model"\n{entry}\n[mesh]\ndata = 2\nmodel = 4\n'
        f"[sizes]\nbatch = 8\n{sizes}\nf = 128\n{rules}\n"
    )
    return str(p)


BAD_LOGICAL = """
from flax import nnx
import jax.numpy as jnp
def build(sizes):
    init = nnx.with_partitioning(nnx.initializers.lecun_normal(), ("embed", "mlp"))
    m = nnx.Linear(sizes["d"], sizes["f"], kernel_init=init, rngs=nnx.Rngs(0))
    return m, [((sizes["batch"], sizes["d"]), jnp.float32, ("batch", None))]
"""


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"entry": 'entry = "nope.py:build"'}, "no file"),
        ({"entry": 'entry = "m.py:make"'}, "has no function 'make'"),
        ({"entry": 'entry = "m.py"'}, "is not FILE.py:FUNCTION"),
        ({"entry": ""}, "needs entry"),
        ({"rules": ""}, "needs [rules]"),
        ({"code": "def build(sizes):\n    return 3\n"}, "must return (an nnx.Module, inputs) or (apply, params"),
        ({"code": "raise RuntimeError('boom')\n"}, "importing"),
        ({"code": BAD_LOGICAL}, "unknown logical dim 'mlp'"),
        ({"sizes": "d = 63"}, "does not divide"),
    ],
)
def test_user_mistakes_are_one_line_and_exit_2(tmp_path, capsys, kwargs, match):
    assert main(["audit", _exp(tmp_path, **kwargs)]) == 2
    err = capsys.readouterr().err.strip()
    assert match in err and len(err.splitlines()) == 1 and "Traceback" not in err, err


PURE = """
import jax
import jax.numpy as jnp

def apply(p, x):
    return jax.nn.gelu(x @ p["w1"]) @ p["w2"] * p["scale"]

def build(sizes):
    d, f = sizes["d"], sizes["f"]
    params = {
        "w1": ((d, f), "float32", ("embed", "ffw")),
        "w2": ((f, d), "float32", ("ffw", "embed")),
        "scale": ((d,), "float32", (None,)),
    }
    return apply, params, [((sizes["batch"], d), "float32", ("batch", None))]
"""


def test_a_pure_jax_model_is_placed_by_the_rules_and_trains(tmp_path, jax_devices):
    import jax
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec as P

    from kernels.registry import build

    plan = load_experiment(_exp(tmp_path, code=PURE)).plan
    built = build(plan)
    params_spec = built.abstract[0]
    assert params_spec["w1"].sharding.spec == P("data", "model") and params_spec["w1"].shape == (64, 128)
    assert params_spec["w2"].sharding.spec == P("model", "data") and params_spec["scale"].sharding.spec == P(None)
    params, x = built.args
    host = {k: np.asarray(v) for k, v in params.items()}
    assert np.all(host["scale"] == 1.0) and abs(float(np.std(host["w1"])) * np.sqrt(64) - 1) < 0.1  # N(0, 1/fan_in)
    loss, new = built.fn(params, x)
    xs = np.asarray(x)
    want = np.mean(np.square(np.asarray(jax.nn.gelu(jnp.asarray(xs @ host["w1"])) @ host["w2"] * host["scale"])))
    assert float(loss) == pytest.approx(float(want), rel=1e-5)
    assert not np.allclose(np.asarray(new["w1"]), host["w1"])  # one SGD step moved the weights


def test_entry_belongs_to_user_models_only(tmp_path):
    p = tmp_path / "e.toml"
    p.write_text(
        '[experiment]\nprogram = "tp_mlp"\nentry = "m.py:build"\n[mesh]\nX = 2\nY = 4\n[sizes]\nB = 8\nD = 8\nF = 8\n'
    )
    with pytest.raises(UserError, match="names the builder of a user_model"):
        load_experiment(p)
