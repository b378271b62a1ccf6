"""Layout search: price every parallel layout of a training job and keep the fastest that fit.

The search space, for ``chips = dp * fsdp * tp * pp * cp``:

* ``tp`` divides the attention heads (and divides or is a multiple of the KV heads, as
  :func:`lab.predict.training.estimate.check_config` requires); on a switched fabric it stays inside one switch
  domain (``tp <= node_size``: tensor parallelism inside an NVLink node), on a torus it goes up to 16;
* ``pp`` divides the layers; ``cp`` is a power of two, at most 8, dividing ``seq_len``;
* ``dp x fsdp`` takes the remaining chips, every split of it; ``zero=1`` when ``dp > 1``;
* ``ep`` (mixture-of-experts models only) divides the experts and ``dp x fsdp``;
* sequence parallelism whenever ``tp > 1``;
* pipeline schedule ``1f1b``, and ``interleaved`` with two chunks per stage where the layers divide
  into ``2 pp`` chunks and the microbatch count is a multiple of ``pp``;
* every recomputation policy in ``remats`` and every microbatch size in ``microbatches`` that
  divides the sequences each data-parallel replica gets.

Each point is priced by the estimator's own step formula (:func:`lab.predict.training.step.step_parts`,
which :func:`lab.predict.training.estimate.estimate` calls too), its parts computed once per search for all the
points that share what they depend on (:mod:`lab.predict.planner.search`): the layer cost, the layout's
terms, FSDP's, the microbatches'. The results are ``estimate()``'s, exactly. Memory (cheap) is computed
first: a layout whose weights, gradients and optimizer state alone overflow HBM is dropped with all its
microbatch sizes and recomputation policies, and any other point that overflows is not priced either
(unless ``screen_memory=False``). ``screened`` counts every valid point, ``evaluated`` the points whose
step time was priced, ``feasible`` those of them that fit.
"""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from lab.core.errors import UserError
from lab.core.hardware import Chip
from lab.core.models import ModelConfig
from lab.core.table import render
from lab.core.units import fmt_bytes, fmt_count, fmt_seconds, fmt_share
from lab.predict.planner.search import Search
from lab.predict.training.estimate import (
    GRAD_BYTES,
    OPTIMIZERS,
    REMAT,
    WEIGHT_BYTES,
    Layout,
    TrainConfig,
    TrainEstimate,
    state_min_chips,
)
from lab.predict.training.remat import ALL as REMAT_ALL

MAX_TORUS_TP = 16  # tensor parallelism on a TPU torus: up to 16 chips
MAX_CP = 8  # context parallelism: powers of two up to 8
INTERLEAVE = 2  # chunks per stage of the interleaved schedule
GIB = 2.0**30
MAX_CHIPS = 2**20  # the search walks the divisors of the chip count (and near counts when none suits): bounded
NEAREST_WINDOW = 4096  # how far from the chip count _nearest_valid_chips looks before trying powers of two


@dataclass(frozen=True)
class PlanResult:
    """The fastest layouts that fit, best first, and what the search cost.

    Attributes:
        model, hardware, chips, batch_tokens, seq_len: the job searched.
        evaluated: configurations whose step time was priced (calls to :func:`estimate`).
        feasible: of those, how many fit in HBM.
        seconds: wall time of the search.
        top: the best fitting estimates by step time, best first.
        screened: valid configurations whose memory was computed (a superset of ``evaluated``: those
            that overflowed HBM were not priced unless the search ran with ``screen_memory=False``).
    """

    model: str
    hardware: str
    chips: int
    batch_tokens: int
    seq_len: int
    evaluated: int
    feasible: int
    seconds: float
    top: tuple[TrainEstimate, ...]
    screened: int = 0

    @property
    def global_batch(self) -> int:
        return self.batch_tokens // self.seq_len

    @property
    def priced_per_s(self) -> float:
        """Priced configurations per second of search wall time (screening included in the time)."""
        return self.evaluated / self.seconds if self.seconds > 0 else math.inf

    @property
    def configs_per_s(self) -> float:
        """:attr:`priced_per_s` (its former name)."""
        return self.priced_per_s

    @property
    def screened_per_s(self) -> float:
        """Configurations considered (memory computed) per second of search wall time."""
        return self.screened / self.seconds if self.seconds > 0 else math.inf

    @functools.cached_property
    def intervals(self) -> tuple[Any, ...]:
        """Each top layout's 80% interval (lab.predict.intervals; None on a chip kind nothing validates)."""
        from lab.predict.intervals import for_training

        return tuple(for_training(est) for est in self.top)

    def indistinguishable(self) -> tuple[bool | None, ...]:
        """Per top layout, whether its interval overlaps the best one's: the model cannot tell them apart."""
        ivs = self.intervals
        if not ivs or ivs[0] is None:
            return tuple(None for _ in ivs)
        best = ivs[0]
        return tuple(iv is not None and iv.lo <= best.hi and best.lo <= iv.hi for iv in ivs)

    def to_dict(self) -> dict[str, Any]:
        ivs, same = self.intervals, self.indistinguishable()
        return {
            "model": self.model,
            "hardware": self.hardware,
            "chips": self.chips,
            "batch_tokens": self.batch_tokens,
            "seq_len": self.seq_len,
            "global_batch": self.global_batch,
            "evaluated": self.evaluated,
            "feasible": self.feasible,
            "screened": self.screened,
            "seconds": self.seconds,
            "priced_per_s": self.priced_per_s,
            "configs_per_s": self.priced_per_s,
            "screened_per_s": self.screened_per_s,
            "top": [
                {
                    "rank": i,
                    **est.to_dict(),
                    "interval_s": iv.as_list() if iv is not None else None,
                    "indistinguishable_from_best": tie,
                }
                for i, (est, iv, tie) in enumerate(zip(self.top, ivs, same, strict=True), start=1)
            ],
        }

    def table(self) -> str:
        title = (
            f"{self.model} on {self.chips} {self.hardware}: {fmt_count(self.batch_tokens)} tokens per step "
            f"({self.global_batch} x {self.seq_len}); {self.screened} configurations, {self.evaluated} priced, "
            f"{self.feasible} fit; searched in {fmt_seconds(self.seconds)}"
        )
        rows = []
        ivs, same = self.intervals, self.indistinguishable()
        for i, est in enumerate(self.top, start=1):
            c, mem = est.config, est.memory
            iv = ivs[i - 1]
            rows.append(
                [
                    i,
                    c.layout.describe(),
                    c.remat,
                    c.microbatch,
                    fmt_seconds(est.step_time_s),
                    _likely(iv, same[i - 1], i == 1),
                    fmt_count(est.tokens_per_s),
                    fmt_share(est.mfu),
                    f"{mem.total / GIB:.1f} / {mem.hbm_bytes / GIB:.1f}",
                    est.bottleneck,
                ]
            )
        headers = [
            "rank",
            "layout",
            "remat",
            "microbatch",
            "step time",
            "likely (80%)",
            "tokens/s",
            "MFU",
            "GiB/chip / HBM",
            "bottleneck",
        ]
        text = render(headers, rows, title=title)
        if any(same[1:]):
            n = sum(bool(t) for t in same[1:])
            text += (
                f"\n~: {n} layout{'s' if n > 1 else ''} whose 80% interval overlaps the best one's: the model cannot "
                "tell them from it"
            )
        if self.top and self.top[0].memory.total > HEADROOM * self.top[0].memory.hbm_bytes:
            best = self.top[0].memory
            text += (
                f"\n!: rank 1 fills {100 * best.total / best.hbm_bytes:.0f}% of the chip's memory (more than "
                f"{100 * HEADROOM:.0f}%): XLA's buffers and fragmentation may not fit beside it; prefer a layout with "
                "room, or check it compiled (`shardlab audit`, `run --compile-only`)"
            )
        return text


# The share of HBM above which the best layout gets a warning: the estimator's memory model is the sum of named
# parts, and XLA's peak was 8-23% above it for llama3_8b_train_2layer cross-compiled for v5e:2x4 (remat full,
# selective, none; issue 37, measured 2026-12-03).
HEADROOM = 0.90


def _likely(iv: Any, tie: bool | None, best: bool) -> str:
    if iv is None:
        return "-"
    from lab.predict.intervals import text

    mark = "" if best or not tie else " ~"
    return text(iv, fmt_seconds).removeprefix("likely ") + mark


# ----- the search space ---------------------------------------------------------------------


def _divisors(n: int) -> list[int]:
    small, large = [], []
    d = 1
    while d * d <= n:
        if n % d == 0:
            small.append(d)
            if d * d != n:
                large.append(n // d)
        d += 1
    return small + large[::-1]


def _max_tp(chip: Chip) -> int:
    if chip.topology == "torus":
        return MAX_TORUS_TP
    return chip.node_size or 1


def _space(
    model: ModelConfig, chip: Chip, chips: int, seq_len: int, global_batch: int, microbatches: tuple[int, ...]
) -> Iterator[tuple[Layout, tuple[int, ...]]]:
    """Every layout of the search space (module docstring) with its valid microbatch sizes; prices nothing."""
    tp_max = _max_tp(chip)
    for tp in _divisors(chips):
        if tp > tp_max or model.heads % tp or (model.kv_heads % tp and tp % model.kv_heads):
            continue
        sp = tp > 1
        cp = 1
        while cp <= MAX_CP:
            if seq_len % cp or (chips // tp) % cp or (sp and seq_len % (tp * cp)):
                cp *= 2
                continue
            after_cp = chips // (tp * cp)
            for pp in _divisors(after_cp):
                if model.layers % pp:
                    continue
                replicas = after_cp // pp  # dp x fsdp
                if global_batch % replicas:
                    continue
                per_replica = global_batch // replicas
                mbs = [mb for mb in microbatches if per_replica % mb == 0]
                if not mbs:
                    continue
                eps = [e for e in _divisors(model.experts) if replicas % e == 0] if model.is_moe else [1]
                schedules = [("1f1b", 1)]
                if pp > 1 and model.layers % (pp * INTERLEAVE) == 0:
                    schedules.append(("interleaved", INTERLEAVE))
                for dp in _divisors(replicas):
                    fsdp = replicas // dp
                    zero = 1 if dp > 1 else 0
                    for ep in eps:
                        for sched, v in schedules:
                            lay = Layout(
                                dp=dp,
                                fsdp=fsdp,
                                tp=tp,
                                pp=pp,
                                cp=cp,
                                ep=ep,
                                zero=zero,
                                sequence_parallel=sp,
                                pp_schedule=sched,
                                interleave=v,
                            )
                            # Megatron's interleaving needs the microbatch count to be a multiple of pp.
                            ok = tuple(mb for mb in mbs if v == 1 or (per_replica // mb) % pp == 0)
                            if ok:
                                yield lay, ok
            cp *= 2


def search_space_size(
    model: ModelConfig,
    chip: Chip,
    chips: int,
    batch_tokens: int,
    seq_len: int,
    *,
    remats: tuple[str, ...] = REMAT,
    microbatches: tuple[int, ...] = (1, 2, 4, 8, 16),
) -> int:
    """How many configurations :func:`plan` would consider (before any memory screening)."""
    _check_inputs(chips, batch_tokens, seq_len, 1, "adam", remats, microbatches)
    gb = batch_tokens // seq_len
    per_remat = sum(len(mbs) for _, mbs in _space(model, chip, chips, seq_len, gb, _unique(microbatches)))
    return per_remat * len(_unique(remats))


# ----- the planner --------------------------------------------------------------------------


def _is_pos_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 1


def _unique(xs: tuple) -> tuple:
    return tuple(dict.fromkeys(xs))


def _check_inputs(
    chips: Any,
    batch_tokens: Any,
    seq_len: Any,
    top: Any,
    optimizer: str,
    remats: tuple[str, ...],
    microbatches: tuple[int, ...],
) -> None:
    if not _is_pos_int(chips):
        raise UserError(f"chips must be a positive integer, got {chips!r}; try 8")
    if chips > MAX_CHIPS:
        raise UserError(
            f"chips {chips} is more than the search covers ({MAX_CHIPS}, beyond any cluster built); "
            f"the search walks every divisor of the chip count, try at most {MAX_CHIPS}"
        )
    if not _is_pos_int(seq_len):
        raise UserError(f"seq_len must be a positive integer, got {seq_len!r}; try 8192")
    if not _is_pos_int(batch_tokens):
        raise UserError(f"batch_tokens must be a positive integer, got {batch_tokens!r}; try {16 * seq_len}")
    if batch_tokens % seq_len:
        lo = max(seq_len, batch_tokens // seq_len * seq_len)
        hi = (batch_tokens // seq_len + 1) * seq_len
        alt = f"{lo} or {hi}" if lo < batch_tokens else f"{hi}"
        raise UserError(f"batch_tokens {batch_tokens} is not a multiple of seq_len {seq_len}; try {alt}")
    if not _is_pos_int(top):
        raise UserError(f"top must be a positive integer, got {top!r}; try 10")
    if optimizer not in OPTIMIZERS:
        raise UserError(f"optimizer {optimizer!r} is not one of {', '.join(OPTIMIZERS)}")
    if not remats:
        raise UserError(f"remats is empty; give at least one of {', '.join(REMAT)}")
    for r in remats:
        if r not in REMAT_ALL:
            raise UserError(f"remat {r!r} is not one of {', '.join(REMAT_ALL)}")
    if not microbatches:
        raise UserError("microbatches is empty; give at least one size, e.g. (1, 2, 4)")
    for mb in microbatches:
        if not _is_pos_int(mb):
            raise UserError(f"microbatch {mb!r} must be a positive integer; try 1")


def plan(
    model: ModelConfig,
    chip: Chip,
    chips: int,
    batch_tokens: int,
    seq_len: int,
    *,
    top: int = 10,
    dtype: str = "bf16",
    optimizer: str = "adam",
    remats: tuple[str, ...] = REMAT,
    microbatches: tuple[int, ...] = (1, 2, 4, 8, 16),
    flash_attention: bool = True,
    screen_memory: bool = True,
) -> PlanResult:
    """The ``top`` fastest configurations of the search space (module docstring) that fit in HBM.

    ``screen_memory=False`` prices every configuration, the ones that overflow HBM too (same result,
    slower; ``evaluated`` then equals ``screened``).
    """
    _check_inputs(chips, batch_tokens, seq_len, top, optimizer, remats, microbatches)
    chip.flops(dtype)  # a clear UserError when the chip has no such dtype
    remats, microbatches = _unique(tuple(remats)), _unique(tuple(microbatches))
    gb = batch_tokens // seq_len

    start = time.perf_counter()
    job = TrainConfig(
        model, chip, Layout(), seq_len, gb, dtype=dtype, optimizer=optimizer, flash_attention=flash_attention
    )
    search = Search(job, remats, top, screen_memory)
    for lay, mbs in _space(model, chip, chips, seq_len, gb, microbatches):
        search.search(lay, mbs)
    if not search.heap:
        raise UserError(
            _nothing_fits(model, chip, chips, seq_len, gb, dtype, optimizer, remats, microbatches, search.screened)
        )
    best = search.best()
    seconds = time.perf_counter() - start
    return PlanResult(
        model=model.name,
        hardware=chip.name,
        chips=chips,
        batch_tokens=batch_tokens,
        seq_len=seq_len,
        evaluated=search.evaluated,
        feasible=search.feasible,
        seconds=seconds,
        top=best,
        screened=search.screened,
    )


def _nothing_fits(
    model: ModelConfig,
    chip: Chip,
    chips: int,
    seq_len: int,
    gb: int,
    dtype: str,
    optimizer: str,
    remats: tuple[str, ...],
    microbatches: tuple[int, ...],
    screened: int,
) -> str:
    where = f"{chips} {chip.name}"
    if screened == 0:  # no layout of this many chips is valid at all (divisibility)
        if min(microbatches) > gb:
            return (
                f"every microbatch size ({', '.join(map(str, microbatches))}) exceeds the global batch of {gb} "
                f"sequences; try microbatches (1,)"
            )
        near = _nearest_valid_chips(model, chip, chips, seq_len, gb, microbatches)
        alt = f"; try {near} chips" if near else "; try microbatches (1,)"
        return (
            f"no layout of {where} chips suits {model.name} with a global batch of {gb} sequences "
            f"(dp x fsdp x microbatch must divide it, tp the {model.heads} heads, pp the {model.layers} layers){alt}"
        )
    # The default config, with the least activation memory the search allows.
    remat = "full" if "full" in remats else remats[0]  # "full" stores the least
    cfg = TrainConfig(
        model=model,
        chip=chip,
        layout=Layout(),
        seq_len=seq_len,
        global_batch=gb,
        microbatch=min(microbatches),
        remat=remat,
        dtype=dtype,
        optimizer=optimizer,
    )
    need = state_min_chips(cfg)
    state = model.params * (WEIGHT_BYTES + GRAD_BYTES + OPTIMIZERS[optimizer])
    if need is None:
        return (
            f"nothing fits on {where}: the activations of one {seq_len}-token sequence alone overflow the "
            f"{fmt_bytes(chip.hbm_bytes)} of HBM and no layout of {chips} chips shards them enough; "
            f"try more chips or --seq-len {max(1, seq_len // 2)}"
        )
    if need > chips:
        return (
            f"nothing fits on {where}: the state alone needs at least {need} chips "
            f"({fmt_bytes(state)} of weights, gradients and {optimizer} state, {fmt_bytes(chip.hbm_bytes)} of HBM "
            f"per chip); try --chips {need} or more"
        )
    return (
        f"nothing fits on {where}: the state needs at least {need} chips fully sharded, but no layout of {chips} "
        f"chips reaches that with {gb} sequences per step and microbatches {', '.join(map(str, microbatches))}; "
        f"try --chips {2 * chips} or a smaller microbatch"
    )


def _nearest_valid_chips(
    model: ModelConfig, chip: Chip, chips: int, seq_len: int, gb: int, microbatches: tuple[int, ...]
) -> int | None:
    """The chip count closest to ``chips`` (smaller first on a tie) whose search space is not empty: within
    ``NEAREST_WINDOW`` of it, else the nearest power of two that has one (the walk is bounded either way)."""

    def suits(c: int) -> bool:
        return 1 <= c <= MAX_CHIPS and next(_space(model, chip, c, seq_len, gb, microbatches), None) is not None

    for delta in range(1, min(chips, NEAREST_WINDOW) + 1):
        for c in (chips - delta, chips + delta):
            if suits(c):
                return c
    powers = sorted((2**k for k in range(MAX_CHIPS.bit_length())), key=lambda c: (abs(c - chips), c))
    return next((c for c in powers if suits(c)), None)


__all__ = ["PlanResult", "plan", "search_space_size"]
