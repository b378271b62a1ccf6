"""Audit the JAX Transformer's compiled train step against the training estimator.

For a ``kernels.transformer`` configuration (sharding rules, mesh, batch, sequence, remat), the
prediction uses the training estimator's vocabulary (``lab/predict/training.py``), counted for one step of one
microbatch:

* **data parallelism** (``dp``): one gradient AllReduce of every parameter over the batch axes;
* **FSDP** (``fsdp``, ``fsdp_tp``): per layer an AllGather of the layer's weights before the forward and
  again before the backward, and a ReduceScatter of its gradients; the embedding and output
  projection likewise;
* **tensor parallelism** (``tp``, ``fsdp_tp``): per layer two AllReduces of the ``[batch, seq, D]``
  activations forward and two backward (full recomputation repeats the forward's); with sequence
  parallelism (``tp_sp``) each becomes an AllGather + ReduceScatter pair of the same bytes;
* the vocab-parallel embedding and logits of a TP model add an AllReduce of ``[batch, seq, D]`` after the
  embedding lookup (and its backward), which the estimator does not carry per layer.

Bytes are compared per collective kind and mesh axes (summed over the loop over layers), in the dtype the
program runs (float32 parameters and gradients here; the estimator's own memory model assumes bf16 weights
and fp32 gradients, which the memory comparison states). Differences are listed, not hidden.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from lab.compile.audit import AuditEntry, Predicted, compare
from lab.compile.hlo import collectives, dots, parse_module
from lab.core.table import render
from lab.core.units import fmt_bytes


@dataclass(frozen=True)
class ModelAudit:
    rules: str
    mesh: dict[str, int]
    batch: int
    seq: int
    remat: str
    entries: tuple[AuditEntry, ...]
    unexpected: tuple[dict[str, Any], ...]
    flops_compiled: float
    memory: dict[str, float]

    @property
    def all_match(self) -> bool:
        return all(e.match for e in self.entries) and not self.unexpected

    def to_dict(self) -> dict[str, Any]:
        return {
            "rules": self.rules,
            "mesh": self.mesh,
            "batch": self.batch,
            "seq": self.seq,
            "remat": self.remat,
            "entries": [e.to_dict() for e in self.entries],
            "unexpected": list(self.unexpected),
            "all_match": self.all_match,
            "flops_compiled": self.flops_compiled,
            "memory": self.memory,
        }

    def table(self) -> str:
        rows = [
            [
                e.op,
                e.kind,
                ",".join(e.axes),
                fmt_bytes(e.predicted_bytes),
                fmt_bytes(e.compiled_bytes),
                "yes" if e.match else "NO",
                e.note,
            ]
            for e in self.entries
        ]
        out = render(
            ["estimator term", "kind", "axes", "predicted", "compiled", "match", "note"],
            rows,
            title=f"train step, rules {self.rules}, mesh {self.mesh}, batch {self.batch} x seq {self.seq}, "
            f"remat {self.remat}",
        )
        for u in self.unexpected:
            out += (
                f"\nUNEXPECTED {u['kind']} over {','.join(u['axes'])} ({fmt_bytes(u['bytes'])}): {u['name']} "
                f"[{u['op_name']}]"
            )
        m = self.memory
        out += (
            f"\nmemory per device: compiled {fmt_bytes(m['compiled_bytes'])} (arguments + temporaries), "
            f"estimator {fmt_bytes(m['estimator_bytes'])}: ratio {m['ratio']:.2f}"
        )
        return out


def _axes(rule) -> tuple[str, ...]:
    if rule is None:
        return ()
    return (rule,) if isinstance(rule, str) else tuple(rule)


def predict_train(
    cfg, rules_name: str, mesh: dict[str, int], batch: int, seq: int, remat: str, dtype_bytes: float = 4.0
) -> list[Predicted]:
    """The estimator's collectives for one train step of ``kernels.transformer`` (module docstring)."""
    from kernels.transformer import get_rules, param_info

    rules = get_rules(rules_name)
    live = {a for a, n in mesh.items() if n > 1}

    def live_axes(rule) -> tuple[str, ...]:
        return tuple(a for a in _axes(rule) if a in live)

    def size(axes: tuple[str, ...]) -> int:
        out = 1
        for a in axes:
            out *= mesh[a]
        return out

    tp = live_axes(rules.heads)
    sp = live_axes(rules.sequence)
    fsdp = live_axes(rules.embed)
    batch_axes = live_axes(rules.batch)
    local_tokens = batch / size(batch_axes) * seq
    act = local_tokens * cfg.d_model * dtype_bytes  # [batch, seq, D] per device, whole over the TP axis
    L = cfg.layers
    preds: list[Predicted] = []
    if tp:
        # The model's Q, K, V and gate, up projections are separate weights: each column-parallel projection
        # has its own collective (5 per layer) where Megatron's fused QKV and gate-up weights have one each
        # (the estimator's 2). Row-parallel outputs (attention out, MLP down) have one each.
        col, row = 5, 2
        fwd = 2 if remat == "full" else 1  # full recomputation runs the forward's collectives again
        if sp:
            # AllGathers: into attention and into the MLP (shared by their projections) forward; backward the
            # transposes of the two ReduceScatters plus the two inputs gathered again for the weight gradients;
            # once each for the logits' input and the embedding's backward.
            ag = ((row * fwd + 2 * row) * L + 2) * act
            preds.append(
                Predicted(
                    "all-gather", tp, ag, "fp32", "SP AllGathers: 2 per layer forward, 4 backward, logits, embedding"
                )
            )
            rs = (row * fwd + col) * L * act
            preds.append(
                Predicted(
                    "reduce-scatter",
                    tp,
                    rs,
                    "fp32",
                    "SP ReduceScatters: 2 per layer forward, 5 backward (unfused projections)",
                )
            )
            norms = (2 * L + 1) * cfg.d_model * dtype_bytes + local_tokens * dtype_bytes
            preds.append(
                Predicted(
                    "all-reduce",
                    tp,
                    norms,
                    "fp32",
                    "norm-weight gradients (sequence-sharded) and the loss's backward sum",
                )
            )
        else:
            preds.append(
                Predicted(
                    "all-reduce",
                    tp,
                    (row * fwd + col) * L * act,
                    "fp32",
                    "TP AllReduces: 2 per layer forward, 5 backward (unfused projections)",
                )
            )
        ll = local_tokens * dtype_bytes
        preds.append(
            Predicted(
                "all-reduce",
                tp,
                2 * act + (2 if sp else 3) * ll,
                "fp32",
                "vocab-parallel embedding (forward) and logits (backward), softmax max and sum (and its backward)",
            )
        )
    info = param_info(cfg)
    layer_local = other_local = 0.0
    for _, arr in _leaves(info):
        elems = 1
        for d in arr.shape:
            elems *= d
        for logical in arr.logical_axes:
            if logical in ("heads", "kv_heads", "ffw", "vocab"):
                elems /= size(live_axes(getattr(rules, logical)))
        if "layers" in arr.logical_axes or len(arr.shape) == 1:  # layer weights and the final norm scale
            layer_local += elems
        else:
            other_local += elems
    params_local = layer_local + other_local
    loss = Predicted("all-reduce", batch_axes, dtype_bytes, "fp32", "loss mean over the batch") if batch_axes else None
    if fsdp:
        # Layer weights (and the final norm scale) are gathered before the forward and again before the
        # backward; the embedding and output projection stay gathered between the two.
        preds.append(
            Predicted(
                "all-gather",
                fsdp,
                (2 * layer_local + other_local) * dtype_bytes,
                "fp32",
                "FSDP weight AllGathers: layers twice, embeddings once",
            )
        )
        preds.append(
            Predicted("reduce-scatter", fsdp, params_local * dtype_bytes, "fp32", "FSDP gradient ReduceScatters")
        )
    dp = tuple(a for a in batch_axes if a not in fsdp)
    if dp:
        preds.append(
            Predicted("all-reduce", dp, params_local / size(fsdp) * dtype_bytes, "fp32", "DP gradient AllReduce")
        )
    if loss:
        preds.append(loss)
    return preds


def _leaves(tree, prefix=""):
    if isinstance(tree, dict):
        for k, v in tree.items():
            yield from _leaves(v, f"{prefix}/{k}")
    else:
        yield prefix, tree


def audit_train(cfg, rules_name: str, mesh: dict[str, int], batch: int, seq: int, remat: str = "none") -> ModelAudit:
    """Compile the train step and compare its collectives and memory with the estimators."""
    from kernels.transformer import build_train, get_rules
    from lab.core.hardware import get_chip
    from lab.core.models import ModelConfig
    from lab.predict.training import Layout, TrainConfig, memory_per_chip

    step, args = build_train(cfg, rules_name, mesh, batch, seq, remat)
    compiled = step.lower(*args).compile()
    module = parse_module(compiled.as_text())
    predicted = predict_train(cfg, rules_name, mesh, batch, seq, remat)
    entries, unexpected = compare(predicted, collectives(module), mesh)
    flops = sum(d.flops * d.times for d in dots(module))
    mem = compiled.memory_analysis()
    compiled_bytes = float(getattr(mem, "argument_size_in_bytes", 0) + getattr(mem, "temp_size_in_bytes", 0))
    # The estimator's per-chip memory for the same model and layout (bf16 weights, fp32 grads and Adam state).
    model = ModelConfig(
        name="tiny",
        layers=cfg.layers,
        d_model=cfg.d_model,
        d_ff=cfg.d_ff,
        heads=cfg.heads,
        kv_heads=cfg.kv_heads,
        head_dim=cfg.head_dim,
        vocab=cfg.vocab,
        max_seq_len=cfg.max_seq_len,
    )
    rules = get_rules(rules_name)

    def deg(rule) -> int:
        out = 1
        for a in _axes(rule):
            out *= mesh.get(a, 1)
        return out

    tp = deg(rules.heads)
    fsdp = deg(rules.embed)
    replicas = deg(rules.batch)
    lay = Layout(tp=tp, fsdp=fsdp, dp=max(1, replicas // fsdp), sequence_parallel=rules.sequence is not None)
    est = memory_per_chip(
        TrainConfig(
            model=model,
            chip=get_chip("cpu"),
            layout=lay,
            seq_len=seq,
            global_batch=batch,
            microbatch=batch // replicas,
            remat=remat,
            flash_attention=False,
        )
    )
    memory = {
        "compiled_bytes": compiled_bytes,
        "estimator_bytes": est.total,
        "ratio": compiled_bytes / est.total if est.total else float("nan"),
        "compiled_temp_bytes": float(getattr(mem, "temp_size_in_bytes", 0)),
        "estimator_activation_bytes": est.activations,
    }
    return ModelAudit(rules_name, dict(mesh), batch, seq, remat, tuple(entries), tuple(unexpected), flops, memory)
