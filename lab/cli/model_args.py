"""The model and the Plan a command's flags describe: ``--model`` with the custom-model flags, and ``--plan FILE``
(an experiment's Plan, refused beside flags it already gives), with the table of the ops its estimate names.

Split from :mod:`lab.cli.args` (the parser, argument types and output paths every command shares) because only the
commands that price a model (``model``, ``train``, ``infer``, ``plan``, ``study``, ``limits``) need it."""

from __future__ import annotations

import argparse
import dataclasses
import os
from pathlib import Path

from lab.cli.args import Parser, nonneg_int, positive_int, warn
from lab.core.errors import UserError
from lab.core.hardware import default_catalog, scale_chip

TYPE_CHECKING = False  # typing is not imported at run time: annotations only
if TYPE_CHECKING:
    from lab.core.models import ModelConfig


def model_flags() -> tuple[str, ...]:
    """The custom-model flags' names: every size of :mod:`lab.core.models` but the context (the job's --seq-len
    sets it), and the two switches; read from the model's own table when a command needs them."""
    from lab.core.models import ZERO_MEANS_NONE

    return (*_sizes(), "tied_embeddings", *ZERO_MEANS_NONE, "gated_mlp", "parallel_block")


def _sizes() -> tuple[str, ...]:
    """The model's positive sizes a flag sets: all but the context, which the job's --seq-len sets."""
    from lab.core.models import POSITIVE_DIMS

    return tuple(f for f in POSITIVE_DIMS if f != "max_seq_len")


_ZERO_MEANS_NONE_HELP = {
    "shared_experts": "experts every token goes through besides its routed ones (MoE)",
    "dense_layers": "leading layers with a dense MLP instead of experts (MoE)",
    "dense_d_ff": "width of that dense MLP (default d_ff x (experts-per-token + shared-experts))",
    "kv_lora_rank": "multi-head latent attention: the KV latent width (the KV cache keeps it per token)",
    "q_lora_rank": "latent attention: the query latent width (default 0: a full-rank query)",
    "rope_head_dim": "latent attention: the decoupled RoPE width per head (--head-dim is without it)",
    "v_head_dim": "latent attention: the value head width (default --head-dim)",
    "sliding_window": "a windowed layer attends to (and caches) the last N positions only (Mistral 7B v0.1, Gemma 2)",
    "global_layers": "with --sliding-window: the layers that still attend to the whole context (default 0: none)",
}


def model_parent(positional: bool) -> argparse.ArgumentParser:
    """--model NAME (or a positional NAME) plus the custom-model flags."""
    p = Parser(add_help=False)
    if positional:
        p.add_argument("model", nargs="?", metavar="NAME", help="catalog model or a .toml file (see `model list`)")
    else:
        p.add_argument("--model", metavar="NAME", help="catalog model or a .toml file; flags below override it")
    from lab.core.models import ZERO_MEANS_NONE

    g = p.add_argument_group("custom model")
    for name in _sizes():
        flag = name.replace("_", "-")
        g.add_argument(f"--{flag}", type=positive_int(f"--{flag}"), metavar="N")
    for name in ZERO_MEANS_NONE:
        flag = name.replace("_", "-")
        g.add_argument(f"--{flag}", type=nonneg_int(f"--{flag}"), metavar="N", help=_ZERO_MEANS_NONE_HELP[name])
    g.add_argument("--tied-embeddings", action=argparse.BooleanOptionalAction, default=None)
    g.add_argument(
        "--gated-mlp",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="SwiGLU MLP with 3 matrices (default for custom models) or a 2-matrix GeLU MLP",
    )
    g.add_argument(
        "--parallel-block",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="attention and MLP side by side on one input (GPT-J, GPT-NeoX, Falcon): one TP sum a layer, not two",
    )
    return p


def model_of(args: argparse.Namespace) -> ModelConfig:
    """The model a command's ``--model`` and custom-model flags describe (each flag checked by its type)."""
    from lab.core.models import resolve_model

    check_model_path(args.model)
    for name, default in _ZERO_IS_DEFAULT.items():
        if getattr(args, name, None) == 0:
            flag = f"--{name.replace('_', '-')}"
            raise UserError(
                f"{flag} 0 is a width of nothing; leave {flag} out for the default ({default}), or give one"
            )
    return resolve_model(args.model, {k: getattr(args, k) for k in model_flags()})


# Widths whose 0 in a model means "the default width", so that 0 given as a flag says something it does not mean.
_ZERO_IS_DEFAULT = {"dense_d_ff": "d_ff x (experts-per-token + shared-experts)", "v_head_dim": "--head-dim"}


def check_model_path(spec: str | None) -> None:
    """A ``--model`` that names a path (``.toml`` or with a ``/``) which is there but is no regular file: said so
    (a folder, ``/dev/null``), not reported as missing by the loader."""
    if spec is None or not (spec.endswith(".toml") or os.path.sep in spec):
        return
    p = Path(spec)
    if p.is_dir():
        raise UserError(f"model file {spec!r} is a folder, not a file; give a .toml model file or a catalog name")
    if p.exists() and not p.is_file():
        raise UserError(
            f"model file {spec!r} is not a regular file (a device, pipe or socket); give a .toml model file or a "
            "catalog name (see `shardlab model list`)"
        )


PLAN_CONFLICTS = (
    "model",
    "chips",
    "dp",
    "fsdp",
    "tp",
    "pp",
    "cp",
    "global_batch",
    "batch_tokens",
    "seq_len",
    "batch",
    "context",
    "prefill_len",
    "generate",
)


def plan_options(parser: argparse.ArgumentParser, *dests: str) -> None:
    """Record on ``parser`` the defaults of its options that a Plan gives or prices its own way (``[options]``, the
    dtypes, the pricing mode): :func:`plan_of` refuses any of them changed next to ``--plan`` instead of ignoring it."""
    parser.set_defaults(plan_options={d: parser.get_default(d) for d in dests})


def plan_of(args: argparse.Namespace, program: str, command: str):
    """``(plan, chip)`` of ``--plan FILE``: the experiment file's Plan, priced on its hardware or ``--hardware``.

    Raises:
        UserError: the file describes another program, or a flag that the Plan already gives is set too.
    """
    from lab.run.experiment import load_experiment

    given = [f"--{k.replace('_', '-')}" for k in PLAN_CONFLICTS if getattr(args, k, None) is not None]
    given += [f"--{k.replace('_', '-')}" for k in model_flags() if getattr(args, k, None) is not None]
    options = getattr(args, "plan_options", {})
    given += [f"--{k.replace('_', '-')}" for k, d in options.items() if getattr(args, k, d) != d]
    if given:
        raise UserError(
            f"{', '.join(given)} with --plan: the Plan gives the model, layout, sizes and options and is priced as "
            "the lab builds it; drop them (or change the experiment file)"
        )
    plan = load_experiment(args.plan).plan
    if plan.program != program:
        other = {"train_step": "train estimate", "decode": "infer estimate"}.get(plan.program, "shardlab audit")
        raise UserError(f"--plan {args.plan} runs {plan.program}; {command} prices {program} (try `{other}`)")
    if args.hardware:  # re-targeted: the Plan priced is the Plan with this chip
        plan = dataclasses.replace(plan, hardware=args.hardware)
    name = plan.hardware
    catalog = default_catalog(args.hardware_file)
    try:
        chip = catalog.get("cpu" if name == "calibrated" else name)
    except UserError as exc:
        if args.hardware or name == "calibrated":  # the flag's, or the host calibration's (which names its file)
            raise
        from lab.run.experiment import line_of

        line = line_of(Path(args.plan).read_text(encoding="utf-8"), "experiment", "hardware")
        raise UserError(f"{args.plan}{f':{line}' if line else ''}: [experiment].hardware: {exc}") from None
    if name == "calibrated" and not chip.calibrated:
        warn(
            args,
            "no calibration of this host yet: pricing with the catalog's uncalibrated cpu entry "
            "(`shardlab calibrate`, or --hardware NAME)",
        )
    scale = getattr(args, "scale", None)
    return plan, (scale_chip(chip, scale) if scale else chip)


def ops_table(program) -> str:
    """The estimate's named ops: the same list ``shardlab run`` joins to what ran."""
    from lab.core.table import render
    from lab.core.units import fmt_bytes, fmt_count, fmt_seconds

    rows = [
        [
            o.name,
            o.kind,
            ",".join(o.axes) or "-",
            fmt_seconds(o.time_s) + (f" ({o.hidden})" if o.hidden else ""),
            f"{o.calls:g}",
            fmt_bytes(o.bytes) if o.is_collective else (fmt_count(o.flops) if o.flops else "-"),
        ]
        for o in program.ops
    ]
    return render(["named op", "kind", "axes", "time per step (hidden behind)", "calls", "bytes / FLOPs"], rows)


__all__ = [
    "PLAN_CONFLICTS",
    "check_model_path",
    "model_flags",
    "model_of",
    "model_parent",
    "ops_table",
    "plan_of",
    "plan_options",
]
