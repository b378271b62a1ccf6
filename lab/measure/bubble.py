"""The pipeline bubble, measured: how much of each stage's compute in a trace went to steps it had no work in.

The lab's pipelines are one SPMD program: in each of the ``steps`` of the schedule every stage runs its layers,
and stage ``i`` has work only in steps ``i .. i + W - 1`` (``W`` its work items: ``M`` microbatches under GPipe,
``V M`` chunk passes in the circular schedule); in the other ``p - 1`` it computes on values nothing reads. That
compute is the bubble a pipeline that idles instead would show as idle time, so its share of a stage's compute,
read from the trace, is the measured counterpart of the estimator's ``(p - 1) / (W + p - 1)``.

The kernels put each step's compute in the named scope ``pipeline/stage/step_{s}`` (forward, and its transpose in
the backward pass); every op event of the trace is assigned to its step through the compiled op's name stack, and
to its stage through the device's coordinate on the pipeline's mesh axis.
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np

STEP = re.compile(r"(?:^|[/(])pipeline/stage/step_(\d+)(?:[/)]|$)")


def step_of_ops(scopes: Iterable[tuple[str, str]]) -> dict[str, int]:
    """``{instruction: step}`` for the compiled ops (``(name, op_name stack)``) inside a pipeline step's scope."""
    out = {}
    for name, scope in scopes:
        m = STEP.search(scope or "")
        if m:
            out[name] = int(m.group(1))
    return out


def stage_of_devices(mesh, axis: str) -> dict[int, int]:
    """``{device id: stage}``: each device's coordinate on the pipeline's mesh axis."""
    k = list(mesh.axis_names).index(axis)
    return {int(d.id): int(idx[k]) for idx, d in np.ndenumerate(mesh.devices)}


def measure(events: Iterable[Any], step_of: Mapping[str, int], stage_of: Mapping[int, int]) -> dict[str, Any] | None:
    """The bubble of a trace's pipeline steps (module docstring), or None when no op event falls in one.

    ``events``: op events with ``name``, ``device`` and ``dur_us`` (``lab.measure.trace.OpEvent``). Returns the
    stages, steps and work items per stage, the measured share of compute in idle steps (over all devices, and per
    stage) and the schedule's ``(p - 1) / steps``.
    """
    busy: dict[tuple[int, int], float] = defaultdict(float)
    for e in events:
        s = step_of.get(e.name)
        if s is not None and e.device in stage_of:
            busy[(e.device, s)] += e.dur_us
    if not busy:
        return None
    p = max(stage_of.values()) + 1
    steps = max(s for _, s in busy) + 1
    work = steps - (p - 1)
    idle: dict[int, float] = defaultdict(float)
    total: dict[int, float] = defaultdict(float)
    for (d, s), t in busy.items():
        i = stage_of[d]
        total[d] += t
        if not i <= s < i + work:
            idle[d] += t
    per_stage = defaultdict(list)
    for d in total:
        per_stage[stage_of[d]].append(idle[d] / total[d])
    return {
        "stages": p,
        "steps": steps,
        "work_per_stage": work,
        "measured": sum(idle.values()) / sum(total.values()),
        "per_stage": [float(np.mean(per_stage[i])) if per_stage[i] else None for i in range(p)],
        "predicted": (p - 1) / steps,
    }


__all__ = ["STEP", "measure", "stage_of_devices", "step_of_ops"]
