"""Every matmul of a parsed HLO module (:mod:`lab.compile.hlo`) with its FLOPs.

A ``dot`` in any computation (fusions included), the TPU compiler's ``convolution`` form of a matmul and cuBLAS
GEMM custom calls, with FLOPs ``2 x prod(output) x prod(contracting dims)`` (a convolution: over the window taps
that land on input), multiplied by the trip counts of the loops around them. A kernel's custom call (a Pallas
``tpu_custom_call``, or any custom call whose backend config carries a ``cost_estimate``) counts the FLOPs of its
cost estimate, which XLA cannot see inside it (the lab's kernels count them in :mod:`lab.core.pallas_cost`).
Interpreted on the CPU a Pallas kernel is plain HLO: its dots are counted as any others, and a dot under a
``pl.when`` (an HLO ``conditional`` in the grid's loop) on the grid steps that take it where the predicate is
integer arithmetic on the grid indices (:mod:`lab.compile.hlo_branches` runs it: a skipped causal block is not
counted), else on every grid step (the paged decode kernel's lengths are data: every page of the table).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from lab.compile.hlo import Module, operand_shapes
from lab.compile.hlo_branches import weighted_walk
from lab.core import pallas_cost


@dataclass(frozen=True)
class CompiledDot:
    name: str
    flops: float
    shape: str
    times: float = 1.0


def _window(text: str | None, n: int) -> dict[str, list]:
    """A convolution's ``window={size=4x2 stride=3x1 pad=0_0x1_1 lhs_dilate=4x1}`` per spatial dim."""
    fields = dict(re.findall(r"(\w+)=([\w\-x]+)", (text or "").strip("{}")))
    one = ["1"] * n

    def ints(key: str, default: list[str]) -> list[int]:
        return [int(v) for v in fields[key].split("x")] if key in fields else [int(v) for v in default]

    pads = [tuple(int(x) for x in p.split("_")) for p in fields["pad"].split("x")] if "pad" in fields else [(0, 0)] * n
    return {
        "size": ints("size", one),
        "stride": ints("stride", one),
        "lhs_dilate": ints("lhs_dilate", one),
        "rhs_dilate": ints("rhs_dilate", one),
        "pad": pads,
    }


def _taps(n_in: int, n_out: int, size: int, stride: int, lo: int, lhs_dilate: int, rhs_dilate: int) -> int:
    """(output, window) pairs of one spatial dim that land on an input element, not on padding or a hole of
    the input's dilation: the TPU compiler writes a matmul's batch dims as such dilated windows."""
    taps = 0
    for o in range(n_out):
        for k in range(size):
            p = o * stride + k * rhs_dilate - lo
            taps += p >= 0 and p % lhs_dilate == 0 and p // lhs_dilate < n_in
    return taps


def convolution_flops(module: Module, instr) -> float | None:
    """FLOPs of a ``convolution`` (the TPU compiler's form of a matmul, ``dim_labels=bf_io->bf``): two per
    multiply-add, each output element summing the kernel's input features over the window taps that hit input."""
    ops = operand_shapes(module, instr)
    m = re.fullmatch(r"(\w+)_(\w+)->(\w+)", instr.attr("dim_labels") or "")
    if len(ops) < 2 or not instr.result or not m:
        return None
    lhs_l, rhs_l, out_l = m.groups()
    lhs, rhs, out = ops[0].dims, ops[1].dims, instr.result[0].dims
    if (len(lhs_l), len(rhs_l), len(out_l)) != (len(lhs), len(rhs), len(out)):
        return None
    spatial = sorted({c for c in rhs_l if c.isdigit()})
    win = _window(instr.attr("window"), len(spatial))
    taps, out_spatial = 1, 1
    for j, c in enumerate(spatial):
        n_out = out[out_l.index(c)]
        out_spatial *= n_out
        taps *= _taps(
            lhs[lhs_l.index(c)],
            n_out,
            win["size"][j],
            win["stride"][j],
            win["pad"][j][0],
            win["lhs_dilate"][j],
            win["rhs_dilate"][j],
        )
    per_position = instr.result[0].elements / max(out_spatial, 1)
    return 2.0 * per_position * rhs[rhs_l.index("i")] * taps


_COST_FLOPS = re.compile(r'"cost_estimate":\{[^}]*?"flops":"?(\d+)')


def kernel_flops(instr) -> float | None:
    """The FLOPs a kernel's custom call declares in its backend config's ``cost_estimate`` (a Pallas TPU kernel's
    ``pl.CostEstimate``), or None."""
    if instr.opcode != "custom-call":
        return None
    m = _COST_FLOPS.search(instr.attr("backend_config") or instr.attrs)
    return float(m.group(1)) if m else None


# JAX's splash attention (jax.experimental.pallas.ops.tpu.splash_attention) declares no cost estimate; its three
# kernels are named after it and carry their block sizes in the kernel metadata (``xprof_metadata``). They compute
# what the lab's flash kernels do per block pair (lab.core.pallas_cost: the forward's two matmuls, the dq kernel's
# three, the dk/dv kernel's four, use_fused_bwd_kernel false), so they are counted by the same functions.
_SPLASH = {
    "fwd": (pallas_cost.flash_cost, "block_q", "block_kv"),
    "dq": (pallas_cost.flash_dq_cost, "block_q_dq", "block_kv_dq"),
    "dkv": (pallas_cost.flash_dkv_cost, "block_q_dkv", "block_kv_dkv"),
}
_SPLASH_NAME = re.compile(r"splash_m[hq]a_(fwd|dq|dkv)")


def splash_flops(module: Module, instr) -> float | None:
    """The FLOPs of a splash attention kernel call, counted from its q and k operands ``[b, heads, len, h]`` (``b``
    the batch its ``vmap`` adds, absent for one sequence) and its block sizes, under a causal mask: the only mask
    the lab's Transformer gives it (``kernels.transformer.attention``), which the HLO holds only as data."""
    kind = _SPLASH_NAME.match(instr.name)
    if instr.opcode != "custom-call" or kind is None:
        return None
    cost, bq_key, bk_key = _SPLASH[kind.group(1)]
    blocks = dict(re.findall(r'\\?"(block_\w+)\\?": (\d+)', instr.attrs))
    ops = operand_shapes(module, instr)
    if bq_key not in blocks or bk_key not in blocks or len(ops) < 4:
        return None
    q, k = ((1, *o.dims) if len(o.dims) == 3 else tuple(o.dims) for o in ops[2:4])
    b, n, t, h = q
    kv, s = k[1], k[2]
    count = cost(b, t, s, n, kv, h, int(blocks[bq_key]), int(blocks[bk_key]), True, 2)
    return float(count["flops"])


def custom_call_flops(module: Module, instr) -> float | None:
    """A kernel custom call's FLOPs: its cost estimate's, else splash's counted from its blocks; None for any other
    instruction."""
    flops = kernel_flops(instr)
    return flops if flops is not None else splash_flops(module, instr)


def dots(module: Module) -> list[CompiledDot]:
    """Every matmul (``dot``, TPU ``convolution``, cuBLAS GEMM custom call) and every kernel custom call with a
    cost estimate, with its FLOPs."""
    out = []
    for instr, times in weighted_walk(module):
        flops = custom_call_flops(module, instr)
        if flops is not None:
            shape = str(instr.result[0].dims) if instr.result else ""
            out.append(CompiledDot(instr.name, flops, shape, times))
            continue
        if instr.opcode == "dot":
            ops = operand_shapes(module, instr)
            out_shape = instr.result[0] if instr.result else None
            lhs_c = instr.attr("lhs_contracting_dims") or "{}"
            cdims = [int(x) for x in lhs_c.strip("{}").split(",") if x.strip()]
            if ops and out_shape:
                k = math.prod(ops[0].dims[i] for i in cdims) if cdims else 1
                out.append(CompiledDot(instr.name, 2.0 * out_shape.elements * k, str(out_shape.dims), times))
        elif instr.opcode == "convolution":  # the TPU compiler's form of a matmul (dim_labels=bf_io->bf)
            flops = convolution_flops(module, instr)
            if flops:
                out.append(CompiledDot(instr.name, flops, str(instr.result[0].dims), times))
        elif (instr.opcode == "custom-call" and "gemm" in (instr.attr("custom_call_target") or "").lower()) or (
            instr.opcode == "custom-call" and "matmul" in (instr.attr("custom_call_target") or "").lower()
        ):
            ops = operand_shapes(module, instr)
            cfg = instr.attr("backend_config") or ""
            m = re.search(r'"lhs_contracting_dimensions":\[([^\]]*)\]', cfg)
            if not ops or not m:
                continue
            cdims = [int(x.strip('" ')) for x in m.group(1).split(",") if x.strip()]
            k = math.prod(ops[0].dims[i] for i in cdims)
            res = instr.result[0]
            out.append(CompiledDot(instr.name, 2.0 * res.elements * k, str(res.dims), times))
    return out
