"""One help text per flag that several commands share, with its unit, filled in where a command gave none.

:func:`document` walks the built parser once: a flag without help gets the text below, and every flag with a
default that its help does not mention gets ``(default X)`` appended, so ``--help`` always says the unit and the
default. ``tests/test_cli.py`` holds every flag of every command to it.
"""

from __future__ import annotations

import argparse

HELP = {
    "--batch-tokens": "tokens per optimizer step, all sequences together (e.g. 4Mi or 4194304)",
    "--chips": "number of chips",
    "--context": "tokens held in each sequence's KV cache",
    "--cp": "context-parallel degree (sequence split across chips for attention)",
    "--d-ff": "MLP hidden width F, elements (default: the model's)",
    "--d-model": "model width D, elements (default: the model's)",
    "--dp": "data-parallel degree (replicas)",
    "--dtype": "compute dtype",
    "--ep": "expert-parallel degree",
    "--experts": "experts per MoE layer (default: the model's)",
    "--experts-per-token": "experts each token is routed to (default: the model's)",
    "--flash-attention": "attention fused: no score matrix stored, causal blocks skipped",
    "--fsdp": "FSDP (ZeRO-3) degree: weights sharded and gathered per layer",
    "--global-batch": "sequences per optimizer step",
    "--hardware": "catalog chip (shardlab hardware list)",
    "--head-dim": "width of one attention head, elements (default: the model's)",
    "--heads": "attention (query) heads (default: the model's)",
    "--interleave": "model chunks per pipeline stage (interleaved schedule)",
    "--kv": "KV-cache dtype",
    "--kv-dtype": "KV-cache dtype, for the bytes per token",
    "--kv-heads": "key/value heads (GQA; default: the model's)",
    "--layers": "transformer layers (default: the model's)",
    "--microbatch": "sequences per microbatch on each data-parallel replica",
    "--model": "catalog model (shardlab model list)",
    "--no-wraparound": "price the ring without the torus's wraparound links",
    "--optimizer": "optimizer whose state is kept per parameter",
    "--png": "also write the chart to this PNG file",
    "--pp": "pipeline-parallel degree (stages)",
    "--pp-schedule": "pipeline schedule",
    "--prefill-len": "prompt tokens per sequence to prefill (time to first token)",
    "--quiet": "no progress lines on stderr",
    "--remat": "activation recomputation",
    "--scale": "what-if multipliers of the chip's fields, e.g. hbm_bandwidth=2,flops=1.5",
    "--scope": "whether the collective stays inside a node or crosses nodes",
    "--seq-len": "tokens per sequence",
    "--sequence-parallel": "Megatron sequence parallelism on the tensor-parallel axes",
    "--tied-embeddings": "input and output embeddings share one matrix (default: the model's)",
    "--tokens": "training tokens, the whole run",
    "--top": "how many layouts to show",
    "--tp": "tensor-parallel degree",
    "--vocab": "vocabulary size (default: the model's)",
    "--weights": "weights' dtype",
    "--zero": "ZeRO stage over the data-parallel axes (0-3)",
}


def _mentions_default(text: str) -> bool:
    return "default" in text.lower()


def document(parser: argparse.ArgumentParser) -> None:
    """Fill in missing help texts from :data:`HELP` and append each flag's default, through every subcommand."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                document(sub)
            continue
        if not action.option_strings or action.help == argparse.SUPPRESS or action.dest == "help":
            continue
        if not action.help:
            action.help = HELP.get(action.option_strings[0], "")
        default = action.default
        shown = default is not None and default is not False and default != argparse.SUPPRESS and action.nargs != 0
        if shown and not _mentions_default(action.help):
            action.help = f"{action.help} (default {action.default})".strip()


__all__ = ["HELP", "document"]
