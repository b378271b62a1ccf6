"""The serving stack's tensor-parallel all-reduce: what a decode step's per-layer sums cost inside one node.

A served model's decode step sums each layer's attention and MLP outputs over its tensor-parallel GPUs: two small
all-reduces a layer (``[batch, d_model]``, kilobytes to a few megabytes). The serving stacks do not hand them to NCCL
inside a node of NVLink (or AMD xGMI) GPUs: vLLM, SGLang and TensorRT-LLM each run a kernel of their own (LMDeploy's
TurboMind carries FasterTransformer's) over peer-to-peer buffers, captured in the step's CUDA graph: **one-shot** for
small messages (every GPU reads every peer's partial sum over the links and adds them), **two-shot** for larger ones (a
reduce-scatter and an all-gather through the same buffers). A call costs a fixed few microseconds plus the bytes it
moves over the links, not NCCL's ring of ``2 (G - 1)`` latency steps. Messages past the stack's buffer, groups that
leave the node, GPUs without a full peer-to-peer fabric (PCIe cards) and TPUs (XLA's ICI collectives) keep the
collective model.

:func:`comm_time` prices every collective of a serving step (the collective model where it sits, the stack's kernel
where it takes the sum, and each all-reduce's wait for its slowest rank). ``tp_allreduce``
(:class:`lab.predict.inference.estimate.InferConfig`) says which kernel: ``custom`` (these kernels; the
default on the GPUs they run on) or ``nccl`` (PyTorch eager and compiled code, DeepSpeed-Inference, Hugging Face
TGI, and JAX/XLA on GPUs, whose all-reduce is NCCL's). The figures are measured microbenchmarks of the kernels,
cited in ``docs/reference/microbenchmarks-added.md`` (AR1-AR8); the achievable prices use them, the ideal roofline
keeps the book's collective model.
"""

from __future__ import annotations

from lab.core.errors import UserError
from lab.core.hardware import Chip
from lab.predict import efficiency as eff
from lab.predict.placement import fast_domain, placement

TYPE_CHECKING = False  # typing is not imported at run time: annotations only
if TYPE_CHECKING:
    from typing import Any  # an InferConfig (lab.predict.inference.estimate, which imports this module)

TP_ALLREDUCES = ("custom", "nccl")

# Fixed cost of one call of the stacks' one-shot kernel on a small message, CUDA graph captured, by chip family:
# microbenchmarks-added.md AR1 (vLLM 0.20's all-reduce sweep on 2, 4 and 8 GPUs, 5 calls a graph replayed 20 times:
# 4.4-4.8 us at 256 B-8 KB on H100 and H200 at every group size, 5.0-5.4 us on A100 at 256 B-2 KB). MI300X (vLLM's
# kernel over xGMI) and B200 have no published sweep: H100's figure is carried (grade B).
CUSTOM_ALLREDUCE_S: dict[str, float] = {
    "a100": 5.2e-6,  # AR1: A100-SXM4-80GB, 2/4/8 GPUs, 256 B-2 KB: 5.00-5.44 us
    "h100": 4.5e-6,  # AR1: H100 80GB HBM3, 2/4/8 GPUs, 256 B-8 KB: 4.39-4.80 us (one 11.06 us outlier)
    "h200": 4.6e-6,  # AR1: H200, 2/4/8 GPUs, 256 B-8 KB: 4.47-5.02 us
    "b200": 4.5e-6,  # H100's (AR1), carried
    "mi300x": 4.5e-6,  # H100's (AR1), carried: no MI300X sweep is published (AR6: ~3 us claimed on MI325X)
}
# The kernels' choice by size (AR3, vLLM's csrc/custom_all_reduce.cuh; TensorRT-LLM's table crosses at the same
# 256 KB for 8 GPUs): one-shot below these bytes for a group of at most 4 and of at most 8 GPUs (two GPUs: always
# one-shot); above, two-shot, whose two stages each pay the fixed cost.
ONE_SHOT_MAX_BYTES = {4: 512 * 1024, 8: 256 * 1024}
# The registered buffer (vLLM's and SGLang's max_size, AR4): a message of 8 MiB or more goes to NCCL.
CUSTOM_ALLREDUCE_MAX_BYTES = 8 * 2**20
# Group sizes the kernels are built for (vLLM and SGLang's _SUPPORTED_WORLD_SIZES, AR4).
CUSTOM_ALLREDUCE_GROUPS = (2, 4, 6, 8)
# The wait at each of a GPU step's tensor-parallel all-reduces for the slowest rank to arrive, which real decode traces
# book inside the kernel and an isolated sweep leaves out: 31.6 us a call on a TP-8 MoE decode step (AR10), 62-68 us on
# another (AR9). No dense-model figure is published, so none is priced (grade C): the constant's alternative says how
# much an answer leans on it (validate --sensitivity, the intervals).
ARRIVAL_WAIT_S = 0.0


def default_tp_allreduce(chip: Chip) -> str | None:
    """What a serving stack runs on ``chip`` when the user does not say: its own kernel on the GPUs it measured on,
    else None (the collective model: NCCL on other GPUs, XLA's collectives on TPUs)."""
    return "custom" if eff.family(chip) in CUSTOM_ALLREDUCE_S else None


def custom_allreduce_time(chip: Chip, nbytes: float, group: int) -> tuple[float, bool] | None:
    """``(seconds, fixed-cost bound)`` of one all-reduce of ``nbytes`` over ``group`` GPUs of one node by the stacks'
    own kernel, or None where the kernel does not take it (another family, a group it is not built for or that
    leaves the node, a message past its buffer)."""
    fixed = CUSTOM_ALLREDUCE_S.get(eff.family(chip))
    if (
        fixed is None
        or group not in CUSTOM_ALLREDUCE_GROUPS
        or group > fast_domain(chip)
        or nbytes >= CUSTOM_ALLREDUCE_MAX_BYTES
    ):
        return None
    peers = group - 1
    one_shot = group == 2 or nbytes < ONE_SHOT_MAX_BYTES[4 if group <= 4 else 8]
    # one-shot: each GPU reads every peer's whole buffer; two-shot: a reduce-scatter and an all-gather, 2 (G-1)/G V
    moved = peers * nbytes if one_shot else 2.0 * peers / group * nbytes
    # a switch gives each GPU its whole NVLink bandwidth; a mesh (xGMI) one link to each peer, read all at once; at
    # the links' ring share (plain peer loads: no NVLink SHARP)
    links = chip.link_bandwidth * (peers if chip.topology == "mesh" else 1)
    wire = moved / (links * eff.collective_fraction(chip, "all-gather", group, "node", nbytes))
    stages = 1 if one_shot else 2
    return stages * fixed + wire, stages * fixed >= wire


def tp_allreduce(cfg: Any) -> str | None:
    """The all-reduce a config's tensor-parallel sums run (its ``tp_allreduce``, else the chip's serving default)."""
    return cfg.tp_allreduce or default_tp_allreduce(cfg.chip)


def priced_allreduce(cfg: Any) -> str:
    """What a config's tensor-parallel sums are priced as: ``custom`` where the stack's kernel takes its group (a
    decode step's small messages), else ``nccl`` (the collective model; on a TPU, XLA's)."""
    custom = tp_allreduce(cfg) == "custom" and custom_allreduce_time(cfg.chip, 1024.0, cfg.tp) is not None
    return "custom" if custom else "nccl"


def stack_allreduce(cfg: Any, kind: str, nbytes: float, group: int) -> tuple[float, bool] | None:
    """:func:`custom_allreduce_time` of a collective of ``cfg`` the stack's own kernel takes, else None."""
    if kind != "all-reduce" or tp_allreduce(cfg) != "custom":
        return None
    return custom_allreduce_time(cfg.chip, nbytes, group)


def comm_time(cfg: Any, kind: str, nbytes: float, group: int, achievable: bool) -> tuple[float, bool]:
    """``(seconds, latency-bound)`` of one collective of a serving step over ``group`` neighbouring chips, where it
    sits (lab.predict.placement: inside a node or pod on the fast links; a larger one also over the slow link, as
    training prices it); achievable, a tensor-parallel sum the stack's own kernel takes at its price
    (:func:`stack_allreduce`), and on a GPU each all-reduce's wait for its slowest rank (:data:`ARRIVAL_WAIT_S`)."""
    if group <= 1 or nbytes <= 0:
        return 0.0, False
    chip = cfg.chip
    wait = ARRIVAL_WAIT_S if achievable and kind == "all-reduce" and chip.kind == "gpu" else 0.0
    custom = stack_allreduce(cfg, kind, nbytes, group) if achievable else None
    if custom is not None:
        return custom[0] + wait, custom[1]
    where = placement(chip, group, 1)
    c = eff.collective_on(chip, kind, nbytes, group, **where)
    t = eff.achievable_time(chip, c, group, where.get("scope", "node")) if achievable else c.time_s
    return t + wait, c.latency_bound


def check_tp_allreduce(cfg: Any) -> None:
    """A stated all-reduce is one of :data:`TP_ALLREDUCES`, on a GPU (a TPU's are XLA's)."""
    if cfg.tp_allreduce is None:
        return
    if cfg.tp_allreduce not in TP_ALLREDUCES:
        raise UserError(f"--tp-allreduce {cfg.tp_allreduce!r} is not one of {', '.join(TP_ALLREDUCES)}")
    if cfg.chip.kind != "gpu":
        raise UserError(
            f"--tp-allreduce {cfg.tp_allreduce} names a GPU serving stack's all-reduce; {cfg.chip.name} is a "
            f"{cfg.chip.kind}, whose all-reduces XLA runs: drop it"
        )
    if cfg.tp_allreduce == "custom" and default_tp_allreduce(cfg.chip) is None:
        raise UserError(
            f"--tp-allreduce custom: the stacks' own kernel needs a node of NVLink or xGMI GPUs "
            f"({', '.join(CUSTOM_ALLREDUCE_S)}); {cfg.chip.name}'s tensor-parallel sums are NCCL's: drop it"
        )


__all__ = [
    "TP_ALLREDUCES",
    "check_tp_allreduce",
    "comm_time",
    "custom_allreduce_time",
    "default_tp_allreduce",
    "priced_allreduce",
    "tp_allreduce",
]
