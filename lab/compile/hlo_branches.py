"""How often each branch of a loop's ``conditional`` runs, where the compiled program itself says: no JAX.

A Pallas kernel interpreted on the CPU is one HLO ``while`` over its flattened grid, the grid indices carried as
integer scalars beside the loop counter, and each ``pl.when`` an HLO ``conditional`` in the loop body whose
predicate is integer arithmetic on those indices (a causal block pair above the diagonal: ``j * bk > i * bq + bq -
1``). Counting a dot under such a conditional on every trip counts the skipped blocks too. :func:`branch_shares`
runs the loop's integer scalars, trip by trip, through the body as the HLO writes them (constants, the carried
scalars, the fusions and arithmetic computing them) and counts which branch each conditional takes.

Where any input of that arithmetic is not known from the program text (the loop starts from a value computed
elsewhere, a predicate reads an array: the paged decode kernel's lengths, a device's ``partition-id``) nothing is
counted for that loop and every branch keeps a share of 1, the upper bound the static count always took.
"""

from __future__ import annotations

import operator
import re

from lab.compile.hlo import Instruction, Module

MAX_TRIPS = 100_000  # a loop run longer than this keeps the static count (every branch on every trip)
_SCALARS = ("s8", "s16", "s32", "s64", "u8", "u16", "u32", "u64", "pred")
_NAME = re.compile(r"%([\w.\-]+)")
_BINARY = {
    "add": operator.add,
    "subtract": operator.sub,
    "multiply": operator.mul,
    "maximum": max,
    "minimum": min,
    "and": lambda a, b: a & b,
    "or": lambda a, b: a | b,
    "xor": lambda a, b: a ^ b,
    "divide": lambda a, b: int(a / b) if b else None,  # HLO integer division truncates towards zero
    "remainder": lambda a, b: a - b * int(a / b) if b else None,
}
_COMPARE = {
    "EQ": operator.eq,
    "NE": operator.ne,
    "LT": operator.lt,
    "LE": operator.le,
    "GT": operator.gt,
    "GE": operator.ge,
}


class _Unknown(Exception):
    """A value the program text does not determine."""


def _operands(instr: Instruction) -> list[str]:
    return _NAME.findall(instr.operands_text)


def _scalar(instr: Instruction) -> bool:
    return len(instr.result) == 1 and instr.result[0].dims == () and instr.result[0].dtype in _SCALARS


def _constant(instr: Instruction):
    text = instr.operands_text.strip()
    if text in ("true", "false"):
        return text == "true"
    if re.fullmatch(r"-?\d+", text):
        return int(text)
    return None


def _apply(instr: Instruction, args: list):
    """One scalar instruction on its operands' values (None: unknown)."""
    op = instr.opcode
    if any(a is None for a in args) and op not in ("tuple", "get-tuple-element"):
        return None
    if op in _BINARY and len(args) == 2:
        return _BINARY[op](*args)
    if op == "compare":
        direction = instr.attr("direction") or ""
        return _COMPARE[direction](*args) if direction in _COMPARE else None
    if op == "select":
        return args[1] if args[0] else args[2]
    if op == "clamp":
        return min(max(args[1], args[0]), args[2])
    if op == "not":
        return not args[0] if isinstance(args[0], bool) else ~args[0]
    if op == "negate":
        return -args[0]
    if op in ("copy", "bitcast", "reshape"):
        return args[0]
    if op == "convert":
        return int(args[0]) if instr.result[0].dtype != "pred" else bool(args[0])
    return None


def evaluate(module: Module, computation: str, params: list) -> object:
    """The value of ``computation``'s root from its parameters' values: integer scalars and tuples of them are
    computed, anything else is None. A tuple is a Python tuple."""
    env: dict[str, object] = {}
    value: object = None
    for instr in module.computations.get(computation, []):
        value = _value(module, instr, env, params)
        env[instr.name] = value
    return value


def _value(module: Module, instr: Instruction, env: dict, params: list):
    op = instr.opcode
    if op == "parameter":
        i = int(instr.operands_text.strip() or 0)
        return params[i] if i < len(params) else None
    args = [env.get(n) for n in _operands(instr)]
    if op == "tuple":
        return tuple(args)
    if op == "get-tuple-element":
        index = int(instr.attr("index") or 0)
        return args[0][index] if isinstance(args[0], tuple) and index < len(args[0]) else None
    if not _scalar(instr):
        return None
    if op == "constant":
        return _constant(instr)
    if op in ("fusion", "call"):
        callee = (instr.attr("calls") or instr.attr("to_apply") or "").lstrip("%")
        return evaluate(module, callee, args)
    return _apply(instr, args)


def _branch(instr: Instruction, env: dict) -> int | None:
    """The branch a conditional takes, by its branch index (an s32, out of range: the last) or its predicate
    (``true_computation`` first, as :meth:`Module.calls` lists them)."""
    ops = _operands(instr)
    key = env.get(ops[0]) if ops else None
    if key is None:
        return None
    if isinstance(key, bool):
        return 0 if key else 1
    n = len((instr.attr("branch_computations") or "").strip("{}").split(","))
    return key if 0 <= key < n else n - 1


def _conditionals(module: Module, body: str) -> list[Instruction]:
    return [i for i in module.computations.get(body, []) if i.opcode == "conditional"]


def _init(module: Module, loop: Instruction) -> object:
    """The loop's initial state, as far as the computation it sits in determines it (its parameters unknown)."""
    env: dict[str, object] = {}
    for instr in module.computations.get(loop.computation, []):
        if instr.name == loop.name:
            ops = _operands(loop)
            return env.get(ops[0]) if ops else None
        env[instr.name] = _value(module, instr, env, [])
    return None


def _run(module: Module, loop: Instruction) -> dict[str, list[int]] | None:
    """Run one ``while`` loop's scalars: for each conditional of its body, how many trips took each branch (None
    where a predicate or the loop's end is not determined)."""
    body, cond = (loop.attr("body") or "").lstrip("%"), (loop.attr("condition") or "").lstrip("%")
    conds = _conditionals(module, body)
    state = _init(module, loop)
    counts = {c.name: [0] * _n_branches(c) for c in conds}
    for _ in range(MAX_TRIPS + 1):
        go = evaluate(module, cond, [state])
        if go is None:
            return None
        if not go:
            return counts
        env: dict[str, object] = {}
        for instr in module.computations.get(body, []):
            env[instr.name] = _value(module, instr, env, [state])
            if instr.opcode == "conditional":
                taken = _branch(instr, env)
                if taken is None:
                    return None
                counts[instr.name][taken] += 1
        state = _next_state(module, body, env, state)
        if state is None:
            return None
    return None


def _next_state(module: Module, body: str, env: dict, state: object) -> tuple | None:
    """The body's root (the last instruction XLA prints) as the next trip's state, where it is a tuple like the
    state; None otherwise (the loop then keeps the static count)."""
    root = module.computations[body][-1]
    value = env.get(root.name)
    if root.opcode != "tuple" or not isinstance(value, tuple) or not isinstance(state, tuple):
        return None
    return value if len(value) == len(state) else None


def _n_branches(instr: Instruction) -> int:
    v = instr.attr("branch_computations")
    return len(v.strip("{}").split(",")) if v else 2


def branch_shares(module: Module) -> dict[str, list[float]]:
    """For each conditional in a ``while`` body whose branches the program text determines, the share of the
    loop's trips each branch takes (summing to 1), by the conditional's name."""
    out: dict[str, list[float]] = {}
    for comp in module.computations.values():
        for loop in comp:
            if loop.opcode != "while" or not _conditionals(module, (loop.attr("body") or "").lstrip("%")):
                continue
            counts = _run(module, loop)
            for name, per_branch in (counts or {}).items():
                trips = sum(per_branch)
                if trips:
                    out[name] = [c / trips for c in per_branch]
    return out


def weighted_walk(module: Module) -> list[tuple[Instruction, float]]:
    """:meth:`Module.walk` with each conditional branch run as often as :func:`branch_shares` counts (a branch it
    cannot count: on every execution of its conditional, as the walk takes it)."""
    shares = branch_shares(module)
    out: list[tuple[Instruction, float]] = []
    stack = [(module.entry, 1.0)]
    while stack and len(out) < 10_000_000:
        comp, times = stack.pop()
        for instr in module.computations.get(comp, []):
            out.append((instr, times))
            share = shares.get(instr.name) if instr.opcode == "conditional" else None
            names = _branch_names(instr) if share is not None else []
            for callee, n in module.calls(instr):
                factor = share[names.index(callee)] if share is not None and callee in names else 1.0
                stack.append((callee, times * n * factor))
    return out


def _branch_names(instr: Instruction) -> list[str]:
    v = instr.attr("branch_computations")
    if v:
        return [c.strip().lstrip("%") for c in v.strip("{}").split(",")]
    return [(instr.attr(k) or "").lstrip("%") for k in ("true_computation", "false_computation")]


__all__ = ["MAX_TRIPS", "branch_shares", "evaluate", "weighted_walk"]
