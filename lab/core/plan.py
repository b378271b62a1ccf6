"""The Plan: one frozen, JAX-free description of a program that every part of the lab reads.

A Plan names the program (a kernel, or the Transformer's train step or decode), the mesh (axis names, sizes
and which axes are fast interconnect, ICI / NVLink, and which slow, DCN / scale-out), the sharding rules
(logical dims to mesh axes), the model, the chip it is priced for, the sizes (batch, sequence, ...), dtypes,
remat and optimizer, and the implementation choices that change its cost. From it:

* the estimators derive their layout (:meth:`Plan.degrees`: ``dp, fsdp, tp, ...`` from the rules' axes);
* the kernels derive ``PartitionSpec``s (``rules.spec(logical_dims)``) and build the program;
* the audit and the ledger compare the compiled and measured program with the estimate of the same Plan.

Plans come from experiment files (``lab/run/experiment.py``), from estimator flags and from planner results
(:func:`lab.core.plan_degrees.plan_from_degrees`); :meth:`Plan.to_toml` writes one back as an experiment file.
"""
# Over 500 lines on purpose: the Plan and its checks: each check sits beside the fields it checks, so a new field and
# its validation land together.

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass, field

from lab.core.arrays import check_transformer, unsupported_features
from lab.core.attention import DEFAULT_BLOCK, Attention, check_plan
from lab.core.errors import UserError
from lab.core.models import ModelConfig
from lab.core.rules import FIELDS, NOT_EXECUTED, ShardingRules
from lab.core.units import NUMPY_NAME, canonical_dtype, numpy_name

TYPE_CHECKING = False  # typing is not imported at run time: annotations only
if TYPE_CHECKING:
    from typing import Any

    from lab.core.programs import ProgramSpec

LINKS = {"fast": "ICI / NVLink: inside a slice or node", "slow": "DCN / scale-out: across slices or nodes"}
COMPUTE_DTYPES = ("fp32", "bf16")
REMAT = ("none", "selective", "full")
OPTIMIZERS = ("adam", "sgd", "adafactor")
PP_SCHEDULES = ("gpipe", "1f1b", "interleaved")
SHARDING_MODES = ("auto", "explicit")  # JAX's: sharding propagated by XLA, or carried in the arrays' types


@dataclass(frozen=True)
class MeshAxis:
    """One mesh axis: its name, its size, and the link it runs over (``fast`` or ``slow``)."""

    name: str
    size: int
    link: str = "fast"

    def __post_init__(self) -> None:
        if isinstance(self.size, bool) or not isinstance(self.size, int) or self.size < 1:
            raise UserError(f"mesh axis {self.name!r}: size must be a positive integer, got {self.size!r}")
        if self.link not in LINKS:
            raise UserError(
                f"mesh axis {self.name!r}: link {self.link!r} is not one of {', '.join(LINKS)} "
                "(fast = ICI / NVLink, slow = DCN / scale-out)"
            )


MAX_SIZE = 2**36  # one size of a program: a vector of 2**36 float32s alone is 256 GiB, past the largest HBM (B200)


# Options a Plan carries for pricing only (Options' docstring)
PRICED_ONLY = (
    "zero_shard",
    "pp_embedding_slots",
    "attention_kernel",
    "elementwise",
    "tp_comm_overlap",
    "dp_overlap",
    "dp_bucket_mb",
    "capacity_factor",
    "grad_reduce",
)


@dataclass(frozen=True)
class Options:
    """How the program is implemented and scheduled, where that changes what it costs.

    Attributes:
        microbatch: sequences per microbatch on each data-parallel replica (None: the whole replica batch).
        zero: ZeRO stage over the data-parallel axes (1: optimizer state, 2: and gradients; 3 is FSDP).
        pp_schedule, interleave: the pipeline schedule (``gpipe``, ``1f1b``, ``interleaved`` with v chunks).
        stage_split: the layers each pipeline stage holds, first to last (empty: an even split), e.g. fewer on the
            first and last stages, which also hold the embedding and the loss.
        checkpoints_per_layer: the book's ``k`` saved ``[B, D]`` per layer, instead of the remat policy's count.
        flash_attention: attention fused (no score matrix stored, causal blocks skipped).
        fused_projections: Q/K/V and gate/up are one weight each (Megatron), so their input gradients are
            reduced once per block; the lab's Transformer keeps them apart (5 reductions per layer, not 2).
        causal: the attention mask (FLOP conventions and flash attention's skipped blocks).
        cast_first: fp32 weights computed in a 16-bit dtype are cast before FSDP gathers them, and their matmul
            gradients reduced in the 16-bit dtype (the TPU compiler moves the cast across the collective; XLA:CPU
            gathers the fp32 weights). Set for a TPU or GPU target (``lab.compile.target.for_target``).
        cast_first_out_table: with ``cast_first``, the output table too is cast before its gather (the TPU
            compiler); XLA:GPU gathers it in fp32 and casts after (``for_target`` clears it for a GPU target).
        regather_norms: under recomputation, FSDP gathers a layer's norm scales again for the recomputed forward
            (XLA:CPU does; the TPU compiler keeps them: ``for_target`` clears it).
        jax_remat: recomputation as ``jax.checkpoint`` runs it (the lab's Transformer): XLA leaves the layer's
            last projection out of the recomputed forward. False: the whole layer again (Megatron).
        spmd_pipeline: a GPipe pipeline as the lab's Transformer runs it (every stage computes and sends in all
            M + p - 1 steps, whole activations; the embeddings' gradients summed over the stages). False, or another
            schedule: Megatron's.
        spmd_context: context parallelism as the lab's Transformer compiles it (K and V gathered over the context
            shards, forward and backward; weight gradients summed over them). False: a ring (Megatron's).
        attention, attention_block_q, attention_block_k: the Transformer's attention (``xla``, ``pallas``,
            ``splash``, ``cudnn``) and the kernels' block sizes, clipped to the sequence (:mod:`lab.core.attention`).
        sharding_mode: JAX's sharding mode of the Transformer's train step: ``auto`` (activations pinned, XLA
            propagates the rest) or ``explicit`` (``AxisType.Explicit`` mesh axes, shardings in the arrays' types:
            ``kernels/transformer/explicit.py``).
        moe_partial_router: the expert layers weigh the TP ranks' partial sums (the lab's), so the router's
            gradient is all-reduced over them; False: Megatron's router, which reads the whole input.
        zero_shard ... grad_reduce (PRICED_ONLY): how another stack runs the job (train estimate's flags,
            recorded by --save-plan), priced by train estimate --plan; the lab's Transformer runs the defaults
            (capacity_factor None: its own routing; grad_reduce None: gradients reduced in the weights' dtype), and
            shardlab run refuses a Plan that changes one.
    """

    microbatch: int | None = None
    zero: int = 0
    pp_schedule: str = "1f1b"
    interleave: int = 1
    stage_split: tuple[int, ...] = ()
    checkpoints_per_layer: float | None = None
    flash_attention: bool = False
    fused_projections: bool = False
    causal: bool = True
    cast_first: bool = False
    cast_first_out_table: bool = True
    regather_norms: bool = True
    jax_remat: bool = True
    spmd_pipeline: bool = True
    spmd_context: bool = True
    attention: str = "xla"
    attention_block_q: int = DEFAULT_BLOCK
    attention_block_k: int = DEFAULT_BLOCK
    sharding_mode: str = "auto"
    moe_partial_router: bool = True
    zero_shard: int = 0
    pp_embedding_slots: bool = False
    attention_kernel: str = "fa2"
    elementwise: str = "fused"
    tp_comm_overlap: bool = False
    dp_overlap: bool = True
    dp_bucket_mb: float = 25.0
    capacity_factor: float | None = None
    grad_reduce: str | None = None

    def priced_only(self) -> list[str]:
        """The options set away from what the lab's Transformer runs: they price another stack's job only."""
        return [f"{k} = {getattr(self, k)!r}" for k in PRICED_ONLY if getattr(self, k) != getattr(_DEFAULTS, k)]

    def __post_init__(self) -> None:
        Attention(self.attention, self.attention_block_q, self.attention_block_k)  # refuses a bad name or size
        if self.sharding_mode not in SHARDING_MODES:
            raise UserError(f"sharding_mode {self.sharding_mode!r} is not one of {', '.join(SHARDING_MODES)}")
        if self.zero not in (0, 1, 2, 3):
            raise UserError(f"zero = {self.zero!r} is not one of 0, 1, 2, 3")
        if self.grad_reduce not in (None, "fp32", "bf16"):
            raise UserError(f"grad_reduce = {self.grad_reduce!r} is not one of fp32, bf16")
        if self.pp_schedule not in PP_SCHEDULES:
            raise UserError(f"pp_schedule = {self.pp_schedule!r} is not one of {', '.join(PP_SCHEDULES)}")
        for name in ("microbatch", "interleave"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                raise UserError(f"{name} = {v!r} must be a positive integer")
        object.__setattr__(self, "stage_split", tuple(self.stage_split))
        if any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in self.stage_split):
            said = list(self.stage_split)
            raise UserError(f"stage_split = {said} must list positive layer counts, e.g. [3, 4, 4, 3]")
        if self.interleave > 1 and self.pp_schedule != "interleaved":
            raise UserError(f'interleave = {self.interleave} needs pp_schedule = "interleaved"')


@dataclass(frozen=True)
class Plan:
    """One program, fully described (see the module docstring)."""

    program: str
    mesh: tuple[MeshAxis, ...]
    sizes: Mapping[str, int]
    name: str = ""
    hardware: str = "calibrated"
    dtype: str = "fp32"
    param_dtype: str = "fp32"
    model: ModelConfig | None = None
    rules: ShardingRules | None = None
    rules_preset: str | None = None
    remat: str = "none"
    optimizer: str = "adam"
    axes: tuple[str, ...] | None = None
    options: Options = field(default_factory=Options)
    entry: str | None = None  # user_model: the function that builds the user's module (kernels/user_model.py)

    # ----- derived ------------------------------------------------------------------------------------

    @property
    def spec(self) -> ProgramSpec:
        from lab.core.programs import get_program  # the program table: not for the analytic train estimate

        return get_program(self.program)

    @property
    def shape(self) -> dict[str, int]:
        """Axis name -> size, major to minor."""
        return {a.name: a.size for a in self.mesh}

    @property
    def devices(self) -> int:
        return math.prod(a.size for a in self.mesh)

    @property
    def slow_axes(self) -> tuple[str, ...]:
        return tuple(a.name for a in self.mesh if a.link == "slow")

    @property
    def batch(self) -> int | None:
        return self.sizes.get("batch")

    @property
    def seq_len(self) -> int | None:
        """Tokens per sequence: ``seq`` for a train step, the prompt for decode."""
        return self.sizes.get("seq", self.sizes.get("prompt_len"))

    @property
    def is_transformer(self) -> bool:
        return self.spec.family == "transformer"

    def degrees(self) -> dict[str, int]:
        """The estimators' parallel degrees (``dp, fsdp, tp, pp, cp, ep`` and ``sequence_parallel``)."""
        if self.rules is None:
            raise UserError(f"{self.program} has no sharding rules: the training and inference estimators need them")
        return self.rules.degrees(self.shape)

    def stored_layers(self) -> int:
        """Layers the Transformer stacks: the model's, or under an uneven ``stage_split`` every stage padded to the
        largest (the padding masked out of the computation)."""
        assert self.model is not None
        split = self.options.stage_split
        return len(split) * max(split) if split else self.model.layers

    def microbatches(self) -> int:
        """Microbatches per step: each data-parallel replica's sequences over ``options.microbatch`` (1 without
        it); a train step the lab runs cuts its batch into these only when the layers are pipelined."""
        if self.rules is None or self.options.microbatch is None:
            return 1
        deg = self.degrees()
        return max(1, self.sizes["batch"] // (deg["dp"] * deg["fsdp"] * self.options.microbatch))

    def roles(self) -> dict[str, tuple[str, ...]]:
        """Mesh axes of each parallelism (``tp``, ``fsdp``, ``dp``, ``batch``, ...), live axes only."""
        if self.rules is None:
            return {}
        return self.rules.roles(self.shape)

    def role_links(self) -> dict[str, str]:
        """``slow`` for a parallelism any of whose axes crosses the slow link, else ``fast``."""
        slow = set(self.slow_axes)
        return {role: ("slow" if slow & set(axes) else "fast") for role, axes in self.roles().items()}

    # ----- checks -------------------------------------------------------------------------------------

    def _validate_user(self) -> None:
        """A user model: an entry point, rules for its logical dims, positive sizes of any names."""
        if not self.entry:
            raise UserError('user_model needs entry = "FILE.py:FUNCTION" (or "MODULE:FUNCTION") in [experiment]')
        if self.rules is None:
            raise UserError('user_model needs [rules]: the mesh axes of its logical dims (preset = "fsdp_tp", ...)')
        self.rules.check_mesh(self.shape)
        if self.options.sharding_mode != "auto":
            raise UserError(
                'sharding_mode = "explicit" applies to the Transformer\'s train_step; user_model runs in auto mode'
            )
        for k, v in self.sizes.items():
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise UserError(f"user_model: size {k} = {v!r} must be a positive integer")
        if self.dtype not in COMPUTE_DTYPES:
            raise UserError(f"dtype {self.dtype!r} is not one of float32, bfloat16")

    def validate(self, *, executable: bool = True) -> None:
        """Everything that can be checked without JAX; ``executable`` adds what the kernels need to build it.

        Raises:
            UserError: naming the bad value and a valid alternative.
        """
        spec = self.spec
        if len({a.name for a in self.mesh}) != len(self.mesh):
            raise UserError(f"mesh names an axis twice: {', '.join(a.name for a in self.mesh)}")
        for d in spec.dims:
            v = self.sizes.get(d)
            if v is None:
                raise UserError(
                    f"{spec.name}: no size for dim {d!r}; give {', '.join(f'{x} = <n>' for x in spec.dims)}"
                )
        if spec.family == "user":
            self._validate_user()
            return
        extra = sorted(set(self.sizes) - set(spec.dims))
        if extra:
            raise UserError(f"{spec.name}: unknown size {extra[0]!r}; its sizes are {', '.join(spec.dims)}")
        for k, v in self.sizes.items():
            if isinstance(v, int) and v > MAX_SIZE:
                raise UserError(
                    f"{spec.name}: size {k} = {v} is past any machine (a vector of that many float32s alone is "
                    f"{v * 4:.3g} bytes, the largest HBM 192 GB); give at most {MAX_SIZE} (2**36)"
                )
        if self.dtype not in COMPUTE_DTYPES and executable:
            raise UserError(f"dtype {self.dtype!r} is not one of float32, bfloat16")
        if self.param_dtype not in ("fp32", "bf16"):
            raise UserError(f"param_dtype {self.param_dtype!r} is not one of float32, bfloat16 (the weights' dtype)")
        if self.remat not in REMAT and executable:  # a named policy (train estimate --remat) prices only
            raise UserError(
                f"remat {self.remat!r}: the lab's Transformer runs {', '.join(REMAT)} (a named policy is priced only: "
                "train estimate --plan)"
            )
        if self.optimizer not in OPTIMIZERS:
            raise UserError(f"optimizer {self.optimizer!r} is not one of {', '.join(OPTIMIZERS)}")
        if self.axes is not None:
            for a in self.axes:
                if a not in self.shape:
                    raise UserError(f"axes names {a!r}, which is not a mesh axis ({', '.join(self.shape)})")
        if self.axes and spec.family != "collective":
            raise UserError(
                f"axes = {list(self.axes)!r}: only the collective programs take axes; {spec.name} is placed "
                "by " + ("its rules" if spec.needs_model else "its notation")
            )
        if spec.needs_model:
            self._validate_transformer(executable)
            return
        if self.rules is not None and self.rules.mesh_axes():
            raise UserError(f"{spec.name} is placed by its notation; sharding rules apply to train_step and decode")
        self._validate_kernel()

    def _validate_kernel(self) -> None:
        """A kernel's mesh names only axes it uses, its options are the defaults (they configure the Transformer),
        and every sharded dim of its notation divides over its axes."""
        spec = self.spec
        if spec.mesh_axes is not None:  # other axes replicate it; but naming none of its own is a misnamed mesh
            unused = [a.name for a in self.mesh if a.name not in spec.mesh_axes and a.size > 1]
            if unused and all(self.shape.get(a, 1) == 1 for a in spec.mesh_axes):
                raise UserError(
                    f"mesh axis {unused[0]!r}: {spec.name} shards over {', '.join(spec.mesh_axes)}, and the mesh "
                    "names none of them (it would run unsharded); name the axes so, e.g. X = 2, Y = 4"
                )
        if self.remat != "none" or self.optimizer != "adam" or self.options != Options() or self.param_dtype != "fp32":
            raise UserError(
                f"[options] configure the Transformer's train_step and decode; {spec.name} takes none (remove them)"
            )
        from lab.core import programs as P

        if spec.family == "attention":  # T over context, B over data
            P.check_attention_sizes(spec.name, self.shape, dict(self.sizes))
        if spec.family == "moe":  # E over expert, T over data x expert
            P.check_moe_sizes(spec.name, self.shape, dict(self.sizes))
        if spec.family == "pipeline":  # L over pipe (the even split: a Plan carries none), B over data x M
            if spec.name == "pipeline_circular":
                P.check_circular_sizes(spec.name, self.shape, dict(self.sizes))
            else:
                P.check_pipeline_sizes(spec.name, self.shape, dict(self.sizes))
        if spec.notation:
            from lab.core.notation import parse_matmul

            for part in spec.notation.split(";"):
                e = parse_matmul(part.strip())
                for arr in (e.lhs, e.rhs, e.out):
                    if arr is not None:
                        arr.check(self.shape, self.sizes)

    def _validate_transformer(self, executable: bool) -> None:
        m, rules = self.model, self.rules
        if m is None:
            raise UserError(f'{self.program} needs a model: a [model] table, or model = "llama3-8b"')
        if rules is None:
            raise UserError(f'{self.program} needs sharding rules: [rules] preset = "fsdp_tp" (or per-dim axes)')
        rules.check_mesh(self.shape, "[rules]")
        if self.options.pp_schedule != "1f1b" and self.degrees()["pp"] == 1:
            raise UserError(
                f'pp_schedule = "{self.options.pp_schedule}" schedules pipeline stages, and the rules put no mesh axis '
                'on layers; add layers = "<axis>" to [rules], or leave pp_schedule out'
            )
        from lab.core import plan_checks  # the parallelisms the Transformer runs from its rules

        plan_checks.expert_count(self)
        if not executable:
            return
        priced = self.options.priced_only()
        if priced:
            raise UserError(
                f"[options] {', '.join(priced)} prices how another stack runs the job; the lab's Transformer runs "
                "the defaults: drop them to run the Plan (train estimate --plan prices it as it is)"
            )
        plan_checks.pipeline(self)
        plan_checks.context(self)
        plan_checks.experts(self)
        plan_checks.explicit_mode(self)
        check_plan(self)  # the attention kernel's blocks and layout
        for dim in NOT_EXECUTED:
            if rules.axes(dim):
                raise UserError(
                    f"[rules] {dim} = {rules.axes(dim)!r}: the lab's Transformer does not run {dim} sharded yet; "
                    f"leave {dim} out to run it (the estimators price it: shardlab train estimate --plan)"
                )
        if m.is_moe and self.program != "train_step":
            raise UserError(
                f"model {m.name!r} has experts={m.experts}: the lab runs a mixture of experts in its train step only; "
                "price its decode with `shardlab infer estimate --experts ...`, or give a dense model"
            )
        missing = unsupported_features(m)
        if missing:
            raise UserError(
                f"model {m.name!r} has {', '.join(missing)}; the lab's Transformer builds LLaMA-style models only "
                "(SwiGLU, RoPE, RMSNorm, untied, no biases, one block after the other, full attention)"
                + ("; sliding_window = 0 in [model] runs it with full attention" if m.window_layers else "")
            )
        if m.head_dim % 2:
            raise UserError(f"model {m.name!r}: head-dim={m.head_dim} must be even for rotary embeddings")
        if self.program == "train_step":
            seq = self.sizes["seq"]
            if seq < 2 or seq > m.max_seq_len:
                raise UserError(f"seq={seq} must be between 2 and max-seq-len={m.max_seq_len}")
            stored = dataclasses.replace(m, layers=self.stored_layers())  # the stacked layers, padded
            check_transformer(stored, rules, self.shape, batch=self.sizes["batch"], seq=seq)
        elif self.program == "serve":  # a replica per step of the batch axes, one token a slot
            if rules.axes("layers"):
                raise UserError("serve does not pipeline: leave [rules] layers unsharded")
            check_transformer(m, rules, self.shape, batch=rules.size("batch", self.shape), seq=1, decode=True)
        else:
            p, s = self.sizes["prompt_len"], self.sizes["steps"]
            if p + s > m.max_seq_len + 1:
                raise UserError(
                    f"prompt_len={p} + steps={s} must fit max-seq-len={m.max_seq_len} (+1); "
                    f"shorten them or set max_seq_len = {p + s - 1}"
                )
            check_transformer(m, rules, self.shape, batch=self.sizes["batch"], seq=p, decode=True)

    # ----- output -------------------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "name": self.name,
            "program": self.program,
            "mesh": [dataclasses.asdict(a) for a in self.mesh],
            "sizes": dict(self.sizes),
            "hardware": self.hardware,
            "dtype": self.dtype,
            "param_dtype": self.param_dtype,
            "remat": self.remat,
            "optimizer": self.optimizer,
            "options": {k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(self.options).items()},
        }
        if self.axes is not None:
            d["axes"] = list(self.axes)
        if self.entry is not None:
            d["entry"] = self.entry
        if self.model is not None:
            d["model"] = dataclasses.asdict(self.model)
        if self.rules is not None:
            d["rules"] = self.rules.to_dict()
            d["rules_preset"] = self.rules_preset
            d["degrees"] = self.degrees()
        return d

    def to_toml(self, question: str = "") -> str:
        """This Plan as an experiment file that ``shardlab run`` and ``train estimate --plan`` read back."""

        def val(v: Any) -> str:
            if isinstance(v, bool):
                return "true" if v else "false"
            if isinstance(v, str):
                return f'"{v}"'
            if isinstance(v, tuple | list):
                return "[" + ", ".join(val(x) for x in v) + "]"
            return repr(v)

        dt = numpy_name(self.dtype) if self.dtype in NUMPY_NAME else self.dtype
        lines = [f"# {question or 'Written by shardlab from a Plan.'}", "[experiment]"]
        lines += [f"name = {val(self.name or self.program)}", f"program = {val(self.program)}"]
        lines += [f"hardware = {val(self.hardware)}", f"dtype = {val(dt)}"]
        if self.axes is not None:
            lines.append(f"axes = {val(self.axes)}")
        if self.entry is not None:
            lines.append(f"entry = {val(self.entry)}")
        lines += ["", "[mesh]"]
        for a in self.mesh:
            lines.append(
                f"{a.name} = {a.size}" if a.link == "fast" else f'{a.name} = {{ size = {a.size}, link = "slow" }}'
            )
        lines += ["", "[sizes]"] + [f"{k} = {v}" for k, v in self.sizes.items()]
        if self.model is not None:
            lines += ["", "[model]"]
            for f in dataclasses.fields(ModelConfig):
                if f.name != "source":
                    lines.append(f"{f.name} = {val(getattr(self.model, f.name))}")
        if self.rules is not None:
            lines += ["", "[rules]"]
            lines += [f"{k} = {val(v if len(v) > 1 else v[0])}" for k, v in self.rules.to_dict().items()]
        opts = {k: v for k, v in dataclasses.asdict(self.options).items() if v is not None and v != ()}
        opts |= {"remat": self.remat, "optimizer": self.optimizer, "param_dtype": self.param_dtype}
        lines += ["", "[options]"] + [f"{k} = {val(v)}" for k, v in opts.items()]
        return "\n".join(lines) + "\n"


_DEFAULTS = Options()


def make_mesh_axes(shape: Mapping[str, int], slow: tuple[str, ...] = ()) -> tuple[MeshAxis, ...]:
    return tuple(MeshAxis(name, int(size), "slow" if name in slow else "fast") for name, size in shape.items())


def kernel_plan(
    program: str,
    mesh: Mapping[str, int],
    sizes: Mapping[str, int],
    dtype: str = "fp32",
    axes: tuple[str, ...] | None = None,
    *,
    hardware: str = "calibrated",
    name: str = "",
) -> Plan:
    """A Plan for a registry kernel, its mesh completed with the axes the kernel looks up by name."""
    from lab.core.programs import complete_mesh, get_program

    spec = get_program(program)
    if spec.needs_model:
        raise UserError(f"{program} needs a model and sharding rules: describe it in an experiment file")
    full = complete_mesh(spec, dict(mesh))
    return Plan(
        program=program,
        mesh=make_mesh_axes(full),
        sizes=dict(sizes),
        name=name or program,
        hardware=hardware,
        dtype=canonical_dtype(dtype),
        axes=tuple(axes) if axes is not None else None,
    )


__all__ = [
    "COMPUTE_DTYPES",
    "FIELDS",
    "LINKS",
    "SHARDING_MODES",
    "MeshAxis",
    "Options",
    "Plan",
    "kernel_plan",
    "make_mesh_axes",
]
