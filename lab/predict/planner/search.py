"""The layout planner's pricing: every point of a search priced by the estimator's own parts, each computed once.

A training step's time is :func:`lab.predict.training.step.step_parts` of a layer cost, the layout's terms, FSDP's
and the microbatches' (what :func:`lab.predict.training.estimate.estimate` computes for one config). A search prices
thousands of points (layout x microbatch x recomputation policy) that share most of those parts, so
:class:`Search` keeps a dict per part, keyed on exactly what that part depends on, the model, chip and job settings
being the search's own: :func:`lab.predict.training.estimate.layer_key` (the layer's ops and cost),
:func:`lab.predict.training.memory.activation_key` (one layer's activations), and for the collectives
:func:`lab.predict.training.comm.content_key` (which, their bytes and calls) and ``layout_group`` (where their group
sits); the layouts that split their replicas between dp and fsdp differently share each microbatch size's parts
(:func:`shape_key`). Nothing outlives the search. The fastest points that fit come back as full :func:`estimate`
results of the same parts.
"""

from __future__ import annotations

import dataclasses
import heapq
from typing import Any

from lab.core.errors import UserError
from lab.predict.training.comm import content_key, layout_group
from lab.predict.training.estimate import (
    LayerCost,
    Layout,
    TrainConfig,
    TrainEstimate,
    check_config,
    estimate,
    layer_compute,
    layer_cost,
    layer_key,
)
from lab.predict.training.from_plan import job_plan, train_config
from lab.predict.training.memory import (
    activation_bytes_per_layer,
    activation_key,
    activation_terms,
    activations,
    layer_params_key,
    layer_params_local,
    state_bytes,
)
from lab.predict.training.step import (
    FsdpTerms,
    LayoutTerms,
    MicrobatchTerms,
    dp_times,
    fsdp_terms,
    layout_terms,
    microbatch_terms,
    pp_time,
    role_comms,
    step_parts,
    tp_microbatch_time,
)

_NONE = object()  # a cache miss (None is a cached "no FSDP")
_PRICE = {"dp": dp_times, "fsdp": fsdp_terms, "pp": pp_time, "tp": tp_microbatch_time}  # training.step.TERMS


def _where(lay: Layout, role: str, content: tuple) -> tuple | None:
    """Where a role's group sits, when it has collectives at all (content_key's None: none, priced nowhere)."""
    return None if content[1] is None else layout_group(lay, role)


def shape_key(lay: Layout) -> tuple:
    """A layout less its split of the replicas between dp and fsdp (and so its ZeRO stage): what a microbatch size's
    parts read of it (the microbatch count, the activations, the pipeline's and TP's microbatch terms, the layer
    cost: none reads dp, fsdp or zero but through their product). tests/test_planner.py holds the planner's points to
    direct estimates of each, which a key missing a field fails."""
    return (
        lay.tp,
        lay.pp,
        lay.cp,
        lay.ep,
        lay.sequence_parallel,
        lay.pp_schedule,
        lay.interleave,
        lay.cross_node,
        lay.pp_embedding_slots,
        lay.stage_split,
        lay.dp * lay.fsdp,
    )


class Search:
    """One search (module docstring): :meth:`search` each layout of the space, then take the :meth:`best`."""

    def __init__(self, job: TrainConfig, remats: tuple[str, ...], top: int, screen_memory: bool) -> None:
        self.job, self.remats, self.top, self.screen = job, remats, top, screen_memory
        self.common = {
            f.name: getattr(job, f.name)
            for f in dataclasses.fields(job)
            if f.name not in ("model", "chip", "layout", "microbatch", "remat")
        }
        self.screened = self.evaluated = self.feasible = 0
        self.heap: list[tuple[float, int, tuple]] = []  # max-heap on step time: (-step, -order, point)
        self.compute: dict[tuple, tuple] = {}  # layer_compute by layer_key's first key
        self.layers: dict[tuple, dict[str, LayerCost]] = {}  # by layer_key's second key, then the policy
        self.per_layer: dict[tuple, dict[str, float]] = {}  # one layer's activation bytes by activation_key, policy
        self.comms: dict[tuple, tuple] = {}  # role_comms by content key
        self.priced: dict[tuple, Any] = {}  # priced terms by content key and group
        self.last: TrainConfig | None = None  # the point whose cache misses are being priced
        # By shape_key, then microbatch size: [microbatches, activation terms, activations by policy, microbatch
        # terms, layer costs by policy, the ops' key], shared by the layouts that differ in dp and fsdp alone.
        self.shapes: dict[tuple, dict[int, list]] = {}
        self.layer_params: dict[tuple, float] = {}  # one layer's parameters on a rank, by layer_params_key

    def config(self, lay: Layout, mb: int, remat: str) -> TrainConfig:
        """The point as a TrainConfig (built once per point whose parts miss the caches)."""
        last = self.last
        if last is None or last.layout is not lay or last.microbatch != mb or last.remat != remat:
            j = self.job
            last = self.last = TrainConfig(j.model, j.chip, lay, microbatch=mb, remat=remat, **self.common)
        return last

    def activations_of(self, lay: Layout, mb: int) -> dict[str, float]:
        """One layer's activation bytes at this layout and microbatch size, by policy (as far as computed yet)."""
        key = activation_key(lay, mb)
        acts = self.per_layer.get(key)
        if acts is None:
            acts = self.per_layer[key] = {}
        return acts

    def layers_of(self, lay: Layout, mb: int) -> tuple[dict[str, LayerCost], tuple]:
        """The layer costs at this layout and microbatch size, by policy (as far as computed yet); the ops' key."""
        ops_key, key = layer_key(lay, mb)
        lcs = self.layers.get(key)
        if lcs is None:
            lcs = self.layers[key] = {}
        return lcs, ops_key

    def layer(self, lay: Layout, mb: int, remat: str, ops_key: tuple) -> LayerCost:
        """The layer cost of a point (a cache miss)."""
        cfg = self.config(lay, mb, remat)
        compute = self.compute.get(ops_key)
        if compute is None:
            compute = self.compute[ops_key] = layer_compute(cfg)
        return layer_cost(cfg, compute)

    def activations_per_layer(self, lay: Layout, mb: int, remat: str) -> float:
        """One layer's activation bytes of a point (a cache miss)."""
        j = self.job
        flash, checkpoints = j.flash_attention, j.checkpoints_per_layer
        scale = j.act_bytes / 2.0  # as training.memory.memory_per_chip counts them (the job's compute dtype)
        return activation_bytes_per_layer(j.model, lay, j.seq_len, mb, remat, flash, checkpoints) * scale

    def term(self, name: str, content: tuple, where: tuple | None, lay: Layout, mb: int, remat: str) -> Any:
        """The priced term ``name`` (training.step.TERMS) of a point whose collectives' content key (and microbatch,
        for PER_MICROBATCH roles) and groups are these."""
        key = (content, where)
        out = self.priced.get(key, _NONE)
        if out is _NONE:
            comms = self.comms.get(content)
            if comms is None:
                comms = self.comms[content] = role_comms(self.config(lay, mb, remat), name)
            extra = (self.job.dp_bucket_bytes, self.job.weights_per_grad) if name == "dp" else ()
            out = self.priced[key] = _PRICE[name](self.job.chip, lay, comms, *extra)
        return out

    def layout_terms(self, lay: Layout, mb: int, remat: str, local: float) -> LayoutTerms:
        """The layout's terms (``local``: its training.memory.local_params), its DP reduction priced once per
        content and groups."""
        j = self.job
        rg = j.remat_regathers_norms
        grads, experts, loss = (
            content_key("dp", lay, remat, rg),
            content_key("edp", lay, remat, rg),
            content_key("batch", lay, remat, rg),
        )
        where = (_where(lay, "dp", grads), _where(lay, "edp", experts), _where(lay, "batch", loss))
        dp_s, loss_s, tail, gather = self.term("dp", (grads, experts, loss), where, lay, mb, remat)
        terms = (dp_s, loss_s, local, tail, gather, j.dp_overlap, j.spmd_pipeline)
        return layout_terms(j.model, j.chip, lay, j.optimizer, *terms)

    def microbatch_keys(self, lay: Layout, remat: str) -> tuple[tuple, tuple, tuple, tuple]:
        """A layout's content keys (less the microbatch) and groups of the collectives once per microbatch: PP's
        sends and TP's; content_key reads the policy for FSDP's collectives alone, so any point's serves."""
        rg = self.job.remat_regathers_norms
        pp, tp = content_key("pp", lay, remat, rg), content_key("tp", lay, remat, rg)
        return pp, _where(lay, "pp", pp), tp, _where(lay, "tp", tp)

    def microbatch_terms(self, lay: Layout, mb: int, remat: str, n_mb: int, keys: tuple) -> MicrobatchTerms:
        pp_content, pp_where, tp_content, tp_where = keys
        pp = self.term("pp", (pp_content, mb), pp_where, lay, mb, remat)
        tp = self.term("tp", (tp_content, mb), tp_where, lay, mb, remat)
        return microbatch_terms(lay, n_mb, pp, tp)

    def fsdp(self, lay: Layout, mb: int, remat: str) -> FsdpTerms | None:
        content = content_key("fsdp", lay, remat, self.job.remat_regathers_norms)
        return self.term("fsdp", content, _where(lay, "fsdp", content), lay, mb, remat)

    def search(self, lay: Layout, mbs: tuple[int, ...]) -> None:
        """Screen and price every microbatch size and recomputation policy of one layout."""
        j, remats, screen = self.job, self.remats, self.screen
        model, chip, hbm = j.model, j.chip, j.chip.hbm_bytes
        self.screened += len(mbs) * len(remats)
        layer_key = layer_params_key(lay)
        layer = self.layer_params.get(layer_key)
        if layer is None:
            layer = self.layer_params[layer_key] = layer_params_local(model, lay)
        params, grads, opt, _, local = state_bytes(model, lay, j.weight_bytes, j.optimizer_bytes, layer=layer)
        held = params + grads + opt
        # The state depends on the layout alone: if it overflows, so does every microbatch and policy of it.
        if screen and held > hbm:
            return
        per_replica = j.global_batch // (lay.dp * lay.fsdp)
        shape = self.shapes.setdefault(shape_key(lay), {})
        heap = self.heap
        lt = keys = None
        # FSDP's terms by whether the policy recomputes at all: all that content_key reads of it for FSDP's collectives
        fsdp: dict[bool, FsdpTerms | None] = {}
        for mb in mbs:
            part = shape.get(mb)
            if part is None:  # the first layout of this shape and microbatch size
                n_mb = per_replica // mb  # TrainConfig.microbatches
                terms = activation_terms(model, lay, j.seq_len, mb, n_mb)
                part = shape[mb] = [n_mb, terms, self.activations_of(lay, mb), None, None, None]
            n_mb, terms, acts, mt, lcs, ops_key = part
            for remat in remats:
                per_layer = acts.get(remat)
                if per_layer is None:
                    per_layer = acts[remat] = self.activations_per_layer(lay, mb, remat)
                total = held + activations(per_layer, terms)
                if screen and total > hbm:
                    continue
                if lt is None:
                    lt = self.layout_terms(lay, mb, remat, local)
                if mt is None:  # the first point of this shape and microbatch size priced
                    keys = keys or self.microbatch_keys(lay, remat)
                    mt = part[3] = self.microbatch_terms(lay, mb, remat, n_mb, keys)
                    lcs, ops_key = part[4], part[5] = self.layers_of(lay, mb)
                ft = fsdp.get(remat != "none", _NONE)
                if ft is _NONE:
                    ft = fsdp[remat != "none"] = self.fsdp(lay, mb, remat)
                lc = lcs.get(remat)
                if lc is None:
                    lc = lcs[remat] = self.layer(lay, mb, remat, ops_key)
                step = step_parts(chip, lc, lt, mt, ft)[0]
                self.evaluated += 1
                if total > hbm:
                    continue
                self.feasible += 1
                if len(heap) < self.top:
                    heapq.heappush(heap, (-step, -self.evaluated, (lay, mb, remat)))
                elif step < -heap[0][0]:  # faster than the slowest kept (ties: the earlier one stays)
                    heapq.heapreplace(heap, (-step, -self.evaluated, (lay, mb, remat)))

    def best(self) -> tuple[TrainEstimate, ...]:
        """The kept points, best first, each made its Plan and priced from it as any Plan is
        (:mod:`lab.predict.training.from_plan`): what the planner reports is what ``train estimate --plan`` and
        ``plan --validate`` price. The search's own parts rank the points (the same sum: a test holds them equal)."""
        out = []
        for _, _, (lay, mb, remat) in sorted(self.heap, key=lambda it: (-it[0], -it[1])):
            cfg = self.config(lay, mb, remat)
            try:  # the cheap filters of _space replicate check_config; make sure of it for what we return
                check_config(cfg)
            except UserError as exc:  # pragma: no cover - a planner bug, not a user mistake
                raise RuntimeError(f"planner produced an invalid layout {lay}: {exc}") from exc
            out.append(estimate(train_config(job_plan(cfg), cfg.chip), check=False))
        return tuple(out)


__all__ = ["Search"]
