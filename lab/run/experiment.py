"""Experiment files: a typed schema for what to run, read into a :class:`lab.core.plan.Plan`.

```toml
# Which question this experiment answers, in a comment.
[experiment]
name = "train_fsdp_tp"                 # defaults to the file name
program = "train_step"                 # a kernel from `shardlab audit --list`, train_step or decode
hardware = "calibrated"                # the chip it is priced for (calibrated: this host's measured spec)
dtype = "float32"                      # compute dtype: float32 | bfloat16
model = "llama3-8b"                    # optional: a catalog model the [model] table overrides

[mesh]                                 # axis = size, major to minor; a slow axis (DCN / scale-out):
data = 2                               #   data = { size = 2, link = "slow" }
model = 4

[sizes]                                # the program's sizes: batch, seq (train_step); batch, prompt_len, steps
batch = 8                              # (decode); I, J, K (matmuls); B, D, F (tp_mlp); N (collectives)
seq = 32

[model]                                # model fields (see `shardlab model show`): e.g. layers = 2
[rules]                                # preset = "fsdp_tp", and/or logical dim = mesh axis (or a list of them)
[options]                              # remat, optimizer, param_dtype, microbatch, zero, attention, sharding_mode, ...
[run]                                  # warmup, repeats (profiling)
[sweep]                                # size = [values]: one run per combination
```

Every table is checked with types and units; an unknown key or a bad value is named with the file, its line
and what is valid, before anything is imported or compiled. ``kernel = ...`` (for ``program``) and ``[run]``
keys ``rules``, ``remat`` and ``[run.sweep]`` from earlier files are still read.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lab.core import limits
from lab.core.attention import IMPLEMENTATIONS
from lab.core.errors import UserError
from lab.core.models import ZERO_MEANS_NONE, ModelConfig, model_from_fields
from lab.core.notation import AXIS_NAME  # the names --mesh takes
from lab.core.plan import LINKS, REMAT, SHARDING_MODES, MeshAxis, Options, Plan
from lab.core.programs import ProgramSpec, complete_mesh, get_program
from lab.core.rules import FIELDS, PRESETS, ShardingRules, rules_from_table
from lab.core.schema import Field, check_value, read_table
from lab.core.units import RUN_DTYPES, canonical_dtype
from lab.predict.training.config import ELEMENTWISE, MAX_CHECKPOINTS_PER_LAYER
from lab.predict.training.remat import ALL as REMAT_ALL
from lab.run.serve_table import serve_table

# Over 500 lines on purpose: the experiment file's whole schema, a table a section, beside the one reader of it.
DTYPES = (*RUN_DTYPES, "f32", "fp8")  # fp8: priced by the estimators, not run
EXPERIMENT = {
    "name": Field("str", "the run directory's default name"),
    "program": Field("str", "what to build and run"),
    "kernel": Field("str", "the same as program (earlier files)"),
    "hardware": Field("str", "chip the prediction is priced for; calibrated = this host's measured spec"),
    "dtype": Field("str", "compute dtype", DTYPES),
    "axes": Field("strs", "collective microkernels: the mesh axes they span"),
    "question": Field("str", "what the experiment asks"),
    "model": Field("str", "a catalog model the [model] table overrides"),
    "entry": Field("str", "user_model: FILE.py:FUNCTION (beside the experiment) or MODULE:FUNCTION building it"),
}
RUN = {
    "warmup": Field("int0", "untraced calls before the profiled ones"),
    "repeats": Field("int+", "profiled calls"),
    "rules": Field("str", "sharding-rules preset (earlier files; now [rules] preset)", tuple(PRESETS)),
    "remat": Field("str", "activation recomputation (earlier files; now [options] remat)", REMAT),
}
OPTIONS = {
    "remat": Field("str", "activation recomputation (a named policy prices only)", REMAT_ALL),
    "optimizer": Field("str", "optimizer whose state is kept", ("adam", "adamw", "sgd", "adafactor")),
    "param_dtype": Field("str", "dtype the parameters are stored in", DTYPES),
    "microbatch": Field("int+", "sequences per microbatch on each data-parallel replica"),
    "zero": Field("int0", "ZeRO stage over the data-parallel axes (0-3)"),
    "pp_schedule": Field("str", "pipeline schedule", ("gpipe", "1f1b", "interleaved")),
    "interleave": Field("int+", "model chunks per pipeline stage (interleaved schedule)"),
    "stage_split": Field("ints+", "layers on each pipeline stage, first to last (default: even)"),
    "checkpoints_per_layer": Field("number+", "the book's k saved [B, D] per layer"),
    "flash_attention": Field("bool", "fused attention: no score matrix stored"),
    "fused_projections": Field("bool", "Q/K/V and gate/up fused into one weight each (Megatron)"),
    "causal": Field("bool", "causal attention mask"),
    "cast_first": Field("bool", "fp32 weights cast to the compute dtype before FSDP gathers them (the TPU compiler)"),
    "cast_first_out_table": Field("bool", "with cast_first, the output table cast before its gather (not XLA:GPU)"),
    "regather_norms": Field("bool", "FSDP gathers the norm scales again for a recomputed forward (XLA:CPU)"),
    "jax_remat": Field("bool", "recomputation as jax.checkpoint runs it (the layer's last projection left out)"),
    "spmd_context": Field("bool", "context parallelism as the lab compiles it (K, V gathered; not a ring)"),
    "spmd_pipeline": Field("bool", "a pipeline as the lab runs it (stages compute and send in all M + p - 1 steps)"),
    "attention": Field("str", "the Transformer's attention: einsum softmax or a kernel", IMPLEMENTATIONS),
    "attention_block_q": Field("int+", "the attention kernel's query block (clipped to the sequence)"),
    "attention_block_k": Field("int+", "the attention kernel's key block (clipped to the sequence)"),
    "sharding_mode": Field("str", "JAX's sharding mode of the train step: propagated, or in the types", SHARDING_MODES),
    "moe_partial_router": Field("bool", "the router's gradient summed over the TP ranks (the lab's expert layers)"),
    # priced only (another stack's job: train estimate --plan; shardlab run refuses them), lab.core.plan.PRICED_ONLY
    "zero_shard": Field("int0", "data-parallel ranks one copy of ZeRO's state spans (0: all)"),
    "pp_embedding_slots": Field("bool", "the embedding and the loss take a pipeline slot each"),
    "attention_kernel": Field("str", "the fused attention kernel on GPUs", ("fa2", "fa3")),
    "elementwise": Field("str", "the layer's small ops: fused kernels or PyTorch eager", ELEMENTWISE),
    "tp_comm_overlap": Field("bool", "sequence parallelism's collectives hidden under the GEMMs (Transformer Engine)"),
    "dp_overlap": Field("bool", "the gradient reduction overlaps the backward, bucket by bucket"),
    "dp_bucket_mb": Field("number+", "the gradient reduction's bucket, MiB"),
    "capacity_factor": Field("number+", "a mixture of experts' capacity factor"),
    "grad_reduce": Field("str", "the dtype gradients are reduced in (default: the weights')", ("fp32", "bf16")),
}
RULES = {"preset": Field("str", "a preset the other keys override", tuple(PRESETS))} | {
    f: Field("strs", f"mesh axes of the logical dim {f}") for f in FIELDS
}
_MODEL_KIND = {int: "int+", bool: "bool", str: "str", float: "number+"}
MODEL = {
    f.name: Field(_MODEL_KIND[{"int": int, "bool": bool, "str": str, "float": float}[str(f.type)]], f.name)
    for f in dataclasses.fields(ModelConfig)
} | {"base": Field("str", "a catalog model to start from")}
for _name in ZERO_MEANS_NONE:  # 0: none (the MoE details a dense model leaves out)
    MODEL[_name] = Field("int0", _name)
SECTIONS = ("experiment", "mesh", "sizes", "model", "rules", "options", "run", "sweep", "serve")
# Untraced calls before the profiled ones when an experiment does not say. In a fresh process XLA:CPU's first
# several calls of a program run slower (measured on 2 cores: a 1 MB AllReduce, slowest device, took 1.8-2.8 ms
# in the first traced steps after one warm-up call and 0.53-0.61 ms after ten or thirty; see
# docs/validation/cpu-emulated.md), so one warm-up call is not enough.
WARMUP = 10
REPEATS = 5
MAX_CALLS = limits.MAX_CALLS  # warm-up or profiled calls of one run (lab.core.limits)
CALLS_AT_LEAST = {"warmup": 0, "repeats": 1}
MAX_DEVICES = 2**20  # the largest mesh: a million chips is past any machine built
MAX_POINTS = 256  # sweep points of one experiment: each compiles and runs, and 256 already take hours on a host


@dataclass(frozen=True)
class Experiment:
    """An experiment file as read: the Plan, and how to profile and sweep it."""

    plan: Plan
    path: str | None = None
    warmup: int = WARMUP
    repeats: int = REPEATS
    sweep: dict[str, tuple[int, ...]] = field(default_factory=dict)
    question: str = ""
    serve: dict[str, Any] | None = None  # a serve program's load ([serve]: rate or concurrency, requests, lengths)

    @property
    def name(self) -> str:
        return self.plan.name

    @property
    def kernel(self) -> str:
        return self.plan.program

    @property
    def mesh(self) -> dict[str, int]:
        return self.plan.shape

    @property
    def devices(self) -> int:
        return self.plan.devices

    def points(self) -> list[tuple[str, Plan]]:
        """``(label, plan)`` for every sweep point (one unlabelled point without a sweep), each validated."""
        if not self.sweep:
            return [("", self.plan)]
        keys = list(self.sweep)
        out = []
        for combo in itertools.product(*(self.sweep[k] for k in keys)):
            sizes = dict(self.plan.sizes) | dict(zip(keys, combo, strict=True))
            label = "-".join(f"{k}{v}" for k, v in zip(keys, combo, strict=True))
            plan = dataclasses.replace(self.plan, sizes=sizes)
            try:
                plan.validate(executable=False)
            except UserError as exc:
                raise UserError(f"{self.path}: sweep point {label}: {exc}") from None
            out.append((label, plan))
        return out


def line_of(text: str, section: str, key: str | None = None) -> int | None:
    """1-based line of ``[section]`` (or of ``key`` inside it) in the TOML text."""
    in_section = False
    k = re.escape(key) if key is not None else ""
    for i, line in enumerate(text.splitlines(), 1):
        s = line.strip()
        if s.startswith("["):
            in_section = s.strip("[] ") == section
            if in_section and key is None:
                return i
            continue
        if in_section and key is not None and re.match(rf"""(?:{k}|"{k}"|'{k}')\s*=""", s):  # bare or quoted
            return i
    return None


class _Reader:
    """One file's text and document, and where each of its values sits."""

    def __init__(self, path: Path):
        self.path = path
        if not path.is_file():
            what = "is a folder, not a file" if path.is_dir() else "does not exist"
            raise UserError(f"experiment file {str(path)!r} {what}; see experiments/ for examples")
        try:
            self.text = path.read_bytes().decode("utf-8")
        except UnicodeDecodeError as exc:
            raise UserError(f"{path}: not UTF-8 text (byte {exc.start}); save it as UTF-8") from None
        except OSError as exc:
            raise UserError(f"cannot read {str(path)!r}: {exc.strerror}") from None
        try:
            self.doc = tomllib.loads(self.text)
        except tomllib.TOMLDecodeError as exc:
            raise UserError(f"{path}: not valid TOML: {exc}") from None
        except RecursionError:
            raise UserError(
                f"{path}: arrays or tables nested too deeply to read; an experiment needs two levels"
            ) from None

    def where(self, section: str):
        def at(key: str | None) -> str:
            line = line_of(self.text, section, key) or line_of(self.text, section)
            return f"{self.path}:{line}" if line else str(self.path)

        return at

    def table(self, section: str, fields: dict[str, Field], default: dict | None = None) -> dict[str, Any]:
        raw = self.doc.get(section, default if default is not None else {})
        if section == "run" and isinstance(raw, dict):
            raw = {k: v for k, v in raw.items() if k != "sweep"}
        return read_table(raw, fields, section, self.where(section))

    def error(self, section: str, key: str | None, msg: str) -> UserError:
        return UserError(f"{self.where(section)(key)}: [{section}]{'.' + key if key else ''} {msg}")


def _mesh(r: _Reader) -> tuple[MeshAxis, ...]:
    raw = r.doc.get("mesh")
    if not isinstance(raw, dict) or not raw:
        raise UserError(f"{r.path}: missing the [mesh] table (axis = size, e.g. data = 2)")
    out = []
    for name, v in raw.items():
        if not AXIS_NAME.fullmatch(name):  # as --mesh takes them: XLA aborts the process on some other names
            raise UserError(
                f"{r.where('mesh')(name)}: [mesh] axis name {name!r} is not ASCII letters and digits starting with a "
                "letter (as --mesh takes); rename it, e.g. data = 2"
            )
        size, link = v, "fast"
        if isinstance(v, dict):
            unknown = sorted(set(v) - {"size", "link"})
            if unknown:
                raise r.error("mesh", name, f"has unknown key {unknown[0]!r}; valid: size, link")
            size, link = v.get("size"), v.get("link", "fast")
            if link not in LINKS:
                raise r.error(
                    "mesh", name, f"link = {link!r} is not one of fast (ICI / NVLink), slow (DCN / scale-out)"
                )
        try:
            check_value(size, Field("int+"))
        except ValueError:
            raise r.error("mesh", name, f"= {size!r} must be a positive integer (the axis size)") from None
        if size > MAX_DEVICES:
            raise r.error("mesh", name, f"= {size} is more devices than any machine has; at most {MAX_DEVICES}")
        out.append(MeshAxis(name, size, link))
    return tuple(out)


def _sizes(r: _Reader, dims: tuple[str, ...], program: str) -> dict[str, int]:
    raw = r.doc.get("sizes")
    if not isinstance(raw, dict) or not raw:
        raise UserError(f"{r.path}: missing the [sizes] table; {program} needs {', '.join(dims)}")
    fields = {d: Field("int+", d) for d in dims}
    sizes = read_table(raw, fields, "sizes", r.where("sizes"))
    for d in dims:
        if d not in sizes:
            raise r.error("sizes", None, f"needs {d} for {program}; give {', '.join(f'{x} = <n>' for x in dims)}")
    return sizes


def _user_sizes(r: _Reader) -> dict[str, int]:
    """A user model's sizes: any names, each a positive integer (the entry point reads them)."""
    raw = r.doc.get("sizes")
    if not isinstance(raw, dict) or not raw:
        raise UserError(f"{r.path}: missing the [sizes] table; user_model passes its sizes to the entry point")
    return read_table(raw, {k: Field("int+", k) for k in raw}, "sizes", r.where("sizes"))


def _entry(r: _Reader, exp: dict[str, Any], family: str) -> str | None:
    """``entry``, a file path made absolute against the experiment's folder; only a user_model takes one."""
    entry = exp.get("entry")
    if entry is None:
        if family == "user":
            raise r.error("experiment", None, 'user_model needs entry = "FILE.py:FUNCTION" (or "MODULE:FUNCTION")')
        return None
    if family != "user":
        raise r.error("experiment", "entry", "names the builder of a user_model; this program has its own")
    target, sep, func = entry.rpartition(":")
    if not sep or not target or not func:
        raise r.error("experiment", "entry", f"= {entry!r} is not FILE.py:FUNCTION or MODULE:FUNCTION")
    if target.endswith(".py"):
        path = (r.path.parent / target).resolve()
        if not path.is_file():
            raise r.error("experiment", "entry", f"= {entry!r}: no file {str(path)!r}")
        return f"{path}:{func}"
    return entry


def _model(r: _Reader, exp: dict[str, Any]) -> ModelConfig | None:
    table = r.table("model", MODEL)
    base = exp.get("model")
    if not table and base is None:
        return None
    if base is not None and "base" in table:
        raise r.error("model", "base", "and [experiment].model both name a base model; keep one")
    fields = dict(table) | ({"base": base} if base is not None else {})
    fields.setdefault("name", base or "custom")
    return model_from_fields(fields, where=f"{r.path}: [model]")


def _sweep(r: _Reader, sizes: dict[str, int]) -> dict[str, tuple[int, ...]]:
    legacy = r.doc.get("run", {}).get("sweep") if isinstance(r.doc.get("run"), dict) else None
    if "sweep" in r.doc and legacy is not None:
        raise r.error("run", "sweep", "and [sweep] both sweep sizes; keep one table ([sweep])")
    raw, section = (r.doc.get("sweep"), "sweep") if "sweep" in r.doc else (legacy or {}, "run.sweep")
    for k in raw if isinstance(raw, dict) else ():
        if k not in sizes:
            raise r.error(section, k, f"sweeps a size the experiment does not have ({', '.join(sizes)})")
    fields = {k: Field("ints+", f"values of {k}") for k in sizes}
    table = read_table(raw, fields, section, r.where(section))
    for k, values in table.items():
        if len(values) > MAX_POINTS:  # before the duplicate count below, which is quadratic in the length
            raise r.error(
                section, k, f"lists {len(values)} values; one experiment runs at most {MAX_POINTS} points, split it"
            )
        twice = sorted({v for v in values if list(values).count(v) > 1})
        if twice:
            raise r.error(section, k, f"lists {twice[0]} twice; each point runs once, give each value once")
    points = math.prod(len(v) for v in table.values())
    if points > MAX_POINTS:
        raise r.error(
            section,
            None,
            f"sweeps {' x '.join(str(len(v)) for v in table.values())} = {points} points; one experiment runs at "
            f"most {MAX_POINTS}, give fewer values or split it",
        )
    return {k: tuple(v) for k, v in table.items()}


def _check_hardware_and_axes(r: _Reader, exp: dict[str, Any], mesh: tuple[MeshAxis, ...]) -> None:
    """[experiment]'s hardware names a chip, and its axes (one name becomes a list) are mesh axes, each once."""
    if "hardware" in exp and not exp["hardware"].strip():
        raise r.error(
            "experiment",
            "hardware",
            f'= {exp["hardware"]!r} names no chip; give one (`shardlab hardware list`) or "calibrated"',
        )
    if isinstance(exp.get("axes"), str):  # one name; "XY" is not X and Y
        exp["axes"] = (exp["axes"],)
    if "axes" in exp and not exp["axes"]:
        raise r.error("experiment", "axes", "= [] names no mesh axis; name one or more, or leave axes out (all axes)")
    for i, a in enumerate(exp.get("axes") or ()):
        if a not in {m.name for m in mesh}:
            raise r.error(
                "experiment",
                "axes",
                f"names {a!r}, which is not a mesh axis; valid: {', '.join(m.name for m in mesh)} (a list: "
                f'axes = ["{mesh[0].name}", ...])',
            )
        if a in exp["axes"][:i]:
            raise r.error("experiment", "axes", f"names {a!r} twice; name each mesh axis once")


def _rules(
    r: _Reader, rules_table: dict[str, Any], preset: str | None, spec: ProgramSpec, shape: dict[str, int]
) -> ShardingRules | None:
    """[rules] over the completed mesh: every axis it names is the mesh's; a program with a model always has rules
    (the preset's, or the single-device default)."""
    for key, axes in rules_table.items():
        for a in (axes,) if isinstance(axes, str) else axes:
            if a not in shape:
                raise r.error(
                    "rules", key, f"= {axes!r} names mesh axis {a!r}, which the mesh lacks; valid: {', '.join(shape)}"
                )
    if spec.needs_model or rules_table or preset:
        try:
            return rules_from_table(rules_table, preset if spec.needs_model or preset else None)
        except UserError as exc:
            raise UserError(f"{r.where('rules')(None)}: {exc}") from None
    return None


def load_experiment(path: str | Path) -> Experiment:
    """Read and validate an experiment file into a Plan; errors name the file, the line and what is valid."""
    r = _Reader(Path(path))
    for sec in r.doc:
        if sec not in SECTIONS:
            raise r.error(sec, None, f"is not a known section; valid: {', '.join(SECTIONS)}")
    if not isinstance(r.doc.get("experiment"), dict):
        raise UserError(f'{r.path}: missing the [experiment] table (with at least program = "...")')
    exp = r.table("experiment", EXPERIMENT)
    run = r.table("run", RUN)
    options = r.table("options", OPTIONS)
    rules_table = r.table("rules", RULES)
    preset = rules_table.pop("preset", run.get("rules"))
    mesh = _mesh(r)
    _check_hardware_and_axes(r, exp, mesh)
    program = exp.get("program", exp.get("kernel"))
    if program is None:
        raise r.error("experiment", None, 'needs program = "<name>" (see `shardlab audit --list`)')
    try:
        spec = get_program(program)
    except UserError as exc:
        raise r.error("experiment", "program" if "program" in exp else "kernel", str(exc)) from None
    sizes = _sizes(r, spec.dims, spec.name) if spec.family != "user" else _user_sizes(r)
    entry = _entry(r, exp, spec.family)
    try:
        model = _model(r, exp)
    except UserError as exc:
        raise UserError(f"{r.where('experiment')('model')}: {exc}") from None
    shape = complete_mesh(spec, {a.name: a.size for a in mesh})
    mesh = mesh + tuple(MeshAxis(a, 1) for a in shape if a not in {m.name for m in mesh})
    rules = _rules(r, rules_table, preset, spec, shape)
    saved = options.get("checkpoints_per_layer")
    if saved is not None and saved > MAX_CHECKPOINTS_PER_LAYER:
        raise r.error(
            "options",
            "checkpoints_per_layer",
            f"= {saved:g}: a layer saves a few to a few hundred [tokens, d_model] tensors; give at most "
            f"{MAX_CHECKPOINTS_PER_LAYER}, e.g. 2",
        )
    opt = {k: v for k, v in options.items() if k not in ("remat", "optimizer", "param_dtype")}
    plan = Plan(
        program=spec.name,
        mesh=mesh,
        sizes=sizes,
        name=exp.get("name", r.path.stem),
        hardware=exp.get("hardware", "calibrated"),
        dtype=canonical_dtype(exp.get("dtype", "float32")),
        param_dtype=canonical_dtype(options.get("param_dtype", "float32")),
        model=model,
        rules=rules,
        rules_preset=preset,
        remat=options.get("remat", run.get("remat", "none")),
        optimizer={"adamw": "adam"}.get(options.get("optimizer", "adam"), options.get("optimizer", "adam")),
        axes=exp.get("axes"),
        options=_options(r, opt),
        entry=entry,
    )
    try:  # what the estimators need; what the kernels need on top is checked before anything is built
        plan.validate(executable=False)
        if spec.needs_model and not _estimator_only(plan):
            plan.validate()
    except UserError as exc:
        raise UserError(f"{_locate(r, str(exc))}: {exc}") from None
    for key in ("warmup", "repeats"):
        if run.get(key, 0) > MAX_CALLS:
            raise r.error("run", key, f"= {run[key]} is more calls than a profile can hold; at most {MAX_CALLS}")
    return Experiment(
        plan=plan,
        path=str(r.path),
        warmup=run.get("warmup", WARMUP),
        repeats=run.get("repeats", REPEATS),
        sweep=_sweep(r, sizes),
        question=exp.get("question", ""),
        serve=serve_table(r, plan),
    )


def _estimator_only(plan: Plan) -> bool:
    """A Plan only the estimators can take (pipeline, expert or context axes, fp8, another stack's options): checked
    for what it needs to be priced; ``shardlab run`` refuses it with the reason."""
    rules = plan.rules
    axes = any(rules.axes(d) for d in ("layers", "experts", "context"))
    return plan.dtype not in ("fp32", "bf16") or axes or bool(plan.options.priced_only()) or plan.remat not in REMAT


def _locate(r: _Reader, msg: str) -> str:
    """``file:line`` of the value a Plan error is about: the first rules key, size, model field or mesh axis
    the message names (as ``name=``, ``'name'`` or ``name =``)."""
    for section in ("rules", "sizes", "model", "mesh", "options"):
        table = r.doc.get(section)
        if not isinstance(table, dict):
            continue
        for key in table:
            if re.search(rf"(?<![\w-])(?:'{re.escape(key)}'|{re.escape(key)}\s?=)", msg):
                return r.where(section)(key)
    return str(r.path)


def _options(r: _Reader, opt: dict[str, Any]) -> Options:
    try:
        return Options(**opt)
    except UserError as exc:
        raise UserError(f"{r.where('options')(None)}: [options] {exc}") from None


def check_calls(calls: dict[str, Any], compile_only: bool = False) -> dict[str, int]:
    """``--warmup`` / ``--repeats`` given to a run (``None``: not given): whole numbers of calls within
    CALLS_AT_LEAST and MAX_CALLS, and only where something is profiled. The given ones, checked."""
    given = {k: v for k, v in calls.items() if v is not None}
    if compile_only and given:
        raise UserError(f"--{next(iter(given))} with --compile-only: nothing is profiled; drop one of them")
    for k, v in given.items():
        least = CALLS_AT_LEAST[k]
        if isinstance(v, bool) or not isinstance(v, int) or v < least:
            raise UserError(f"--{k} {v!r} is not a whole number of calls >= {least}; e.g. --{k} {max(least, 2)}")
        if v > MAX_CALLS:
            raise UserError(f"--{k} {v} is more calls than a profile can hold; give at most {MAX_CALLS}")
    return given


__all__ = ["MAX_POINTS", "Experiment", "check_calls", "line_of", "load_experiment"]
