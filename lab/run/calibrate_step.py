"""The last step of ``shardlab calibrate`` on a host: the lab's own Transformer train step, run and profiled on the
emulated devices, priced against the freshly calibrated spec; per kind of op (:data:`lab.predict.efficiency.
HOST_OP_KINDS`), the measured time over the estimated one becomes the spec's ``op_factor``, which the estimators read
for that host (``efficiency.host_factor``).

Why a step and not more microbenchmarks: the microbenchmarks time one op on one device, or one collective alone; in
a sharded step every emulated device computes at once on the same few cores, collectives wait on the slowest device,
and XLA:CPU runs the Transformer's batched small matmuls (attention scores over a 32-wide head) and reductions
(RMSNorm) several times slower per FLOP and byte than square matmuls and copies. The reference program is a pure
data-parallel step of a small LLaMA-style model (its dims are not the ones the documented ``plan --validate`` example
checks), so the layouts that example ranks are a check of the factors, not their source.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

from lab.core.collective_kinds import KINDS
from lab.predict.efficiency import HOST_OP_KINDS

# The reference: every device busy with the same shapes (data parallel over the whole mesh), attention as the lab runs
# it (plain softmax, scores stored), bf16 compute over fp32 weights as plan --validate builds its layouts.
REFERENCE = """\
[experiment]
name = "calibrate_step"
program = "train_step"
hardware = "calibrated"
dtype = "bfloat16"

[mesh]
data = {devices}
model = 1

[sizes]
batch = {batch}
seq = 192

[model]
vocab = 1536
d_model = 192
layers = 2
heads = 6
kv_heads = 3
head_dim = 32
d_ff = 768
max_seq_len = 256

[rules]
preset = "dp"

[options]
remat = "none"

[run]
warmup = {warmup}
repeats = {repeats}
"""
CALLS = {False: (2, 3), True: (1, 2)}  # (warmup, repeats): full, quick
KIND_OF = {"matmul": "matmul", "attention": "attention", "elementwise": "elementwise"}


def factors(report: dict[str, Any]) -> dict[str, Any]:
    """``{"op_factor": {kind: measured / estimated}, "op_factor_detail": ...}`` from a run report's named ops (the
    estimator's ops joined to the trace: ``estimated_ops``); a kind with nothing measured keeps 1."""
    sums = {k: [0.0, 0.0] for k in HOST_OP_KINDS}
    for op in report.get("estimated_ops") or []:
        est, meas = op.get("estimated_s"), op.get("measured_s")
        if not est or not meas:
            continue
        kind = KIND_OF.get(op.get("kind"), "collective" if op.get("role") or op.get("kind") in KINDS else None)
        if kind is None:
            continue
        sums[kind][0] += meas
        sums[kind][1] += est
    out = {k: (m / e if e > 0 and m > 0 else 1.0) for k, (m, e) in sums.items()}
    detail = {k: {"measured_s": m, "estimated_s": e} for k, (m, e) in sums.items()}
    return {"op_factor": out, "op_factor_detail": detail}


def measure_step(spec_path: Path, devices: int, quick: bool, progress=None) -> dict[str, Any]:
    """Run the reference step against the spec at ``spec_path`` (its op factors unset) and return its factors, with
    the step's measured and estimated times."""
    from lab.run.pipeline import run_experiment

    warmup, repeats = CALLS[quick]
    with tempfile.TemporaryDirectory(prefix="shardlab-calibrate-") as tmp:
        exp = Path(tmp) / "calibrate_step.toml"
        exp.write_text(REFERENCE.format(devices=devices, batch=4 * devices, warmup=warmup, repeats=repeats))
        result = run_experiment(
            str(exp), out=str(Path(tmp) / "runs"), quiet=progress is None, hardware_file=str(spec_path)
        )
        report = result.report
    got = factors(report)
    got["op_factor_step"] = {
        "program": "calibrate_step: LLaMA-style, 2 layers, d_model 192, 6 heads x 32, d_ff 768, seq 192, data "
        f"parallel over {devices} devices, bf16, {warmup} + {repeats} calls",
        "measured_s": report.get("step_time_measured_s"),
        "estimated_s": report.get("step_time_estimated_s"),
    }
    return got


def apply(spec_path: Path, found: dict[str, Any]) -> dict[str, Any]:
    """Write the factors into the spec's calibration (atomically) and return the new spec's fields."""
    from lab.core.files import write_atomic

    spec = json.loads(spec_path.read_text())
    spec.setdefault("calibration", {}).update(found)
    write_atomic(spec_path, json.dumps(spec, indent=2, allow_nan=False) + "\n")
    return spec


__all__ = ["REFERENCE", "apply", "factors", "measure_step"]
