"""The compiled-program audit: every kernel on every mesh matches its prediction; a reshard is caught."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from lab.core.errors import UserError
from lab.run.experiment import load_experiment

MESHES = [{"X": 8, "Y": 1}, {"X": 2, "Y": 4}, {"X": 4, "Y": 2}, {"X": 2, "Y": 2, "Z": 2}]
MATMUL_SIZES = {"I": 7 * 8, "J": 11 * 8, "K": 13 * 8}
COLLECTIVE_SIZES = {"N": 3 * 8 * 8}
BLOCK_SIZES = {"B": 7 * 8, "D": 11 * 8, "F": 13 * 8}
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _cases():
    from kernels.registry import KERNELS

    for name, k in KERNELS.items():
        for mesh in MESHES:
            label = "x".join(str(v) for v in mesh.values())
            if k.family == "collective":
                subsets = [None, ("X",), ("Y",)] + ([("X", "Z"), ("Z", "X")] if "Z" in mesh else [])
                for axes in subsets:
                    yield pytest.param(name, mesh, COLLECTIVE_SIZES, axes, id=f"{name}-{label}-{axes}")
            else:
                sizes = BLOCK_SIZES if k.family == "block" else MATMUL_SIZES
                yield pytest.param(name, mesh, sizes, None, id=f"{name}-{label}")


@pytest.mark.parametrize(("name", "mesh", "sizes", "axes"), list(_cases()))
def test_every_kernel_matches_its_prediction(jax_devices, name, mesh, sizes, axes):
    from lab.compile.audit import audit_kernel

    r = audit_kernel(name, mesh, sizes, "fp32", axes)
    assert r.all_match, r.table()
    for e in r.entries:  # every predicted collective appears with its bytes exactly
        assert e.match and e.compiled_bytes == e.predicted_bytes, r.table()
    assert not r.unexpected
    assert r.flops_match


def test_collective_matmul_uses_permutes_where_blocking_gathers(jax_devices):
    from lab.compile.audit import audit_kernel

    ring = audit_kernel("collective_matmul_allgather", {"X": 2, "Y": 4}, MATMUL_SIZES)
    blocking = audit_kernel("matmul_allgather_blocking", {"X": 2, "Y": 4}, MATMUL_SIZES)
    assert [e.kind for e in ring.entries] == ["permute"] and [e.kind for e in blocking.entries] == ["all-gather"]
    assert "all-gather(" not in ring.hlo_text and "collective-permute" in ring.hlo_text
    assert ring.flops_compiled == blocking.flops_compiled  # same matmul work, chunked
    # Y-1 chunks of A[I/X, J/Y] in fp32 travel the ring: the bytes the blocking AllGather's output adds.
    chunk = 56 // 2 * 88 // 4 * 4
    assert ring.entries[0].compiled_bytes == 3 * chunk


def test_a_forced_reshard_is_reported_with_its_source_line(jax_devices):
    """Case 1 needs no communication; asking for an output sharded the other way forces a reshard."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from kernels.mesh import make_mesh
    from lab.compile.audit import audit_compiled
    from lab.core.hardware import get_chip
    from lab.core.plan import kernel_plan
    from lab.predict.program.estimate import estimate_program

    mesh = {"X": 2, "Y": 4}
    jmesh = make_mesh(mesh)
    a = jax.device_put(np.ones((56, 88), np.float32), NamedSharding(jmesh, P("X", None)))
    b = jax.device_put(np.ones((88, 104), np.float32), NamedSharding(jmesh, P(None, "Y")))
    wrong = NamedSharding(jmesh, P("Y", "X"))  # C[I_Y, K_X] instead of the natural C[I_X, K_Y]
    fn = jax.jit(lambda a, b: jnp.einsum("ij,jk->ik", a, b), out_shardings=wrong)
    plan = kernel_plan("sharded_matmul_case1", mesh, MATMUL_SIZES, "fp32", name="case1-misharded")
    est = estimate_program(plan, get_chip("cpu"))
    assert est.collectives() == []
    r = audit_compiled(plan, fn.lower(a, b).compile(), est, "cpu")
    assert not r.all_match and r.unexpected
    assert all("test_audit.py" in u["source"] for u in r.unexpected), r.unexpected
    assert "UNEXPECTED" in r.table()


def test_bf16_collectives_on_cpu_are_named_not_hidden(jax_devices):
    from lab.compile.audit import audit_kernel

    r = audit_kernel("collective_all_reduce", {"X": 2, "Y": 4}, COLLECTIVE_SIZES, "bf16", ("X",))
    (e,) = r.entries
    assert e.predicted_bytes == COLLECTIVE_SIZES["N"] * 2
    if e.compiled_bytes != e.predicted_bytes:  # XLA:CPU runs the bf16 all-reduce in f32
        assert e.match and "f32" in e.note and "element counts" in e.note
    assert r.all_match


SHIPPED = sorted(p for p in os.listdir(os.path.join(REPO, "experiments")) if p.endswith(".toml"))


@pytest.mark.parametrize("path", SHIPPED)
def test_shipped_experiments_load_and_say_what_they_answer(path):
    exp = load_experiment(os.path.join(REPO, "experiments", path))
    assert exp.name == path.removesuffix(".toml") and exp.devices <= 8
    with open(os.path.join(REPO, "experiments", path)) as f:
        assert f.readline().startswith("# ")  # each file says in a comment what question it answers


# Three pipelines are audited by default in tests/test_transformer_pipeline.py, with their sends counted by hand
# as well (test_experiment_audit_matches_the_estimator_with_hand_counted_sends, ..._audits_the_busiest_stage and
# test_the_circular_experiment_audits_with_hand_counted_sends): here they run under -m slow (10-20 s each).
TPU_ONLY = {"attention_splash.toml"}  # JAX's splash kernel runs on a TPU only
AUDITED_WITH_HAND_COUNTS = {"train_pipe_dp_tp.toml", "train_pipe_uneven.toml", "train_pipe_interleaved.toml"}


@pytest.mark.parametrize(
    "path",
    [pytest.param(p, marks=pytest.mark.slow) if p in AUDITED_WITH_HAND_COUNTS else p for p in SHIPPED],
)
def test_shipped_experiments_load_and_match(jax_devices, path):
    """Every shipped experiment, the Transformer's train steps and decode included, compiles to exactly the
    collectives and FLOPs the estimate of its Plan says, and nothing else."""
    from lab.compile.audit import audit_plan
    from lab.core.hardware import get_chip

    exp = load_experiment(os.path.join(REPO, "experiments", path))
    if exp.plan.spec.family == "user":  # no estimator describes a user model: what it compiled to
        from lab.compile.audit import inventory

        data, _ = inventory(exp.plan)
        assert data["collectives"] and data["flops_compiled"] > 0
        return
    if path in TPU_ONLY:  # a TPU kernel, refused here: tests/test_target.py audits it cross-compiled
        return
    r = audit_plan(exp.plan, get_chip("cpu"))
    assert r.all_match and not r.unexpected and r.flops_match, r.table()


@pytest.mark.parametrize(
    ("text", "match"),
    [
        (
            '[experiment]\nkernel = "k"\ndtype = "float64"\n[mesh]\nX = 2\n[sizes]\nN = 8\n',
            r":3: \[experiment\]\.dtype",
        ),
        ('[experiment]\nkernel = "k"\n[mesh]\nX = 0\n[sizes]\nN = 8\n', r":4: \[mesh\]\.X = 0 must be a positive"),
        (
            '[experiment]\nkernel = "k"\n[mesh]\nX = 2\n[sizes]\nN = 8\n[bogus]\n',
            r":7: \[bogus\] is not a known section",
        ),
        (
            '[experiment]\nkernal = "k"\n[mesh]\nX = 2\n[sizes]\nN = 8\n',
            r":2: \[experiment\]\.kernal is not a known field",
        ),
        (
            '[experiment]\nkernel = "k"\naxes = ["Q"]\n[mesh]\nX = 2\n[sizes]\nN = 8\n',
            r"names 'Q', which is not a mesh",
        ),
        ('[experiment]\nkernel = "k"\n[sizes]\nN = 8\n', r"missing the \[mesh\] table"),
        ("[experiment\n", r"not valid TOML"),
    ],
)
def test_bad_experiment_files_name_the_field_and_line(tmp_path, text, match):
    f = tmp_path / "bad.toml"
    f.write_text(text)
    with pytest.raises(UserError, match=match):
        load_experiment(f)


def _cli(*argv, env=None):
    e = dict(os.environ)
    e.pop("XLA_FLAGS", None)
    e.update(env or {})
    return subprocess.run(
        [sys.executable, "-m", "lab", *argv], capture_output=True, text=True, timeout=120, env=e, cwd=REPO
    )


def test_cli_audit_json_keys():
    r = _cli("audit", "experiments/sharded_matmul_case3.toml", "--sizes", "I=56,J=88,K=104", "--json")
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    assert {"entries", "unexpected", "flops_predicted", "flops_compiled", "all_match"} <= set(d)
    (e,) = d["entries"]
    assert {"op", "kind", "axes", "predicted_bytes", "compiled_bytes", "match"} <= set(e)
    assert e["kind"] == "all-reduce" and e["axes"] == ["X"] and e["compiled_bytes"] == 56 * 104 * 4
    assert d["all_match"] and d["emulated"]


@pytest.mark.parametrize(
    ("argv", "env", "needle"),
    [
        (["audit", "nope"], None, "unknown kernel 'nope'; valid: sharded_matmul_case1"),
        (["audit", "sharded_matmul_case2", "--sizes", "I=56,J=9,K=104"], None, "dim J=9 does not divide over X"),
        (
            ["audit", "sharded_matmul_case2", "--mesh", "X=4,Y=4"],
            {"XLA_FLAGS": "--xla_force_host_platform_device_count=8"},
            "needs 16 devices but 8 are available",
        ),
        (["audit", "missing.toml"], None, "experiment file 'missing.toml' does not exist"),
        (["audit"], None, "name a kernel or an experiment file"),
    ],
)
def test_cli_audit_bad_input(argv, env, needle):
    r = _cli(*argv, env=env)
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert needle in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr


# ----- the matching rules, on collectives written by hand (no compilation) ------------------------------

DATA = {"data": 2, "model": 4}  # data pairs: {0,4},{1,5},{2,6},{3,7}
OVER_DATA = ((0, 4), (1, 5), (2, 6), (3, 7))


def _got(name: str, kind: str, nbytes: float, times: float = 1.0):
    from lab.compile.hlo import CompiledCollective

    return CompiledCollective(name, kind, "bf16", nbytes, int(nbytes // 2), 2, OVER_DATA, times=times)


def _want(kind: str, nbytes: float, op: str):
    from lab.predict.program.ops import ExpectedCollective

    return ExpectedCollective(kind, ("data",), nbytes, "bf16", op)


def test_gradients_reduced_partly_as_an_all_reduce_match_with_the_split_said():
    from lab.compile.audit import compare

    want = [_want("reduce-scatter", 1000.0, "grads"), _want("all-reduce", 4.0, "loss")]
    got = [_got("rs.1", "reduce-scatter", 700.0), _got("ar.1", "all-reduce", 152.0, times=2)]
    entries, unexpected = compare(want, got, DATA)
    assert not unexpected and all(e.match for e in entries)
    (rs,) = [e for e in entries if e.kind == "reduce-scatter"]
    assert rs.compiled_bytes == 1000.0 and "304 B of it lowered as AllReduce" in rs.note
    (ar,) = [e for e in entries if e.kind == "all-reduce"]  # the loss's 4 B rode in the same AllReduces
    assert ar.predicted_bytes == ar.compiled_bytes == 4.0 and "combined" in ar.note
    # one byte off is a mismatch, not a lowering
    entries, _ = compare(want, [*got[:1], _got("ar.1", "all-reduce", 152.5, times=2)], DATA)
    assert not all(e.match for e in entries)


def test_small_gathers_lowered_as_all_reduces_match_only_when_the_kinds_add_up():
    from lab.compile.audit import compare

    want = [_want("all-gather", 5000.0, "weights"), _want("reduce-scatter", 3000.0, "grads")]
    got = [
        _got("ag.1", "all-gather", 4900.0),  # 100 B of norm scales gathered as an AllReduce of a padded buffer
        _got("rs.1", "reduce-scatter", 2800.0),
        _got("ar.1", "all-reduce", 300.0),
    ]
    entries, unexpected = compare(want, got, DATA)
    assert not unexpected and all(e.match for e in entries) and len(entries) == 3
    by_kind = {e.kind: e for e in entries}
    assert (by_kind["all-gather"].predicted_bytes, by_kind["all-gather"].compiled_bytes) == (5000.0, 4900.0)
    assert by_kind["all-reduce"].predicted_bytes == 0 and by_kind["all-reduce"].compiled_bytes == 300.0
    assert (
        "100 B less all-gather" in by_kind["all-gather"].note and "300 B more all-reduce" in by_kind["all-gather"].note
    )
    # the same collectives with 8 B more of AllReduce: the kinds do not add up, the gathers are a mismatch
    entries, unexpected = compare(want, [*got[:2], _got("ar.1", "all-reduce", 308.0)], DATA)
    assert not all(e.match for e in entries)


CTX_DATA = {"ctx": 2, "data": 2, "model": 2}  # devices c*4 + d*2 + m


def _over(name: str, kind: str, groups, nbytes: float, dtype: str = "bf16", times: float = 1.0):
    from lab.compile.hlo import CompiledCollective

    size = 4 if dtype == "f32" else 2
    return CompiledCollective(name, kind, dtype, nbytes, int(nbytes // size), len(groups[0]), groups, times=times)


CTX = ((0, 4), (1, 5), (2, 6), (3, 7))
DATA_ONLY = ((0, 2), (1, 3), (4, 6), (5, 7))
CTX_AND_DATA = ((0, 2, 4, 6), (1, 3, 5, 7))


def test_a_value_summed_over_two_axis_groups_may_be_reduced_once_over_both():
    """Weight gradients of 1,000 fp32 elements summed over ctx and then over data, K/V gradients of 300 bf16
    elements over ctx and a 1-element loss over each: the TPU compiler reduces the weights once over ctx x data
    (here 600 elements in bf16 and 400 in fp32), K/V half as an AllReduce and half as a gather's transpose (a
    ReduceScatter nobody expected). By hand: 1,000 + 300 + 1 + 1,000 + 1 = 2 x 1,000 + 150 + 150 + 1 + 1."""
    from lab.compile.audit import compare
    from lab.predict.program.ops import ExpectedCollective

    want = [
        ExpectedCollective("all-reduce", ("ctx",), 4000.0 + 4.0, "fp32", "weights and loss over ctx"),
        ExpectedCollective("all-reduce", ("ctx",), 600.0, "bf16", "K, V gradients"),
        ExpectedCollective("all-reduce", ("data",), 4000.0 + 4.0, "fp32", "weights and loss over data"),
    ]
    got = [
        _over("ar.both.1", "all-reduce", CTX_AND_DATA, 1200.0),
        _over("ar.both.2", "all-reduce", CTX_AND_DATA, 1600.0, "f32"),
        _over("ar.kv", "all-reduce", CTX, 300.0),
        _over("rs.kv", "reduce-scatter", CTX, 600.0, "f32"),
        _over("ar.loss.ctx", "all-reduce", CTX, 4.0, "f32"),
        _over("ar.loss.data", "all-reduce", DATA_ONLY, 4.0, "f32"),
    ]
    entries, unexpected = compare(want, got, CTX_DATA)
    assert not unexpected and all(e.match for e in entries), [(e.op, e.note) for e in entries]
    by_axes = {e.axes: e for e in entries}
    assert set(by_axes) == {("ctx",), ("data",), ("ctx", "data")}
    assert by_axes[("ctx", "data")].compiled_bytes == 2800.0 and "combined" in by_axes[("ctx", "data")].note
    assert set(by_axes[("ctx",)].instructions) == {"ar.kv", "rs.kv", "ar.loss.ctx"}
    # one element more over both is no longer the same values
    entries, _ = compare(want, [_over("ar.both.1", "all-reduce", CTX_AND_DATA, 1202.0), *got[1:]], CTX_DATA)
    assert not all(e.match for e in entries)
