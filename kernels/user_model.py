"""The user's own model: a flax ``nnx`` Module whose parameters carry logical axis names, trained one step.

An experiment names an entry point, ``entry = "models/tiny_flax_mlp.py:build"`` (a file beside the experiment) or
``"package.module:build"``. The function is called with the experiment's sizes and returns the module and its
inputs::

    def build(sizes: dict[str, int]) -> tuple[nnx.Module, list[tuple[tuple[int, ...], str, tuple[str | None, ...]]]]:
        model = MyModel(sizes["d"], sizes["f"], rngs=nnx.Rngs(0))   # kernels made with nnx.with_partitioning
        return model, [((sizes["batch"], sizes["d"]), "float32", ("batch", "act_embed"))]

A pure-JAX model returns ``(apply, params, inputs)`` instead: ``apply(params, *xs)`` and ``params`` as
``{name: (shape, dtype, logical axes)}``, which the lab initialises N(0, 1/fan_in) (vectors at one).

Parameters are annotated as flax users write them (``nnx.with_partitioning(init, ("embed", "ffw"))``) with the
logical dims of :mod:`lab.core.rules` (``batch``, ``embed``, ``act_embed``, ``heads``, ``kv_heads``, ``ffw``,
``vocab``, ...); the Plan's rules map them to mesh axes, as they do for the lab's Transformer. The program is a
train step: the loss is the mean square of the module's output (in float32), its gradient is taken with
``jax.value_and_grad`` over the parameters, and plain SGD updates them (donated, carried from step to step).

The module is built abstractly first (``nnx.eval_shape``, eager sharding off), so a real-size model is compiled
without allocating it; real parameters are initialised on the devices, already sharded, when a run needs them.
"""

from __future__ import annotations

import importlib
import importlib.util
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from kernels.mesh import make_mesh
from kernels.program import Built
from lab.core.errors import UserError
from lab.core.plan import Plan


def _where(exc: BaseException, files: tuple[str, ...]) -> str:
    """The innermost line of the user's own files in the exception's traceback (``models/mlp.py:12``), else ''."""
    where, tb = "", exc.__traceback__
    while tb is not None:
        name = tb.tb_frame.f_code.co_filename
        if any(name == f or name.endswith(f"/{f}") for f in files):
            where = f"{name}:{tb.tb_lineno}"
        tb = tb.tb_next
    return where


def _theirs(entry: str, what: str, exc: BaseException, files: tuple[str, ...]) -> UserError:
    """The user's code failed or tried to end the process: said as theirs, with the line, and not our traceback.
    ``sys.exit`` in a builder would otherwise end shardlab with no report (and a code of 0)."""
    where = _where(exc, files)
    at = f" at {where}" if where else ""
    if isinstance(exc, SystemExit):
        return UserError(
            f"entry {entry!r}: {what} called sys.exit({exc.code!r}){at}; a model's builder must return, not exit"
        )
    return UserError(f"entry {entry!r}: {what} failed{at}: {type(exc).__name__}: {exc}")


def _user_files(fn: Callable) -> tuple[str, ...]:
    module = sys.modules.get(getattr(fn, "__module__", "") or "")
    path = getattr(module, "__file__", None)
    return (path,) if path else ()


def call_user(entry: str, what: str, fn: Callable, *args: Any) -> Any:
    """Call the user's ``fn``: an exception or an exit from their code becomes a UserError naming their line
    (Ctrl-C stays Ctrl-C; the lab's own UserErrors pass through)."""
    try:
        return fn(*args)
    except (KeyboardInterrupt, UserError):
        raise
    except (Exception, SystemExit) as exc:  # their code: any failure is theirs to see
        raise _theirs(entry, what, exc, _user_files(fn)) from None


ENTRY = re.compile(r"^(?P<target>[\w./\-]+?(?:\.py)?):(?P<func>[A-Za-z_]\w*)$")
LEARNING_RATE = 1e-2


def load_entry(entry: str) -> Callable[[dict[str, int]], Any]:
    """The function an entry names (``path/file.py:func`` or ``package.module:func``); a :class:`UserError` naming
    what is missing otherwise."""
    m = ENTRY.match(entry)
    if not m:
        raise UserError(f"entry {entry!r} is not FILE.py:FUNCTION or MODULE:FUNCTION (e.g. models/mlp.py:build)")
    target, func = m.group("target"), m.group("func")
    if target.endswith(".py"):
        path = Path(target)
        if not path.is_file():
            raise UserError(f"entry {entry!r}: no file {target!r}")
        name = f"shardlab_user_{abs(hash(str(path.resolve())))}"
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        try:
            spec.loader.exec_module(module)
        except (Exception, SystemExit) as exc:  # the user's file: say which and why, without our traceback
            raise _theirs(entry, f"importing {target}", exc, (str(path), str(path.resolve()))) from None
    else:
        try:
            module = importlib.import_module(target)
        except ImportError as exc:
            raise UserError(f"entry {entry!r}: cannot import {target!r} ({exc})") from None
        except (Exception, SystemExit) as exc:  # their module ran and failed, or exited
            raise _theirs(entry, f"importing {target}", exc, ()) from None
    fn = getattr(module, func, None)
    if not callable(fn):
        raise UserError(f"entry {entry!r}: {target} has no function {func!r}")
    return fn


@dataclass(frozen=True)
class _Model:
    """What the step needs of a user's model, whichever way it was written: the abstract parameters (a pytree of
    ``ShapeDtypeStruct``), each leaf's logical axes (same order as the leaves), ``apply(params, *xs)``, ``init()``
    (real parameters, traced under jit), and the inputs."""

    params: Any
    logical: list[tuple[str | None, ...]]
    apply: Callable
    init: Callable[[], Any]
    inputs: list


def _abstract_model(plan: Plan) -> _Model:
    """The entry called once abstractly (``nnx.eval_shape`` for a Module; a pure-JAX entry describes its
    parameters itself): nothing is allocated."""
    from flax import nnx

    fn = load_entry(plan.entry)
    sizes = dict(plan.sizes)
    box: dict[str, Any] = {}

    def make():
        out = call_user(plan.entry, "building the model", fn, sizes)
        box["out"] = out
        if isinstance(out, tuple) and len(out) == 2 and isinstance(out[0], nnx.Module):
            return out[0]
        return nnx.Module()  # not a Module: the pure-JAX form, read below

    try:
        with nnx.use_eager_sharding(False):
            module = nnx.eval_shape(make)
    except UserError:
        raise
    except Exception as exc:  # building the user's module failed: their code, their message
        raise UserError(f"entry {plan.entry!r}: building the model failed: {type(exc).__name__}: {exc}") from None
    out = box["out"]
    if isinstance(out, tuple) and len(out) == 2 and isinstance(out[0], nnx.Module):
        graphdef, state = nnx.split(module)
        specs = jax.tree.leaves(nnx.get_partition_spec(state), is_leaf=lambda x: x is None or isinstance(x, P))

        def init():
            with nnx.use_eager_sharding(False):
                return nnx.split(call_user(plan.entry, "building the model", fn, sizes)[0])[1]

        return _Model(
            state,
            [() if sp is None else tuple(sp) for sp in specs],  # an unannotated parameter (None): replicated
            lambda st, *xs: call_user(plan.entry, "the model's forward pass", nnx.merge(graphdef, st), *xs),
            init,
            _inputs(plan.entry, out[1]),
        )
    if isinstance(out, tuple) and len(out) == 3 and callable(out[0]) and isinstance(out[1], dict):
        return _pure(plan.entry, *out)
    raise UserError(
        f"entry {plan.entry!r} must return (an nnx.Module, inputs) or (apply, params, inputs) with params a dict of "
        f"name -> (shape, dtype, logical axes); got {type(out).__name__}"
    )


def _pure(entry: str, apply: Callable, params: dict, raw_inputs) -> _Model:
    """A pure-JAX model: ``apply(params, *xs)`` and ``params`` as ``{name: (shape, dtype, logical axes)}``,
    initialised N(0, 1/fan_in) (the first dim is fan-in), vectors at one."""
    leaves = _inputs(entry, list(params.values()), what="parameter", names=list(params))
    abstract = {k: jax.ShapeDtypeStruct(shape, dt) for k, (shape, dt, _) in zip(params, leaves, strict=True)}

    def init():
        key = jax.random.key(0)
        out = {}
        for i, (k, (shape, dt, _)) in enumerate(zip(params, leaves, strict=True)):
            if len(shape) < 2:
                out[k] = jnp.ones(shape, dt)
            else:
                w = jax.random.normal(jax.random.fold_in(key, i), shape, jnp.float32) / np.sqrt(shape[0])
                out[k] = w.astype(dt)
        return out

    by_name = dict(zip(params, (axes for _, _, axes in leaves), strict=True))
    logical = [by_name[k] for k in sorted(params)]  # a dict's leaves come in its sorted keys' order
    return _Model(
        abstract,
        logical,
        lambda p, *xs: call_user(entry, "the model's apply", apply, p, *xs),
        init,
        _inputs(entry, raw_inputs),
    )


def _inputs(
    entry: str, raw, what: str = "input", names: list[str] | None = None
) -> list[tuple[tuple[int, ...], Any, tuple[str | None, ...]]]:
    out = []
    for i, item in enumerate(raw if isinstance(raw, list | tuple) else [None]):
        label = f"{what} {names[i] if names else i}"
        try:
            shape, dtype, axes = item
            shape, dtype, axes = tuple(int(s) for s in shape), jnp.dtype(dtype), tuple(axes)
        except (TypeError, ValueError):
            raise UserError(
                f"entry {entry!r}: {label} must be (shape, dtype, logical axes), e.g. "
                '((8, 512), "float32", ("batch", "act_embed")); got ' + repr(item)
            ) from None
        if len(axes) != len(shape):
            raise UserError(f"entry {entry!r}: {label} has {len(shape)} dims and {len(axes)} logical axes")
        out.append((shape, dtype, axes))
    return out


def _sharding(plan: Plan, mesh: Mesh, logical: tuple[str | None, ...], shape: tuple[int, ...], what: str):
    if len(logical) > len(shape):
        raise UserError(f"{what}: {len(logical)} logical axes {logical} for {len(shape)} dims")
    logical = tuple(logical) + (None,) * (len(shape) - len(logical))  # a shorter spec: the rest replicated
    spec = plan.rules.spec(logical, what)
    for dim, (n, axes) in enumerate(zip(shape, spec, strict=True)):
        if axes is None:
            continue
        k = int(np.prod([mesh.shape[a] for a in ((axes,) if isinstance(axes, str) else axes)]))
        if n % k:
            raise UserError(
                f"{what}: dim {dim} ({logical[dim]}) of size {n} does not divide over {axes} ({k} devices); give a "
                f"size divisible by {k} or change the rules"
            )
    return NamedSharding(mesh, P(*spec))


def build_user(plan: Plan, mesh: Mesh | None = None, *, seed: int = 0) -> Built:
    """The user's model as a train step on ``mesh`` (default: the Plan's, on the first devices)."""
    plan.validate()
    m = mesh if mesh is not None else make_mesh(plan.shape, slow=plan.slow_axes)
    model = _abstract_model(plan)
    leaves, tree = jax.tree.flatten(model.params)
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(model.params)[0]]
    state_sh = jax.tree.unflatten(
        tree,
        [
            _sharding(plan, m, axes, leaf.shape, f"parameter {path}")
            for leaf, axes, path in zip(leaves, model.logical, paths, strict=True)
        ],
    )
    inputs = model.inputs
    in_sh = [_sharding(plan, m, axes, shape, f"input {i}") for i, (shape, _, axes) in enumerate(inputs)]

    def step(state, *xs):
        def loss_fn(st):
            return jnp.mean(jnp.square(jnp.asarray(model.apply(st, *xs), jnp.float32)))

        loss, grads = jax.value_and_grad(loss_fn)(state)
        return loss, jax.tree.map(lambda p, g: p - LEARNING_RATE * g, state, grads)

    fn = jax.jit(
        step, in_shardings=(state_sh, *in_sh), out_shardings=(NamedSharding(m, P()), state_sh), donate_argnums=0
    )
    abstract = (
        jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), model.params, state_sh),
        *(jax.ShapeDtypeStruct(shape, dt, sharding=s) for (shape, dt, _), s in zip(inputs, in_sh, strict=True)),
    )

    def make_args():
        params = jax.jit(model.init, out_shardings=state_sh)()
        rng = np.random.default_rng(seed)
        xs = []
        for (shape, dt, _), s in zip(inputs, in_sh, strict=True):
            host = rng.integers(0, 2, shape) if jnp.issubdtype(dt, jnp.integer) else rng.standard_normal(shape)
            xs.append(jax.device_put(host.astype(dt), s))
        return (params, *xs)

    def carry(out, args):  # the parameters were donated: continue from the step's
        return (out[1], *args[1:])

    return Built(fn, abstract, make_args, carry=carry)


__all__ = ["build_user", "load_entry"]
