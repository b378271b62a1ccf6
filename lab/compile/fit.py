"""The cheapest fix that makes a Plan's program fit the chip's memory, the compiler as the oracle
(``shardlab explain memory --fit``).

The ladder, in order of cost; each rung keeps the fixes of the rungs before it, so the first that fits is the least
change along this order:

0. **as written**: the Plan itself;
1. **remat selective**: recompute the cheap ops in the backward pass (skipped where the Plan already recomputes as
   much, and for decode, which has no backward pass);
2. **remat full**: recompute every layer's forward;
3. **smaller microbatch**: half the sequences per microbatch (``options.microbatch``, introduced at half the replica's
   batch), more pipeline bubble; only for a pipelined train step, the one the lab cuts into microbatches;
4. **more FSDP**: every data-parallel axis also shards the weights and their optimizer state (``embed`` on all the
   batch axes), more gathers;
5. **offload**: not available in the lab's Transformer (listed, never faked);
6. **next topology**: twice the chips (``v5e:2x4`` -> ``v5e:4x4``), the Plan's data axis twice as large; only for a
   TPU ``target`` (the host's emulated devices are a fixed count).

Each rung is compiled (:func:`lab.compile.audit.compile_plan`, no dump) until one fits: XLA's bytes per device
(:func:`lab.compile.memory.xla_peak`: arguments + outputs + temporaries - aliased) at most ``hbm`` (default: the
chip's). A TPU compiler that refuses a program for its HBM says what the temporaries alone need; that lower bound
stands as its bytes. The estimator's bytes and verdict stand beside every rung (it is cheap: rungs past the answer
are estimated, not compiled), and its own answer is its first rung that fits.

Then, per remat policy, the largest global batch that fits the Plan as written, over multiples of the batch axes'
size (times the microbatch under a pipeline): :func:`largest_batch` doubles (or halves) once, then compiles where
the straight line through the last two points reaches ``hbm`` and its neighbour across it (memory grows about
linearly with the batch, so two compiles settle it), bisecting where the line was wrong. The estimator's largest
is found the same way. Every compile is cached by the Plan's TOML text and the target (:class:`Compiles`): nothing
compiles twice, and the rung at the Plan's batch is its policy's first point.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from lab.compile.audit import compile_plan
from lab.compile.memory import estimated_memory, xla_peak
from lab.compile.target import DoesNotFit, Target, parse_target
from lab.core.errors import UserError
from lab.core.hardware import Chip
from lab.core.plan import REMAT, MeshAxis, Plan
from lab.core.table import render
from lab.core.units import fmt_bytes

OFFLOAD = "not available in the lab's Transformer (its remat policies save or recompute; none moves to host)"
MAX_DOUBLINGS = 20  # the batch search stops at 2**20 times the batch step


@dataclass(frozen=True)
class Rung:
    """One fix on the ladder: what it changes (cumulative, from the Plan as written), XLA's bytes per device and
    the estimator's. ``status``: fits, does not fit, not compiled (a cheaper rung fits), skipped, not available,
    failed (the Plan is invalid or the compiler refused it for another reason)."""

    name: str
    status: str
    changes: dict[str, Any] = field(default_factory=dict)
    xla_bytes: float | None = None
    estimated_bytes: float | None = None
    estimator_fits: bool | None = None
    note: str = ""
    refused: bool = False  # xla_bytes is the TPU compiler's lower bound from refusing the program

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class BatchFit:
    """The largest global batch that fits under one remat policy (None: not even one step), by XLA and by the
    estimator; ``capped``: it still fit at the search's cap."""

    policy: str
    step: int
    xla: int | None
    estimator: int | None
    xla_bytes: float | None = None
    capped: bool = False
    tried: dict[int, float] = field(default_factory=dict)  # batch -> XLA's bytes per device

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self) | {"tried": {str(k): v for k, v in self.tried.items()}}


@dataclass(frozen=True)
class FitResult:
    target: str
    mesh: dict[str, int]
    compiled_for: str | None
    hbm_bytes: float
    hbm_from: str
    rungs: tuple[Rung, ...]
    answer: int  # the cheapest rung that fits (a ladder where none does is an error)
    estimator_answer: int | None
    batches: tuple[BatchFit, ...]
    compiles: int
    reused: int
    answer_toml: str = ""

    def to_dict(self) -> dict[str, Any]:
        pick = self.rungs[self.answer]
        return {
            "target": self.target,
            "mesh": self.mesh,
            "compiled_for": self.compiled_for,
            "hbm_bytes": self.hbm_bytes,
            "hbm_from": self.hbm_from,
            "rungs": [r.to_dict() for r in self.rungs],
            "answer": pick.name,
            "answer_changes": pick.changes,
            "answer_toml": self.answer_toml,
            "estimator_answer": self.rungs[self.estimator_answer].name if self.estimator_answer is not None else None,
            "batches": [b.to_dict() for b in self.batches],
            "compiles": self.compiles,
            "reused": self.reused,
        }

    def table(self) -> str:
        mesh = ",".join(f"{k}={v}" for k, v in self.mesh.items())
        where = f"{self.compiled_for}, cross-compiled" if self.compiled_for else "this host"
        head = f"fit {self.target} on mesh {mesh} ({where}) in {fmt_bytes(self.hbm_bytes)} per device ({self.hbm_from})"
        rows = [
            [
                i,
                r.name,
                r.status,
                "-" if r.xla_bytes is None else (">=" * r.refused) + fmt_bytes(r.xla_bytes),
                "-" if r.estimated_bytes is None else fmt_bytes(r.estimated_bytes),
                {True: "fits", False: "does not fit", None: "-"}[r.estimator_fits],
                r.note or _changes(r.changes),
            ]
            for i, r in enumerate(self.rungs)
        ]
        out = head + "\n" + render(["#", "rung", "XLA", "XLA per device", "estimated", "estimator", "note"], rows)
        pick = self.rungs[self.answer]
        est = self.rungs[self.estimator_answer].name if self.estimator_answer is not None else "no rung"
        out += (
            f"\nanswer: {pick.name} ({_changes(pick.changes) or 'no change'}): {fmt_bytes(pick.xla_bytes or 0)} "
            f"of {fmt_bytes(self.hbm_bytes)} per device, compiled; the estimator's answer: {est}"
        )
        if self.batches:
            brows = [
                [
                    b.policy,
                    b.step,
                    _batch(b.xla, b.capped),
                    "-" if b.xla_bytes is None else fmt_bytes(b.xla_bytes),
                    _batch(b.estimator, False),
                    len(b.tried),
                ]
                for b in self.batches
            ]
            out += "\n\nlargest global batch that fits, per remat policy (the Plan as written otherwise)\n"
            out += render(["remat", "multiple of", "XLA", "XLA per device", "estimator", "batches tried"], brows)
        return out + f"\nprograms compiled: {self.compiles}; compilations reused: {self.reused}"


def _batch(b: int | None, capped: bool) -> str:
    return "none" if b is None else (">=" * capped) + str(b)


def _changes(changes: dict[str, Any]) -> str:
    return ", ".join(f"{k} = {','.join(map(str, v)) if isinstance(v, list) else v}" for k, v in changes.items())


# ----- compiling, cached -----------------------------------------------------------------------


class Compiles:
    """XLA's bytes per device of each Plan compiled, keyed by its TOML text and the target: nothing compiles twice.
    ``made`` counts compilations, ``reused`` the answers read back."""

    def __init__(self) -> None:
        self.seen: dict[tuple[str, str | None], tuple[float, bool]] = {}
        self.made = 0
        self.reused = 0

    def bytes(self, plan: Plan, target: Target | None) -> tuple[float, bool]:
        """``(bytes, refused)``: XLA's bytes per device, or the TPU compiler's lower bound when it refused the
        program for the chip's HBM."""
        key = _key(plan, target)
        if key in self.seen:
            self.reused += 1
            return self.seen[key]
        import jax

        self.made += 1
        try:
            _, compiled = compile_plan(plan, target)
            got = (xla_peak(compiled)[0], False)
        except DoesNotFit as exc:
            got = (exc.need_bytes, True)
        except jax.errors.JaxRuntimeError as exc:
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            raise UserError(f"XLA could not compile {plan.name or plan.program}: {first[:300]}") from None
        self.seen[key] = got
        return got


def _key(plan: Plan, target: Target | None) -> tuple[str, str | None]:
    return plan.to_toml(), target.name if target is not None else None


# ----- the ladder ------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Step:
    """A rung before it is compiled: its Plan and target, or why it does not apply."""

    name: str
    plan: Plan | None
    target: Target | None
    changes: dict[str, Any]
    why_not: str = ""
    status: str = "skipped"


def ladder(plan: Plan, target: Target | None = None) -> list[_Step]:
    """The rungs of :func:`fit_ladder`, in order of cost, each keeping the fixes before it (JAX-free)."""
    steps = [_Step("as written", plan, target, {})]
    cur, changes = plan, {}
    for policy in REMAT[1:]:
        if plan.program != "train_step":
            steps.append(_Step(f"remat {policy}", None, target, dict(changes), f"{plan.program} has no backward pass"))
        elif REMAT.index(cur.remat) >= REMAT.index(policy):
            steps.append(
                _Step(f"remat {policy}", None, target, dict(changes), f"the Plan already has remat {cur.remat}")
            )
        else:
            cur, changes = dataclasses.replace(cur, remat=policy), changes | {"remat": policy}
            steps.append(_Step(f"remat {policy}", cur, target, dict(changes)))
    for make in (_smaller_microbatch, _more_fsdp):
        step = make(cur, target, changes)
        steps.append(step)
        if step.plan is not None:
            cur, changes = step.plan, step.changes
    steps.append(_Step("offload", None, target, dict(changes), OFFLOAD, "not available"))
    steps.append(_next_topology(cur, target, changes))
    return steps


def _valid(name: str, plan: Plan, target: Target | None, changes: dict[str, Any]) -> _Step:
    try:
        plan.validate()
    except UserError as exc:
        return _Step(name, None, target, changes, f"not a valid Plan: {exc}")
    return _Step(name, plan, target, changes)


def _smaller_microbatch(plan: Plan, target: Target | None, changes: dict[str, Any]) -> _Step:
    name = "smaller microbatch"
    if plan.program != "train_step" or plan.degrees()["pp"] == 1:
        why = "the lab cuts a train step into microbatches only when its layers are pipelined (no accumulation)"
        return _Step(name, None, target, dict(changes), why)
    deg = plan.degrees()
    replica = plan.sizes["batch"] // (deg["dp"] * deg["fsdp"])
    now = plan.options.microbatch or replica
    if now % 2:
        return _Step(name, None, target, dict(changes), f"{now} sequences per microbatch do not halve")
    half = dataclasses.replace(plan, options=dataclasses.replace(plan.options, microbatch=now // 2))
    return _valid(name, half, target, changes | {"options.microbatch": now // 2})


def _more_fsdp(plan: Plan, target: Target | None, changes: dict[str, Any]) -> _Step:
    name = "more FSDP"
    assert plan.rules is not None
    dp = plan.roles().get("dp", ())
    if not dp:
        return _Step(name, None, target, dict(changes), "every data-parallel axis already shards the weights")
    embed = tuple(a for a in plan.shape if a in set(plan.rules.axes("embed")) | set(dp))
    rules = dataclasses.replace(plan.rules, embed=embed)
    more = dataclasses.replace(plan, rules=rules, rules_preset=None)
    return _valid(name, more, target, changes | {"rules.embed": list(embed)})


def _next_topology(plan: Plan, target: Target | None, changes: dict[str, Any]) -> _Step:
    name = "next topology"
    if target is None or target.backend != "tpu":
        why = "compiled on this host's emulated devices, a fixed count; give --target to grow a TPU topology"
        why = why if target is None else "a GPU target grows by hosts: give --target GPU:HOSTSxN yourself"
        return _Step(name, None, target, dict(changes), why)
    assert plan.rules is not None
    axes = [a for a in plan.rules.axes("batch") if a in plan.shape]
    if not axes:
        return _Step(name, None, target, dict(changes), "the Plan has no data axis (batch on no mesh axis) to grow")
    gen, dims = target.name.split(":")
    sizes = [int(d) for d in dims.split("x")]
    grow = max(i for i, d in enumerate(sizes) if d == min(sizes))  # 2x4 -> 4x4, 4x4 -> 4x8
    sizes[grow] *= 2
    bigger = parse_target(f"{gen}:{'x'.join(map(str, sizes))}")
    mesh = tuple(MeshAxis(a.name, a.size * 2 if a.name == axes[0] else a.size, a.link) for a in plan.mesh)
    grown = dataclasses.replace(plan, mesh=mesh)
    return _valid(name, grown, bigger, changes | {"target": bigger.name, f"mesh.{axes[0]}": plan.shape[axes[0]] * 2})


def fit_ladder(
    plan: Plan,
    chip: Chip,
    target: Target | None = None,
    hbm: float | None = None,
    *,
    cache: Compiles | None = None,
    batches: bool = True,
) -> FitResult:
    """Walk the ladder (module docstring) until a rung's compiled program fits ``hbm`` bytes per device (default
    ``chip.hbm_bytes``), then search the largest batch per remat policy (``batches``).

    Raises:
        UserError: the program is not the Transformer's train step or decode; or no rung fits (one line naming the
            smallest XLA bytes seen and ``hbm``).
    """
    if plan.program not in ("train_step", "decode"):
        raise UserError(
            f"--fit walks the Transformer's fixes (remat, microbatch, FSDP, topology); {plan.program} has none: "
            "run explain memory without --fit"
        )
    limit = float(hbm if hbm is not None else chip.hbm_bytes)
    cache = cache if cache is not None else Compiles()
    steps = ladder(plan, target)
    rungs = _walk(steps, chip, limit, cache)
    answer = next((i for i, r in enumerate(rungs) if r.status == "fits"), None)
    if answer is None:
        raise UserError(_none_fits(plan, rungs, limit))
    est_answer = next((i for i, r in enumerate(rungs) if r.estimator_fits), None)
    found = tuple(_batches(plan, chip, target, limit, cache)) if batches else ()
    rungs = [_seen(r, s, cache, limit) for r, s in zip(rungs, steps, strict=True)]
    fixed = steps[answer].plan
    assert fixed is not None
    return FitResult(
        target=plan.name or plan.program,
        mesh=dict(plan.shape),
        compiled_for=target.name if target is not None else None,
        hbm_bytes=limit,
        hbm_from="--hbm" if hbm is not None else f"{chip.name}'s HBM",
        rungs=tuple(rungs),
        answer=answer,
        estimator_answer=est_answer,
        batches=found,
        compiles=cache.made,
        reused=cache.reused,
        answer_toml=fixed.to_toml("The cheapest fix that fits (shardlab explain memory --fit)."),
    )


def _walk(steps: list[_Step], chip: Chip, limit: float, cache: Compiles) -> list[Rung]:
    """Each rung estimated; compiled until the first that fits (the rest: not compiled)."""
    rungs: list[Rung] = []
    done = False
    for step in steps:
        if step.plan is None:
            rungs.append(Rung(step.name, step.status, step.changes, note=step.why_not))
            continue
        est_bytes = _estimated(step.plan, chip, step.target)
        est_fits = None if est_bytes is None else est_bytes <= limit
        if done:
            why = "a cheaper rung fits"
            rungs.append(Rung(step.name, "not compiled", step.changes, None, est_bytes, est_fits, why))
            continue
        try:
            got, refused = cache.bytes(step.plan, step.target)
        except UserError as exc:  # the kernels refused the layout, or libtpu the topology
            rungs.append(Rung(step.name, "failed", step.changes, None, est_bytes, est_fits, str(exc)))
            continue
        done = not refused and got <= limit
        note = "the TPU compiler refused it for HBM" if refused else ""
        status = "fits" if done else "does not fit"
        rungs.append(Rung(step.name, status, step.changes, got, est_bytes, est_fits, note, refused))
    return rungs


def _estimated(plan: Plan, chip: Chip, target: Target | None) -> float | None:
    """The estimator's bytes per device, or None where it does not describe the Plan."""
    try:
        est = estimated_memory(plan, chip, target)
    except UserError:
        return None
    return est.memory["total"] if est else None


def _seen(rung: Rung, step: _Step, cache: Compiles, limit: float) -> Rung:
    """A rung past the answer that the batch search happened to compile: its bytes, read back (marked so)."""
    got = cache.seen.get(_key(step.plan, step.target)) if rung.status == "not compiled" and step.plan else None
    if got is None:
        return rung
    fits = not got[1] and got[0] <= limit
    status = "fits" if fits else "does not fit"
    note = "a cheaper rung fits; compiled by the batch search"
    return dataclasses.replace(rung, status=status, xla_bytes=got[0], refused=got[1], note=note)


def _none_fits(plan: Plan, rungs: list[Rung], limit: float) -> str:
    tried = [r for r in rungs if r.xla_bytes is not None]
    if not tried:  # "as written" always applies: it failed to compile
        return f"no rung of the ladder compiled for {plan.name or plan.program} ({rungs[0].note})"
    least, name = min(tried, key=lambda r: r.xla_bytes or 0.0), plan.name or plan.program
    return (
        f"no fix on the ladder fits {name} in {fmt_bytes(limit)} per device: the smallest XLA compiled holds "
        f"{fmt_bytes(least.xla_bytes or 0.0)} ({least.name}, {len(tried)} rungs compiled); give a larger --hbm, a "
        "smaller batch or a larger mesh"
    )


# ----- the largest batch -------------------------------------------------------------------------


def _batches(plan: Plan, chip: Chip, target: Target | None, limit: float, cache: Compiles):
    """Per remat policy (the Plan's own for decode), the largest batch that fits, by XLA and by the estimator."""
    assert plan.rules is not None
    step = plan.rules.size("batch", plan.shape)
    if plan.program == "train_step" and plan.degrees()["pp"] > 1:
        step *= plan.options.microbatch or 1  # whole microbatches on every replica
    policies = REMAT if plan.program == "train_step" else (plan.remat,)
    for policy in policies:
        yield _batch_fit(dataclasses.replace(plan, remat=policy), chip, target, limit, cache, step)


def _batch_fit(plan: Plan, chip: Chip, target: Target | None, limit: float, cache: Compiles, step: int) -> BatchFit:
    start = max(step, plan.sizes["batch"] // step * step)
    tried: dict[int, float] = {}

    def at(b: int) -> Plan:
        return dataclasses.replace(plan, sizes={**plan.sizes, "batch": b})

    def compiled(b: int) -> float:
        got, refused = cache.bytes(at(b), target)
        tried[b] = got
        return float("inf") if refused else got

    def estimated(b: int) -> float:
        est = _estimated(at(b), chip, target)
        return float("inf") if est is None else est

    xla, capped = largest_batch(compiled, limit, step, start)
    est = largest_batch(estimated, limit, step, start)[0] if _estimated(plan, chip, target) is not None else None
    return BatchFit(plan.remat, step, xla, est, tried.get(xla) if xla else None, capped, dict(sorted(tried.items())))


def largest_batch(
    memory: Callable[[int], float], limit: float, step: int, start: int, cap: int = 2**MAX_DOUBLINGS
) -> tuple[int | None, bool]:
    """``(largest, capped)``: the largest multiple of ``step`` (at most ``cap`` steps) whose ``memory`` is at most
    ``limit``, None if not even ``step`` fits; ``capped`` when ``cap`` steps still fit. Memory must grow with the
    batch.

    From ``start``, twice (or half) the batch until there are two points; then where the straight line through the
    last two reaches ``limit``, and its neighbour across the line's crossing (on a straight line, the two settle it).
    Where that neighbour says the line was wrong, or the line points outside what is known, the next batch is the
    middle of the bracket (its geometric middle while the ends are over 4x apart), then the line again."""
    lo, hi = 0, None  # in steps: lo fits (0: nothing known to), hi does not
    points: list[tuple[int, float]] = []
    k, after = max(1, min(start // step, cap)), "start"
    while True:
        y = memory(k * step)
        points.append((k, y))
        if y <= limit:
            lo = max(lo, k)
        else:
            hi = k if hi is None else min(hi, k)
        if hi is not None and hi - lo <= 1:
            return (lo * step or None), False
        if hi is None and lo >= cap:
            return lo * step, True
        if after == "line":  # the line's crossing: its neighbour on the other side
            k, after = (lo + 1 if y <= limit or hi is None else hi - 1), "neighbour"
        elif after == "neighbour":  # the line was wrong (on a line the neighbour closes the bracket)
            k, after = _middle(lo, hi, cap), "middle"
        else:
            k, after = _guess(points, limit, lo, hi, cap)
            if after == "clamped":
                k, after = _middle(lo, hi, cap), "middle"


def _guess(points: list[tuple[int, float]], limit: float, lo: int, hi: int | None, cap: int) -> tuple[int, str]:
    """``(batch in steps, how)``: where the line through the last two points reaches ``limit`` (``line``;
    ``clamped`` where that is outside the bracket); without a line, twice the last or half (``double``)."""
    (k1, y1), (k2, y2) = points[-2] if len(points) > 1 else points[-1], points[-1]
    upper = hi - 1 if hi is not None else cap
    if k1 != k2 and math.isfinite(y1) and math.isfinite(y2) and (y2 - y1) / (k2 - k1) > 0:
        k = int(k2 + (limit - y2) * (k2 - k1) // (y2 - y1))
        return (k, "line") if lo < k <= upper else (min(max(k, lo + 1), upper), "clamped")
    k = k2 * 2 if y2 <= limit else k2 // 2
    return min(max(k, lo + 1), upper), "double"


def _middle(lo: int, hi: int | None, cap: int) -> int:
    """The middle of the bracket, strictly inside it: geometric while its ends are over 4x apart; past the last
    batch that fits, twice it, while nothing is known not to."""
    if hi is None:
        return min(2 * max(lo, 1), cap)
    mid = math.isqrt(max(lo, 1) * hi) if hi > 4 * max(lo, 1) else (lo + hi) // 2
    return min(max(mid, lo + 1), hi - 1)


__all__ = ["OFFLOAD", "BatchFit", "Compiles", "FitResult", "Rung", "fit_ladder", "ladder", "largest_batch"]
