"""A Plan changed from the command line (``--mesh``, ``--sizes``, ``--dtype``, ``--model``), and a real-size
Plan scaled down to fit this host (``--scale-to-host``), said aloud and recorded, never silently.

``shardlab run`` and ``shardlab audit`` share :func:`override`; the run records what it changed (``overrides``
in ``report.json``). :func:`scale_to_host` divides the model's widths, the vocabulary and the sequence by the
smallest power of two that makes the estimator's memory per device fit the host's share, keeping every size
divisible as the mesh needs; the report carries each field's size before and after.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from lab.core.errors import UserError
from lab.core.models import model_from_fields
from lab.core.notation import parse_mesh, parse_sizes
from lab.core.plan import Plan, make_mesh_axes
from lab.core.programs import complete_mesh
from lab.core.units import canonical_dtype

# What --scale-to-host divides: the model's widths and lengths, and the sizes that are widths or lengths.
MODEL_WIDTHS = ("d_model", "d_ff", "vocab", "head_dim", "max_seq_len")
SIZE_LENGTHS = ("seq", "prompt_len", "I", "J", "K", "B", "D", "F", "N")
MAX_FACTOR = 256


def parse_model(text: str) -> dict[str, Any]:
    """``"layers=2,d_model=1024"`` (or ``base=llama3-8b,layers=2``) -> model fields."""
    if not text.strip():
        raise UserError("--model is empty; give fields such as layers=2,d_model=1024 (base=NAME starts from one)")
    out: dict[str, Any] = {}
    for part in text.split(","):
        key, sep, value = part.partition("=")
        key = key.strip().replace("-", "_")
        if not sep or not key or not value.strip():
            raise UserError(f"--model {text!r}: {part!r} is not FIELD=VALUE; e.g. layers=2,d_model=1024")
        v = value.strip()
        if key in ("base", "name"):
            out[key] = v
        elif v.lower() in ("true", "false"):
            out[key] = v.lower() == "true"
        else:
            from lab.core.models import ZERO_MEANS_NONE

            zero_ok = key in ZERO_MEANS_NONE  # 0: none (no window, no experts' details)
            if not v.isdigit() or int(v) < (0 if zero_ok else 1):
                kind = "whole number >= 0" if zero_ok else "positive whole number"
                raise UserError(f"--model {text!r}: {key}={v!r} is not a {kind} (or true/false)")
            out[key] = int(v)
    return out


def override_flags(record: dict[str, Any]) -> str:
    """The command-line flags that make ``record`` (what :func:`override` and ``--warmup``/``--repeats`` recorded):
    ``--mesh data=4,model=2 --warmup 1``."""
    out = []
    for k, v in record.items():
        value = ",".join(f"{a}={b}" for a, b in v.items()) if isinstance(v, dict) else str(v)
        out.append(f"--{k} {value}")
    return " ".join(out)


def override(
    plan: Plan,
    *,
    mesh: str | None = None,
    sizes: str | None = None,
    dtype: str | None = None,
    model: str | None = None,
) -> tuple[Plan, dict[str, Any]]:
    """The Plan with the command line's changes, validated, and a record of them (empty when none)."""
    changes: dict[str, Any] = {}
    record: dict[str, Any] = {}
    if mesh is not None:
        shape = complete_mesh(plan.spec, parse_mesh(mesh))
        slow = tuple(a.name for a in plan.mesh if a.link == "slow")
        changes["mesh"] = make_mesh_axes(shape, slow)
        record["mesh"] = dict(shape)
    if sizes is not None:
        new = parse_sizes(sizes, ",".join(f"{k}={v}" for k, v in plan.sizes.items()) or "batch=16")
        changes["sizes"] = dict(plan.sizes) | new
        record["sizes"] = new
    if dtype is not None:
        changes["dtype"] = canonical_dtype(dtype)
        record["dtype"] = changes["dtype"]
    if model is not None:
        fields = parse_model(model)
        if plan.model is None and "base" not in fields:
            raise UserError(f"--model: {plan.program} has no model to change; give base=NAME to start from one")
        start = {} if "base" in fields else dataclasses.asdict(plan.model)
        changes["model"] = model_from_fields(start | fields, where="--model")
        record["model"] = fields
    if not changes:
        return plan, {}
    plan = dataclasses.replace(plan, **changes)
    plan.validate()
    return plan, record


def _scaled(plan: Plan, factor: int) -> tuple[Plan, dict[str, list[int]]] | None:
    """The Plan with widths and lengths divided by ``factor``; None where a size would not stay whole."""
    fields: dict[str, list[int]] = {}
    model = plan.model
    if model is not None:
        new: dict[str, int] = {}
        for f in MODEL_WIDTHS:
            v = getattr(model, f)
            if v % factor or v // factor < (8 if f == "head_dim" else 1):
                return None
            new[f] = v // factor
            fields[f"model.{f}"] = [v, v // factor]
        model = dataclasses.replace(model, **new)
    sizes = dict(plan.sizes)
    for k in SIZE_LENGTHS:
        if k in sizes:
            if sizes[k] % factor:
                return None
            fields[f"sizes.{k}"] = [sizes[k], sizes[k] // factor]
            sizes[k] //= factor
    scaled = dataclasses.replace(plan, model=model, sizes=sizes)
    try:
        scaled.validate()
    except UserError:
        return None
    return scaled, fields


def scale_to_host(plan: Plan, fits) -> tuple[Plan, dict[str, Any]]:
    """The Plan divided by the smallest power of two for which ``fits(plan)`` is true, and the record.

    Raises:
        UserError: no power of two up to :data:`MAX_FACTOR` keeps the sizes whole and fits.
    """
    factor = 2
    while factor <= MAX_FACTOR:
        candidate = _scaled(plan, factor)
        if candidate is not None and fits(candidate[0]):
            scaled, fields = candidate
            return scaled, {"factor": factor, "fields": fields}
        factor *= 2
    raise UserError(
        f"{plan.name}: no power-of-two scale up to 1/{MAX_FACTOR} keeps its widths and lengths whole and fits this "
        "host; give smaller sizes (--sizes, --model) or a larger mesh"
    )


def describe(record: dict[str, Any]) -> str:
    """One line: ``scaled to host by 1/8: model.d_model 4096 -> 512, ...``."""
    parts = [f"{k} {a} -> {b}" for k, (a, b) in record["fields"].items()]
    return f"scaled down by 1/{record['factor']} to fit this host: " + ", ".join(parts)


__all__ = ["describe", "override", "override_flags", "parse_model", "scale_to_host"]
