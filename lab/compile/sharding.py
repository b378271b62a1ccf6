"""Where the Plan's sharding rules put each array, and which rule each compiled collective comes from.

This module owns ``shardlab explain sharding``. For a Transformer Plan (``train_step`` or ``decode``), compiled as
the audit compiles it (on the host, or for a TPU topology that is not here):

* **Arrays**, per device: the compiled program's arguments (``parameter``, ``optimizer state``, ``input``), read from
  its abstract arguments (their real ``NamedSharding``), and the arrays the rules place inside it (``activation``:
  what a train step saves for the backward under the Plan's remat, one layer each with ``copies`` the layers; for
  decode, the prompt's prefill; ``kv cache``). Each has its logical dims (:mod:`lab.core.arrays`), its
  ``PartitionSpec`` as mesh axes per dim, ``bytes_per_device`` (global bytes over the product of the mesh axes that
  split it) and ``replicated_over`` (the mesh axes of size > 1 that split none of its dims).
* **Warnings**: an array of at least :data:`LARGE` of the listed bytes per device replicated over a mesh axis that
  one of its unsharded dims could take, the Plan with that rule added still valid (sizes divide, no axis on two dims
  of an array). Only placement dims are suggested (``layers``, ``experts``, ``context`` change the schedule).
* **Collectives**: every collective of the optimized HLO (:func:`lab.compile.hlo.collectives`) with its mesh axes,
  bytes, source line and op scope, traced to the rules that cause it. Its operands are matched by shape to the
  arrays (a shard of an array for a gather; a gradient with its dims over the collective's axes whole for a
  reduction; size-1 dims ignored, then any order of dims); the op scope names the weights a partial sum belongs to
  (``attention/out`` -> ``wo``). A dim of those arrays that the rules put on the collective's axes is the rule: an
  all-gather over ``data`` of a weight whose ``embed`` is over ``data`` is ``embed -> data`` (FSDP); a gradient
  reduction is the ``batch`` rule (and the dim it is scattered back onto); a row-parallel matmul's all-reduce is the
  contracted dim's rule (``heads -> model``). A collective no rule explains says so.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass
from typing import Any

from lab.compile.audit import compile_plan
from lab.compile.hlo import CompiledCollective, collectives, operand_shapes, parse_module
from lab.compile.match import listed
from lab.compile.memory import shorten
from lab.compile.memory_roles import relative
from lab.compile.target import Target
from lab.compile.view import CompiledView
from lab.core import arrays as declared
from lab.core.errors import UserError
from lab.core.plan import Plan
from lab.core.rules import FIELDS
from lab.core.table import render
from lab.core.units import dtype_bytes, fmt_bytes, numpy_name

LARGE = 0.01  # a warning's threshold: this share of the listed arrays' bytes per device
PROGRAMS = ("train_step", "decode")
SUGGESTED = ("batch", "sequence", "embed", "act_embed", "heads", "kv_heads", "ffw", "vocab")
SUMMED = ("batch", "sequence", "context", "layers")  # a weight's gradient sums over B, T and the stages holding it
# What each rule is called where it causes a collective.
ROLE = {
    "batch": "data parallelism",
    "embed": "FSDP",
    "heads": "tensor parallelism",
    "kv_heads": "tensor parallelism",
    "ffw": "tensor parallelism",
    "vocab": "vocab parallelism",
    "sequence": "sequence parallelism",
    "act_embed": "activations split along D",
    "layers": "pipeline",
    "experts": "expert parallelism",
    "context": "context parallelism",
}
# The Transformer's op scopes (kernels/transformer/model.py) and source functions -> the arrays (last path part)
# whose matmul or reduction they run.
SCOPES = (
    ("attention/qkv", ("wq", "wk", "wv")),
    ("attention/out", ("wo",)),
    ("attention/norm", ("attn_norm",)),
    ("attention/scores", ("q", "k", "v")),
    ("mlp/norm", ("mlp_norm",)),
    ("mlp/up", ("w_gate", "w_up")),
    ("mlp/down", ("w_down",)),
    ("mlp/", ("router", "w_gate", "w_up", "w_down")),
    ("logits", ("unembed", "logits")),
    ("(_xent)", ("logits",)),
    ("sample", ("logits",)),
    ("embed", ("embed",)),
    ("norm", ("final_norm",)),
)
Spec = tuple[str | tuple[str, ...] | None, ...]


@dataclass(frozen=True)
class ShardedArray:
    """One array of the program: its logical dims, global shape, dtype and how the mesh splits it."""

    name: str
    kind: str  # parameter | optimizer state | input | activation | kv cache
    logical: tuple[str | None, ...]
    shape: tuple[int, ...]
    dtype: str
    spec: Spec
    bytes_per_device: float
    replicated_over: tuple[str, ...]
    copies: int = 1  # a saved activation: one per layer

    def axes(self, i: int) -> tuple[str, ...]:
        e = self.spec[i] if i < len(self.spec) else None
        return () if e is None else ((e,) if isinstance(e, str) else tuple(e))

    def per_device(self, mesh: dict[str, int], whole: frozenset[str] = frozenset()) -> tuple[int, ...]:
        """Its shape on one device; the axes in ``whole`` not splitting it (what a reduction over them holds)."""
        return tuple(n // math.prod(mesh[a] for a in self.axes(i) if a not in whole) for i, n in enumerate(self.shape))

    def to_dict(self) -> dict[str, Any]:
        return {k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(self).items()}

    def row(self) -> list[str]:
        dims = ", ".join(f"{d or '-'}:{'+'.join(self.axes(i))}".rstrip(":") for i, d in enumerate(self.logical))
        copies = f"x{self.copies}" if self.copies > 1 else ""
        over = ",".join(self.replicated_over) or "-"
        return [self.name, self.kind, dims or "(scalar)", fmt_bytes(self.bytes_per_device), copies, over]


@dataclass(frozen=True)
class TracedCollective:
    """A compiled collective and the rules that cause it (empty: not explained)."""

    listed: dict[str, Any]  # lab.compile.match.listed: name, kind, axes, bytes (all executions), dtype, source, op_name
    times: float
    arrays: tuple[str, ...]
    rules: tuple[str, ...]
    why: str

    def to_dict(self) -> dict[str, Any]:
        d = dict(self.listed) | {"source": relative(self.listed["source"]), "times": self.times}
        return d | {"arrays": list(self.arrays), "rules": list(self.rules), "why": self.why}

    def row(self) -> list[str]:
        c, rule = self.listed, "; ".join(self.rules) or "NOT EXPLAINED"
        where = shorten(relative(c["source"]) or "-", 44)
        return [
            c["kind"],
            ",".join(c["axes"]),
            fmt_bytes(c["bytes"]),
            f"{self.times:g}",
            rule,
            _few(self.arrays),
            where,
        ]


@dataclass(frozen=True)
class ShardingExplanation(CompiledView):
    program: str
    rules: dict[str, list[str]]
    remat: str
    arrays: tuple[ShardedArray, ...]
    warnings: tuple[dict[str, Any], ...]
    collectives: tuple[TracedCollective, ...]

    def to_dict(self) -> dict[str, Any]:
        return self.view_dict() | {
            "program": self.program,
            "rules": self.rules,
            "remat": self.remat,
            "large_share": LARGE,
            "arrays": [a.to_dict() for a in self.arrays],
            "warnings": list(self.warnings),
            "collectives": [c.to_dict() for c in self.collectives],
        }

    def table(self) -> str:
        rules = ", ".join(f"{k} -> {','.join(v)}" for k, v in self.rules.items()) or "none"
        head = f"sharding of {self.target} on mesh {self.mesh_text} ({self.where}); rules: {rules}"
        out = [head, "", self._arrays(), ""]
        out += self._warnings()
        unexplained = sum(1 for c in self.collectives if not c.rules)
        out += ["", f"{len(self.collectives)} collectives in the compiled program, {unexplained} not explained:"]
        rows = [c.row() for c in self.collectives]
        out.append(render(["kind", "axes", "bytes", "x", "rule", "arrays", "source"], rows) if rows else "none")
        return "\n".join(out)

    def _warnings(self) -> list[str]:
        """One line per suggested change: the large arrays it would shard and their bytes (the JSON: per array)."""
        if not self.warnings:
            return [f"no array of {100 * LARGE:g}% or more of these bytes is replicated where a rule could shard it"]
        fixes: dict[str, list[dict[str, Any]]] = {}
        for w in self.warnings:
            for axis, said in w["fixes"].items():
                fixes.setdefault(f"over {axis} (x{self.mesh[axis]}): {' or '.join(said)}", []).append(w)
        total = sum(a.bytes_per_device * a.copies for a in self.arrays)
        out = []
        for fix, ws in fixes.items():
            held = sum(w["bytes_per_device"] for w in ws)
            out.append(
                f"WARNING: {len(ws)} large array{'s' * (len(ws) > 1)} ({fmt_bytes(held)} per device, "
                f"{100 * held / total:.1f}% of those listed) replicated {fix} would shard "
                f"{'them' if len(ws) > 1 else 'it'}: {', '.join(w['array'] for w in ws)}"
            )
        return out

    def _arrays(self) -> str:
        shown = [a for a in self.arrays if a.kind != "optimizer state"]
        state = [a for a in self.arrays if a.kind == "optimizer state"]
        rows = [a.row() for a in shown]
        head = ["array", "kind", "logical dim:mesh axes", "bytes/device", "copies", "replicated over"]
        what = f"remat={self.remat}: activations saved for the backward" if self.program == "train_step" else "prefill"
        out = f"arrays per device ({what}; logical dim:mesh axes):\n" + render(head, rows)
        if state:
            like = all(a.spec == _param_spec(self.arrays, a) for a in state if a.shape)
            held = fmt_bytes(sum(a.bytes_per_device for a in state))
            out += (
                f"\noptimizer state: {len(state)} arrays, {held} per device{', each sharded as its parameter' * like}"
            )
        return out


def _param_spec(arrays: tuple[ShardedArray, ...], state: ShardedArray) -> Spec | None:
    """The spec of the parameter an optimizer-state array follows (its name ends with the parameter's)."""
    return next((p.spec for p in arrays if p.kind == "parameter" and state.name.endswith("/" + p.name)), None)


def _few(names: tuple[str, ...]) -> str:
    return ", ".join(names[:2]) + (f" +{len(names) - 2}" if len(names) > 2 else "") if names else "-"


# ----- the arrays --------------------------------------------------------------------------------


def _array(name: str, kind: str, shape, logical, dtype: str, itemsize: float, spec: Spec, mesh, copies: int = 1):
    """A :class:`ShardedArray` from its global shape and spec: bytes per device and the axes replicating it."""
    spec = tuple(spec) + (None,) * (len(shape) - len(spec))
    used = {a for e in spec if e is not None for a in ((e,) if isinstance(e, str) else e)}
    nbytes = math.prod(shape) * itemsize / math.prod(mesh[a] for a in used)
    replicated = tuple(a for a, n in mesh.items() if n > 1 and a not in used)
    return ShardedArray(name, kind, tuple(logical), tuple(shape), dtype, spec, nbytes, replicated, copies)


def arguments(plan: Plan, abstract: tuple) -> list[ShardedArray]:
    """The compiled program's arguments (``built.abstract``) with their real shardings, named by their paths
    (``layers/wq``, ``mu/layers/wq``); logical dims from the Plan's declarations (:mod:`lab.core.arrays`)."""
    import jax

    train = plan.program == "train_step"
    model = dataclasses.replace(plan.model, layers=plan.stored_layers()) if train else plan.model
    logical = dict(declared.named(declared.param_specs(model)))
    kinds = ("parameter", "optimizer state", "input") if train else ("parameter", "input")
    out = []
    for kind, tree in zip(kinds, abstract, strict=True):
        for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
            parts = jax.tree_util.keystr(path, simple=True, separator="/").split("/")
            name = "/".join(p for p in parts if p and not p.isdigit()) or "tokens"
            found = next((k for k in logical if name == k or name.endswith("/" + k)), None)
            dims = logical[found].logical_axes if found else ("batch", None) if kind == "input" else (None,) * leaf.ndim
            spec = tuple(leaf.sharding.spec)
            out.append(_array(name, kind, leaf.shape, dims, str(leaf.dtype), leaf.dtype.itemsize, spec, plan.shape))
    return out


def _activation_spec(plan: Plan, logical: tuple[str | None, ...]) -> Spec:
    """As the Transformer pins an activation: the rules' spec, and under context parallelism T of every
    ``[B, T, ...]`` over the context axes too (and the sequence axes where T is ``sequence``)."""
    rules = plan.rules
    spec = list(rules.spec(logical))
    ctx = rules.axes("context")
    if ctx and plan.program == "train_step" and len(logical) >= 3:
        t = (*ctx, *(rules.axes("sequence") if logical[1] == "sequence" else ()))
        spec[1] = t if len(t) > 1 else t[0]
    return tuple(spec)


SAVED = {"none": ("residual", "q", "kv", "mlp_hidden"), "selective": ("residual", "q", "kv"), "full": ("residual",)}


def placed(plan: Plan) -> list[ShardedArray]:
    """The arrays the rules place inside the program (JAX-free): a train step's activations saved for the backward
    under its remat (one layer each, ``copies`` the stacked layers; the float32 logits once); decode's prompt
    activations (prefill) and its KV cache."""
    m, mesh, train = plan.model, plan.shape, plan.program == "train_step"
    seq = plan.sizes["seq"] if train else plan.sizes["prompt_len"]
    layers = plan.stored_layers() if train else m.layers
    item = dtype_bytes(plan.dtype)
    out = []
    for name, s in declared.activation_specs(m, plan.batch, seq).items():
        if name == "tokens" or (train and name != "logits" and name not in SAVED[plan.remat]):
            continue
        dtype, size = ("float32", 4.0) if name == "logits" else (numpy_name(plan.dtype), item)
        copies = layers if train and name != "logits" else 1
        spec = _activation_spec(plan, s.logical_axes)
        for n in ("k", "v") if name == "kv" else (name,):
            out.append(_array(n, "activation", s.shape, s.logical_axes, dtype, size, spec, mesh, copies))
    if not train:
        for n, s in declared.cache_specs(m, plan.batch).items():
            spec = plan.rules.spec(s.logical_axes)
            dtype = numpy_name(plan.dtype)
            out.append(_array(f"cache/{n}", "kv cache", s.shape, s.logical_axes, dtype, item, spec, mesh))
    return out


def replication_warnings(plan: Plan, arrays: list[ShardedArray]) -> list[dict[str, Any]]:
    """Large arrays replicated over a mesh axis that a rule could put on one of their unsharded dims (the Plan with
    that rule still validates). Optimizer state follows its parameter, so the parameter carries the warning."""
    total = sum(a.bytes_per_device * a.copies for a in arrays)
    valid = functools.cache(lambda dim, axis: _validates(plan, dim, axis))
    out = []
    for a in arrays:
        held = a.bytes_per_device * a.copies
        if a.kind == "optimizer state" or not a.replicated_over or held < LARGE * total:
            continue
        fixes: dict[str, list[str]] = {}
        for axis in a.replicated_over:
            for i, dim in enumerate(a.logical):
                divides = dim in SUGGESTED and not a.axes(i) and a.shape[i] % plan.shape[axis] == 0
                if divides and valid(dim, axis):
                    fixes.setdefault(axis, []).append(f'[rules] {dim} = "{axis}"')
        said = "; ".join(f"over {ax} (x{plan.shape[ax]}): {' or '.join(f)} would shard it" for ax, f in fixes.items())
        share = f"{fmt_bytes(held)} per device, {100 * held / total:.1f}% of the arrays listed"
        if fixes:
            out.append(
                {"array": a.name, "kind": a.kind, "bytes_per_device": held, "share": held / total}
                | {"replicated_over": list(a.replicated_over), "rules": [r for f in fixes.values() for r in f]}
                | {"fixes": fixes, "message": f"{a.name} ({a.kind}, {share}) is replicated {said}"}
            )
    return out


def _validates(plan: Plan, dim: str, axis: str) -> bool:
    """Whether the Plan with ``dim`` on ``axis`` (its only axis) is still a Plan the lab can build."""
    try:
        rules = dataclasses.replace(plan.rules, **{dim: axis})
        dataclasses.replace(plan, rules=rules, rules_preset=None).validate()
    except UserError:
        return False
    return True


# ----- the collectives ---------------------------------------------------------------------------


def _key(dims: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(d for d in dims if d != 1)


def _match(dims, arrays: list[ShardedArray], mesh, whole: frozenset[str], in_loop: bool) -> list[ShardedArray]:
    """Arrays of which ``dims`` is the per-device shape (with ``whole``'s axes not splitting it): one layer of a stacked
    one first inside a loop, the whole array first outside; size-1 dims aside, then in any order of dims (XLA may lay
    a gradient out transposed)."""
    key = _key(tuple(dims))
    if not key:
        return []
    views = {}
    for a in arrays:
        shape = a.per_device(mesh, whole)
        views[a.name] = (_key(shape), _key(shape[1:]) if a.logical[:1] == ("layers",) else None)
    for same in (lambda v: v == key, lambda v: v is not None and sorted(v) == sorted(key)):
        for which in (1, 0) if in_loop else (0, 1):
            found = [a for a in arrays if same(views[a.name][which])]
            if found:
                return found
    return []


def _on(a: ShardedArray, axes: frozenset[str], rules) -> list[str]:
    """The rules (logical dims) by which the collective's axes split ``a``: a dim's own, or ``context`` on T."""
    out = []
    for i, d in enumerate(a.logical):
        hit = set(a.axes(i)) & axes
        out += [x for x in (d, "context") if hit and x and set(rules.axes(x)) & hit][:1]
    return out


def _scoped(c: CompiledCollective, arrays: list[ShardedArray]) -> tuple[list[ShardedArray], bool]:
    """The arrays the op scopes of a collective name (:data:`SCOPES`; its source function where its scope names none),
    and whether that is one scope: XLA joins the op names of collectives it combines (``prefix/(a:b:c)``)."""
    name, colon = c.op_name, c.op_name.find(":")
    cut = name.rfind("/(", 0, colon) if colon >= 0 else -1
    parts = [name[: cut + 1] + p for p in name[cut + 2 : -1].split(":")] if cut >= 0 else [name]
    out: list[ShardedArray] = []
    for text in parts:
        for scope, names in SCOPES:
            found = [a for a in arrays if scope in f"{text} {c.source}" and a.name.rsplit("/", 1)[-1] in names]
            if found:
                out += [a for a in found if a not in out]
                break
    return out, len(parts) == 1


def trace(c: CompiledCollective, shapes: list[tuple[int, ...]], plan: Plan, arrays: list[ShardedArray]):
    """``(arrays, logical dims, why)`` of one collective, from its operands' shapes (see the module docstring)."""
    over = frozenset(listed(c, plan.shape)["axes"])
    mesh, rules = plan.shape, plan.rules
    reduces = c.kind in ("all-reduce", "reduce-scatter")
    backward = plan.program == "train_step" and ("transpose(" in c.op_name or not c.op_name)
    scoped, one = _scoped(c, arrays)
    first = scoped if one else []  # the arrays to match first: those of the collective's one scope
    in_loop = c.times > 1 or "while/body" in c.op_name
    on = functools.partial(_on, axes=over, rules=rules)
    names: list[str] = []
    dims: list[str] = []
    verbs: set[str] = set()
    for shape in shapes:
        if not _key(shape) and reduces:  # a scalar: the loss, summed over the batch shards
            dims += [d for d in ("batch",) if set(rules.axes(d)) & over]
            continue
        params = [a for a in arrays if a.kind == "parameter"]
        grads = []
        if reduces and backward:
            grads = _match(shape, [a for a in first if a in params], mesh, over, in_loop)
            grads = grads or _match(shape, params, mesh, over, in_loop)
        if grads:  # a weight's gradient: summed over the shards of B and T, kept on (scattered to) its own shards
            names += [a.name for a in grads]
            dims += [d for d in SUMMED if set(rules.axes(d)) & over] + [d for a in grads for d in on(a)]
            verbs.add("sums the gradient of")
        elif reduces:  # partial sums of the scope's matmul over its contracted dims (scattered on the array's own)
            found = _match(shape, [a for a in arrays if a.kind in ("activation", "kv cache")], mesh, over, in_loop)
            names += [a.name for a in found or scoped]
            dims += [d for a in scoped for d in on(a)] + [d for a in found for d in on(a)]
            verbs.add("sums partial results into")
        else:  # a shard of an array, gathered (or sent) along the dims the axes split
            none: frozenset[str] = frozenset()
            found = _match(shape, first, mesh, none, in_loop) or _match(shape, arrays, mesh, none, in_loop)
            found = [a for a in found if on(a)]
            names += [a.name for a in found]
            dims += [d for a in found for d in on(a)]
            verbs.add("gathers" if c.kind == "all-gather" else "moves")
    if not dims:  # by the op scope alone
        dims = [d for a in scoped for d in on(a)]
        names = names or [a.name for a in scoped if on(a)]
    if not dims:  # by its kind and axes alone: a pipeline's sends, an expert layer's exchange
        wanted = {"permute": ("layers", "context"), "all-to-all": ("experts",)}.get(c.kind, ())
        dims = [d for d in wanted if set(rules.axes(d)) & over]
    return (
        tuple(dict.fromkeys(names)),
        tuple(sorted(set(dims), key=FIELDS.index)),
        " and ".join(sorted(verbs)) or c.kind,
    )


def traced_collectives(module, plan: Plan, arrays: list[ShardedArray]) -> list[TracedCollective]:
    """Every collective of the parsed HLO ``module`` with the rules that cause it."""
    by_name = {i.name: i for instrs in module.computations.values() for i in instrs}
    out: list[TracedCollective] = []
    for c in collectives(module):
        row = listed(c, plan.shape)
        if not row["axes"]:  # over size-1 axes: moves nothing
            continue
        instr = by_name.get(c.name)
        shapes = [s.dims for s in operand_shapes(module, instr)] if instr is not None else []
        names, dims, verb = trace(c, shapes, plan, [a for a in arrays if a.kind != "optimizer state"])
        rules = tuple(f"{d} -> {','.join(plan.rules.axes(d))}" for d in dims)
        why = f"{verb} {', '.join(names) or 'its operands'}: " + "; ".join(f"{d} ({ROLE[d]})" for d in dims)
        if c.explained:  # the compiler's own fix-up of a padded reduce-scatter: that reduce-scatter's rules
            padded = c.explained.partition("reduce-scatter ")[2].split(",")[0]
            first = next((t for t in out if t.listed["name"] == padded), None)
            rules, names, why = (first.rules, first.arrays, c.explained) if first else ((), (), c.explained)
        out.append(TracedCollective(row, c.times, names, rules, why if rules else "not explained"))
    return out


def explain_sharding(plan: Plan, target: Target | None = None) -> ShardingExplanation:
    """Compile the Plan's program (on the host, or for ``target``) and explain its sharding (module docstring)."""
    import jax

    if plan.program not in PROGRAMS or plan.rules is None:
        raise UserError(
            f"explain sharding reads the Transformer's {' and '.join(PROGRAMS)}, placed by sharding rules; "
            f"{plan.name or plan.program} runs {plan.program}"
        )
    try:
        built, compiled = compile_plan(plan, target)
    except jax.errors.JaxRuntimeError as exc:  # a program XLA refuses (an unsupported op, too large): its first line
        said = next(iter(str(exc).strip().splitlines()), type(exc).__name__)[:300]
        host = "on this host" if target is None else f"for {target.name}"
        raise UserError(f"XLA could not compile {plan.name or plan.program} {host}: {said}") from None
    arrays = arguments(plan, built.abstract) + placed(plan)
    module = parse_module(compiled.as_text())
    return ShardingExplanation(
        target=plan.name or plan.program,
        program=plan.program,
        mesh=dict(plan.shape),
        backend=target.backend if target is not None else jax.devices()[0].platform,
        compiled_for=target.name if target is not None else None,
        rules=plan.rules.to_dict(),
        remat=plan.remat,
        arrays=tuple(arrays),
        warnings=tuple(replication_warnings(plan, arrays)),
        collectives=tuple(traced_collectives(module, plan, arrays)),
    )


__all__ = [
    "LARGE",
    "ShardedArray",
    "ShardingExplanation",
    "TracedCollective",
    "arguments",
    "explain_sharding",
    "placed",
    "replication_warnings",
    "trace",
    "traced_collectives",
]
