"""Transformer accounting: a model catalog, parameter counts, FLOPs per token and KV-cache bytes.

Conventions (named in every result, since sources differ):

* ``6N``: training FLOPs = 6 x parameters x tokens, the scaling book's convention (transformers.md).
* Model FLOPs per token: every matmul counted from its shape (forward 2 x weights, backward 2x that),
  the logits included, plus attention scores ``12 * S * N * H`` per layer per token (QK^T and AV, forward
  and backward; transformers.md), halved for a causal mask unless ``causal=False``. With GPT-style
  dims this is Korthikanti et al.'s ``72 B L s h^2 (1 + s/6h + V/12hL)`` (non-causal) and the
  Megatron-Bridge GQA/SwiGLU formula (causal).
* Hardware FLOPs add what recomputation runs again: ``selective`` adds the attention-score term once
  more (Korthikanti 2022, Eq. 8: ``1 + s/3h``); ``full`` adds the whole forward pass of every layer, not
  the logits (Narayanan 2021, Eq. 3: ``96 B s l h^2 (1 + s/6h + V/16lh)``).

KV-cache bytes per token: ``2 * L * K * H * bytes`` (inference.md).
"""
# Over 500 lines on purpose: the model config and its accounting (parameters, FLOPs, KV bytes), and the catalog's
# names: the conventions are named once, for the estimators and the kernels alike.

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass
from pathlib import Path

from lab.core.errors import UserError
from lab.core.units import canonical_dtype, dtype_bytes

TYPE_CHECKING = False  # typing is not imported at run time: annotations only
if TYPE_CHECKING:
    from typing import Any

# Every integer dim of a model is at most this: about a hundred times the largest published (a 10M-token context,
# a 1M-token vocabulary), and small enough that the checks which list a dim's divisors stay instant.
MAX_DIM = 2**30


# A model's sizes: those every model has (positive integers), and the MoE and latent-attention details a model
# without them leaves at 0 (none). One table for the model's own checks, the experiment schema and the CLI's flags.
POSITIVE_DIMS = (
    "layers",
    "d_model",
    "d_ff",
    "heads",
    "kv_heads",
    "head_dim",
    "vocab",
    "experts",
    "experts_per_token",
    "max_seq_len",
)
ZERO_MEANS_NONE = (
    "shared_experts",
    "dense_layers",
    "dense_d_ff",
    "kv_lora_rank",
    "q_lora_rank",
    "rope_head_dim",
    "v_head_dim",
    "sliding_window",
    "global_layers",
)


@dataclass(frozen=True)
class ModelConfig:
    """A decoder-only Transformer, enough to count parameters, FLOPs, activations and KV bytes.

    Attributes:
        name: catalog name.
        layers, d_model, d_ff: L, D, F (F is the hidden size of one expert's MLP for MoE models).
        heads, kv_heads, head_dim: N, K, H (grouped-query attention when K < N).
        vocab: V.
        tied_embeddings: input and output embeddings share one matrix.
        gated_mlp: SwiGLU-style MLP with three matrices (LLaMA); False for a two-matrix GeLU MLP (GPT).
        experts, experts_per_token: E and k for mixture-of-experts MLPs (1 and 1 when dense).
        shared_experts: experts every token goes through besides its k routed ones (DeepSeekMoE, Qwen-MoE),
            each ``d_ff`` wide, sharded like a dense MLP (not over the expert axis).
        dense_layers: leading layers with a dense MLP instead of experts (MoE models only).
        dense_d_ff: that dense MLP's width; 0 means ``d_ff x (experts_per_token + shared_experts)``, the width of
            what one token goes through in an expert layer.
        kv_lora_rank: multi-head latent attention (DeepSeek-V2, arXiv:2405.04434) when > 0: K and V come up from
            a latent of this width, which is all the KV cache keeps (with the shared RoPE key). ``head_dim`` is
            then the query/key head width without RoPE.
        q_lora_rank: MLA's query latent width (0: a full-rank query projection).
        rope_head_dim: MLA's decoupled RoPE width per query head (and of the one shared RoPE key).
        v_head_dim: MLA's value head width (0: ``head_dim``).
        sliding_window: a windowed layer's query attends to the last ``sliding_window`` positions only, and its KV
            cache keeps no more (Mistral 7B v0.1, Gemma 2 and 3, gpt-oss); 0: every layer attends to the whole context.
        global_layers: with a window, the layers that still attend to the whole context (Gemma 2 and gpt-oss
            alternate: half; Gemma 3: one in six); 0: every layer is windowed. Counted, not placed: the totals
            (FLOPs, cache bytes) do not depend on which layers they are.
        parallel_block: attention and the MLP read the same input and their outputs are summed into the residual
            at once (GPT-J, GPT-NeoX, Falcon, PaLM): under tensor parallelism a layer sums one partial output, not
            two (:attr:`tp_reductions_per_layer`). The lab's Transformer runs the sequential block only.
        learned_positions: a learned position embedding of ``max_seq_len x D`` (GPT); False for RoPE.
        biases: linear layers carry biases (GPT/Megatron); LLaMA has none.
        norm: ``layernorm`` (weight and bias) or ``rmsnorm`` (weight only).
        dropout: attention and residual dropout (adds 1-byte masks to activation memory).
        max_seq_len: context the model was trained for.
        rope_theta: base of the rotary frequencies (RoPE models).
        norm_eps: epsilon of the norms.
        source: where the dims come from.
    """

    name: str
    layers: int
    d_model: int
    d_ff: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied_embeddings: bool = False
    gated_mlp: bool = True
    experts: int = 1
    experts_per_token: int = 1
    shared_experts: int = 0
    dense_layers: int = 0
    dense_d_ff: int = 0
    kv_lora_rank: int = 0
    q_lora_rank: int = 0
    rope_head_dim: int = 0
    v_head_dim: int = 0
    sliding_window: int = 0
    global_layers: int = 0
    parallel_block: bool = False
    learned_positions: bool = False
    biases: bool = False
    norm: str = "rmsnorm"
    dropout: bool = False
    max_seq_len: int = 8192
    rope_theta: float = 10000.0
    norm_eps: float = 1e-6
    source: str = "user"

    def __post_init__(self) -> None:
        where = f"model {self.name!r}"
        for f in POSITIVE_DIMS:
            v = getattr(self, f)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise UserError(f"{where}: {f.replace('_', '-')} must be a positive integer, got {v!r}")
            if v > MAX_DIM:
                raise UserError(
                    f"{where}: {f.replace('_', '-')}={v} is beyond any model (at most 2**30 = {MAX_DIM}); "
                    "check the value"
                )
        if self.heads % self.kv_heads:
            raise UserError(
                f"{where}: heads={self.heads} is not a multiple of kv-heads={self.kv_heads}; "
                f"use a divisor of {self.heads}"
            )
        if self.experts_per_token > self.experts:
            raise UserError(f"{where}: experts-per-token={self.experts_per_token} exceeds experts={self.experts}")
        for f in ZERO_MEANS_NONE:
            v = getattr(self, f)
            if not isinstance(v, int) or isinstance(v, bool) or not 0 <= v <= MAX_DIM:
                raise UserError(f"{where}: {f.replace('_', '-')} must be an integer from 0 to 2**30, got {v!r}")
        if (self.shared_experts or self.dense_layers or self.dense_d_ff) and self.experts == 1:
            raise UserError(f"{where}: shared experts and dense layers belong to a mixture of experts; set --experts")
        if (self.q_lora_rank or self.rope_head_dim or self.v_head_dim) and not self.kv_lora_rank:
            raise UserError(
                f"{where}: q-lora-rank, rope-head-dim and v-head-dim belong to latent attention; set --kv-lora-rank"
            )
        if self.dense_d_ff and not self.dense_layers:
            raise UserError(
                f"{where}: dense-d-ff={self.dense_d_ff} is the width of the dense layers' MLP, and the model has none; "
                "set --dense-layers N, or drop it"
            )
        if self.rope_head_dim % 2:
            raise UserError(
                f"{where}: rope-head-dim={self.rope_head_dim} must be even (rotary embedding turns pairs of "
                f"dims); use {self.rope_head_dim + 1}"
            )
        if not self.learned_positions and not self.is_mla and self.head_dim % 2:
            raise UserError(
                f"{where}: head-dim={self.head_dim} must be even for rotary embedding (it turns pairs of dims); use "
                f"{self.head_dim + 1}"
            )
        if self.global_layers and not self.sliding_window:
            raise UserError(
                f"{where}: global-layers={self.global_layers} are the layers a sliding window leaves whole, and the "
                "model has no window; set --sliding-window N, or --global-layers 0"
            )
        if self.sliding_window and self.global_layers >= self.layers:
            raise UserError(
                f"{where}: global-layers={self.global_layers} leaves no windowed layer of {self.layers}; "
                f"use --global-layers {self.layers - 1} at most, or --sliding-window 0 --global-layers 0"
            )
        if self.dense_layers >= self.layers:
            raise UserError(
                f"{where}: dense-layers={self.dense_layers} leaves no expert layer of {self.layers}; "
                f"use at most {self.layers - 1}"
            )
        for f in ("rope_theta", "norm_eps"):
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, int | float) or not 0 < v < float("inf"):
                raise UserError(f"{where}: {f.replace('_', '-')} must be a positive number, got {v!r}")
        for f in ("tied_embeddings", "gated_mlp", "learned_positions", "biases", "dropout"):
            if not isinstance(getattr(self, f), bool):
                raise UserError(f"{where}: {f.replace('_', '-')} must be true or false, got {getattr(self, f)!r}")
        for f in ("name", "source"):
            if not isinstance(getattr(self, f), str):
                raise UserError(f"{where}: {f} must be a string, got {getattr(self, f)!r}")
        if self.norm not in ("layernorm", "rmsnorm"):
            raise UserError(f"{where}: norm {self.norm!r} is not one of layernorm, rmsnorm")

    @property
    def is_moe(self) -> bool:
        return self.experts > 1

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank > 0

    @property
    def window_layers(self) -> int:
        """Layers that attend to the last ``sliding_window`` positions only (0 without a window)."""
        return self.layers - self.global_layers if self.sliding_window else 0

    def attended(self, context: float, causal: bool = False) -> float:
        """Keys one query attends to, summed over the layers, at ``context`` tokens: every cached position of a
        full-attention layer and at most ``sliding_window`` of a windowed one. ``causal``: the mean over a causal
        sequence's queries (half the context; a windowed layer's ``W - W^2 / 2S`` once the sequence passes W).
        Without ``causal`` it is also the positions the layers' KV caches keep (:meth:`kv_bytes`)."""
        full = context / 2 if causal else context
        n = self.window_layers
        if not n:
            return self.layers * full
        w = self.sliding_window
        beyond = w - w * w / (2.0 * context) if causal else float(w)  # past the window: at most W keys a query
        windowed = full if context <= w else beyond
        return (self.layers - n) * full + n * windowed

    def attended_span(self, start: int, count: int) -> float:
        """Keys the queries at positions ``start + 1 .. start + count`` attend to (each its own causal prefix),
        summed over the queries and the layers: a chunk of a prompt, or one decode step's token (count 1)."""
        full = count * start + count * (count + 1) / 2
        n = self.window_layers
        if not n:
            return self.layers * full
        w, end = self.sliding_window, start + count
        lo, hi = min(start, w), min(end, w)
        windowed = (hi * (hi + 1) - lo * (lo + 1)) / 2 + (end - max(start, w)) * w * (end > w)
        return (self.layers - n) * full + n * windowed

    @property
    def q_dim(self) -> int:
        """N x H, the width of the query projection (with MLA's RoPE part: N x (H + R))."""
        return self.heads * (self.head_dim + self.rope_head_dim)

    @property
    def kv_dim(self) -> int:
        """K H, the width of K (and of V) per token; with MLA, the width K and V come up to, N x H."""
        return self.kv_heads * self.head_dim

    @property
    def v_dim(self) -> int:
        """The width of the attention output: N x H, or N x MLA's value head width."""
        return self.heads * (self.v_head_dim or self.head_dim)

    @property
    def kv_cache_width(self) -> int:
        """Elements the KV cache keeps per token and layer: K and V (2 K H), or MLA's latent and RoPE key."""
        return self.kv_lora_rank + self.rope_head_dim if self.is_mla else 2 * self.kv_dim

    @property
    def attention_matmul_params(self) -> int:
        """The attention projections' weights (what a token multiplies by, twice its forward FLOPs)."""
        d = self.d_model
        if not self.is_mla:
            return 2 * d * self.q_dim + 2 * d * self.kv_dim
        q = d * self.q_lora_rank + self.q_lora_rank * self.q_dim if self.q_lora_rank else d * self.q_dim
        kv = d * (self.kv_lora_rank + self.rope_head_dim) + self.kv_lora_rank * (self.kv_dim + self.v_dim)
        return q + kv + self.v_dim * d

    @property
    def mlp_matrices(self) -> int:
        return 3 if self.gated_mlp else 2

    # ----- parameters -----------------------------------------------------------------------

    @property
    def attention_params_per_layer(self) -> int:
        """Q and O: D x NH each; K and V: D x KH each (transformers.md: 2D(N+K)H)."""
        p = self.attention_matmul_params + (self.q_lora_rank + self.kv_lora_rank)  # MLA's latent norms
        if self.biases:
            p += self.q_dim + 2 * self.kv_dim + self.d_model
        return p

    @property
    def expert_params(self) -> int:
        """One expert's MLP."""
        p = self.mlp_matrices * self.d_model * self.d_ff
        if self.biases:
            p += (self.mlp_matrices - 1) * self.d_ff + self.d_model
        return p

    @property
    def norm_params_per_layer(self) -> int:
        return 2 * self.d_model * (2 if self.norm == "layernorm" else 1)

    @property
    def tp_reductions_per_layer(self) -> int:
        """Partial outputs a layer sums over a tensor-parallel group in its forward pass (its row-parallel matmuls'):
        attention's and the MLP's, or one sum of both in a parallel block; its backward sums as many input
        gradients."""
        return 1 if self.parallel_block else 2

    @property
    def router_params_per_layer(self) -> int:
        return self.d_model * self.experts if self.is_moe else 0

    @property
    def dense_ff(self) -> int:
        """The dense MLP width of the leading dense layers of an MoE model."""
        return self.dense_d_ff or self.d_ff * (self.experts_per_token + self.shared_experts)

    @property
    def moe_layers(self) -> int:
        """Layers whose MLP is a mixture of experts (all of them, less the leading dense ones)."""
        return self.layers - self.dense_layers if self.is_moe else 0

    def _mlp_params(self, width: int) -> int:
        p = self.mlp_matrices * self.d_model * width
        if self.biases:
            p += (self.mlp_matrices - 1) * width + self.d_model
        return p

    @property
    def layer_params(self) -> float:
        """Parameters of one layer, averaged over the layers (expert layers and any leading dense ones)."""
        base = self.attention_params_per_layer + self.norm_params_per_layer
        if not self.dense_layers:
            return base + (self.experts + self.shared_experts) * self.expert_params + self.router_params_per_layer
        moe = (self.experts + self.shared_experts) * self.expert_params + self.router_params_per_layer
        dense = self._mlp_params(self.dense_ff)
        return base + (self.moe_layers * moe + self.dense_layers * dense) / self.layers

    @property
    def embedding_params(self) -> int:
        """Input and output embeddings (one matrix when tied), learned positions, the final norm."""
        p = self.vocab * self.d_model * (1 if self.tied_embeddings else 2)
        if self.learned_positions:
            p += self.max_seq_len * self.d_model
        return p + self.d_model * (2 if self.norm == "layernorm" else 1)

    @property
    def params(self) -> int:
        """Total parameter count."""
        return round(self.layers * self.layer_params) + self.embedding_params

    @property
    def active_params(self) -> int:
        """Parameters one token touches: k of the E routed experts (and the shared ones)."""
        inactive = (self.experts - self.experts_per_token) * self.expert_params
        return self.params - (self.moe_layers if self.is_moe else self.layers) * inactive

    @property
    def expert_params_total(self) -> int:
        """Parameters that live in routed experts (sharded by expert parallelism); 0 for dense models."""
        return self.moe_layers * self.experts * self.expert_params if self.is_moe else 0

    # ----- FLOPs ----------------------------------------------------------------------------

    def matmul_flops_per_token(self, include_logits: bool = True) -> float:
        """Forward matmul FLOPs per token: 2 x (weights one token multiplies by)."""
        per_layer = 2 * self.attention_matmul_params
        moe = 2 * (self.experts_per_token + self.shared_experts) * self.mlp_matrices * self.d_model * self.d_ff
        moe += 2 * self.router_params_per_layer
        dense = 2 * self.mlp_matrices * self.d_model * self.dense_ff
        f = self.layers * per_layer + (self.layers - self.dense_layers) * moe + self.dense_layers * dense
        if include_logits:
            f += 2 * self.d_model * self.vocab
        return float(f)

    def attention_flops_per_token(self, seq_len: int, causal: bool = True, windowed: bool = True) -> float:
        """Forward attention-score FLOPs per token: QK^T and AV over ``seq_len`` keys (4 S N H per layer; with MLA
        2 S N (H + R) + 2 S N Hv), a windowed layer's over at most ``sliding_window`` (:meth:`attended`); not
        ``windowed``: every score computed and the window masked, as unfused attention does."""
        if self.window_layers and windowed:
            return 2.0 * (self.q_dim + self.v_dim) * self.attended(seq_len, causal)
        f = self.layers * 2.0 * seq_len * (self.q_dim + self.v_dim)
        return f / 2 if causal else f

    def flops_per_token(self, seq_len: int | None = None, *, causal: bool = True, recompute: str = "none") -> float:
        """Training FLOPs per token (forward + backward = 3x forward).

        Without ``seq_len`` this is the book's ``6N`` (N = active parameters). With it: matmuls from
        their shapes plus attention (causal halving unless ``causal=False``). ``recompute`` adds what
        activation recomputation runs again (hardware FLOPs): ``selective`` or ``full``.
        """
        if seq_len is None:
            if recompute != "none":
                raise UserError("hardware FLOPs with recomputation need --seq-len")
            return 6.0 * self.active_params
        mm = self.matmul_flops_per_token(include_logits=False)
        att = self.attention_flops_per_token(seq_len, causal)
        logits = 2.0 * self.d_model * self.vocab
        f = 3 * (mm + att + logits)
        if recompute == "selective":
            f += 3 * att  # Korthikanti Eq. 8 counts the attention-score term once more
        elif recompute == "full":
            f += mm + att  # the forward pass of every layer again; logits are not recomputed
        elif recompute != "none":
            raise UserError(f"unknown recompute {recompute!r}; valid: none, selective, full")
        return f

    def kv_bytes_per_token(self, dtype: str = "bf16") -> float:
        """K and V for every layer: 2 L K H x bytes (MLA: its latent and RoPE key, L (C + R) x bytes). A cache that
        keeps every position on every layer (a paged pool's pages); :meth:`kv_bytes` is what a window leaves."""
        return float(self.layers * self.kv_cache_width) * dtype_bytes(dtype)

    def kv_bytes(self, context: float, dtype: str = "bf16") -> float:
        """One sequence's KV cache at ``context`` tokens: a windowed layer keeps its last ``sliding_window`` only."""
        if not self.window_layers:
            return self.kv_bytes_per_token(dtype) * context
        return self.attended(context) * self.kv_cache_width * dtype_bytes(dtype)

    def to_dict(self, seq_len: int | None = None, kv_dtype: str = "bf16") -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d.update(
            params=self.params,
            active_params=self.active_params,
            kv_bytes_per_token=self.kv_bytes_per_token(kv_dtype),
            kv_dtype=canonical_dtype(kv_dtype),
            flops_per_token=self.flops_per_token(seq_len),
            seq_len=seq_len,
            flops_convention="6N (book)"
            if seq_len is None
            else "matmuls from shapes + causal attention, forward+backward",
        )
        return d


# The built-in catalog: cited data in lab/core/data/models.json (one entry a model, its source beside its dims), read
# through the loader a user's model file goes through (model_from_fields), so the same checks hold it.
CATALOG_FILE = Path(__file__).parent / "data" / "models.json"


def _load_catalog() -> tuple[tuple[ModelConfig, ...], dict[str, str]]:
    import json

    doc = json.loads(CATALOG_FILE.read_text(encoding="utf-8"))
    models = tuple(model_from_fields(m, f"{CATALOG_FILE.name} model #{i}") for i, m in enumerate(doc["models"], 1))
    return models, dict(doc["aliases"])


def get_model(name: str) -> ModelConfig:
    """A catalog model by name (case-insensitive; ``llama-3-70b`` and similar spellings work)."""
    key = str(name).strip().lower().replace("_", "-")
    key = _ALIASES.get(key, key)
    for m in CATALOG:
        if m.name == key:
            return m
    close = _resembles(key)
    if close and ("/" in key or _variant(key)):  # a checkpoint's repository id or variant: the same network
        return get_model(close)
    hint = f" (did you mean {close}?)" if close else ""
    raise UserError(
        f"unknown model {name!r}{hint}; valid: {', '.join(m.name for m in CATALOG)} "
        f"(or a .toml file, or --layers/--d-model/... flags)"
    )


_VARIANTS = ("-hf", "-instruct", "-chat", "-base", "-it")  # a checkpoint's variants of one network (-it: Gemma's)


def _variant(key: str) -> bool:
    """A variant suffix, at the end or before a version (``mistral-7b-instruct-v0.3``)."""
    return key.endswith(_VARIANTS) or any(v + "-" in key for v in _VARIANTS)


def _resembles(key: str) -> str | None:
    """The catalog model a name differs from only in spelling: a Hugging Face repository's organisation, a variant
    suffix (-hf, -instruct, -chat, -base, -it; also before a version, ``-instruct-v0.3``) and the placement of
    hyphens and dots (``meta-llama/Llama-3.1-8B-Instruct`` is llama3-8b). A repository id or a variant is taken as
    that model (the same network); a name that differs in its hyphens alone is refused with it named, as a chip's is
    (a typo may mean another model)."""

    def squash(text: str) -> str:
        text = text.rsplit("/", 1)[-1].removeprefix("meta-")
        for v in _VARIANTS:  # a variant before a version: Mistral-7B-Instruct-v0.3 is Mistral-7B-v0.3
            text = text.replace(v + "-", "-")
        while text.endswith(_VARIANTS):  # -chat-hf, -instruct-hf: every variant suffix, in any order
            text = text.removesuffix(next(v for v in _VARIANTS if text.endswith(v)))
        return "".join(ch for ch in text if ch.isalnum() or ch == ".")  # a dot keeps sizes apart (1.7b is not 17b)

    want = squash(key)
    for name in (*(m.name for m in CATALOG), *_ALIASES):
        if squash(name) == want:
            return _ALIASES.get(name, name)
    return None


def load_model_file(path: str | os.PathLike) -> ModelConfig:
    """A model from TOML: the ModelConfig fields, optionally ``base = "<catalog model>"`` to inherit."""
    import tomllib  # only here: importing it costs every command a few ms at start-up otherwise

    p = Path(path)
    if not p.is_file():
        raise UserError(f"model file {str(p)!r} does not exist")
    try:
        doc = tomllib.loads(p.read_bytes().decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise UserError(f"model file {str(p)!r} is not UTF-8 text (byte {exc.start}); save it as UTF-8") from None
    except OSError as exc:
        raise UserError(f"cannot read model file {str(p)!r}: {exc.strerror}") from None
    except (tomllib.TOMLDecodeError, RecursionError) as exc:
        reason = "nested too deeply" if isinstance(exc, RecursionError) else str(exc)
        raise UserError(f"model file {str(p)!r} is not valid TOML: {reason}") from None
    return model_from_fields(doc, where=str(p))


def _is_pos_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 1


def model_from_fields(fields: dict[str, Any], where: str = "model") -> ModelConfig:
    """Build a model from field values; ``base`` names a catalog model to start from.

    Without ``head_dim``, it is ``d_model / heads``, which must be whole: a ``d_model`` that ``heads`` does not
    divide is refused (give ``head_dim`` explicitly for models whose heads are not ``d_model / heads`` wide).
    """
    data = {k.replace("-", "_"): v for k, v in fields.items() if v is not None}
    known = {f.name for f in dataclasses.fields(ModelConfig)}
    base = data.pop("base", None)
    unknown = sorted(set(data) - known)
    if unknown:
        raise UserError(f"{where}: unknown field {unknown[0]!r}; valid: {', '.join(sorted(known))}")
    if base is not None:
        data = dataclasses.asdict(get_model(base)) | {"source": where} | data
    data.setdefault("name", "custom")
    if "head_dim" not in data and "d_model" in data and "heads" in data:
        d, n = data["d_model"], data["heads"]
        if _is_pos_int(d) and _is_pos_int(n):  # anything else is refused by ModelConfig with its name
            if d % n:
                close = [k for k in range(max(1, n - 64), n + 65) if d % k == 0]  # bounded: n may be huge
                near = min(close, key=lambda k: (abs(k - n), k)) if close else math.gcd(d, n)
                raise UserError(
                    f"{where}: d-model={d} is not a multiple of heads={n}, so head-dim = d-model / heads is not "
                    f"whole; give --head-dim explicitly (head_dim in a file), or use heads={near}"
                )
            data["head_dim"] = d // n
    data.setdefault("kv_heads", data.get("heads"))
    missing = [
        f.name for f in dataclasses.fields(ModelConfig) if f.default is dataclasses.MISSING and f.name not in data
    ]
    if missing:
        raise UserError(
            f"{where}: missing {', '.join('--' + m.replace('_', '-') for m in missing)} "
            f"(or start from a catalog model with --model NAME)"
        )
    return ModelConfig(**data)


def resolve_model(spec: str | None, overrides: dict[str, Any] | None = None) -> ModelConfig:
    """A catalog name, a ``.toml`` path, or flags alone; flags override the named model's fields."""
    overrides = {k: v for k, v in (overrides or {}).items() if v is not None}
    if spec is None:
        if not overrides:
            raise UserError(
                "name a model (--model llama3-8b) or give its dims (--layers --d-model --d-ff --heads --vocab)"
            )
        return model_from_fields(overrides, where="flags")
    # a path: a .toml name, or one with a separator that is there (a Hugging Face repository id is a name)
    is_file = spec.endswith(".toml") or (os.path.sep in spec and Path(spec).exists())
    model = load_model_file(spec) if is_file else get_model(spec)
    if overrides:
        model = ModelConfig(**(dataclasses.asdict(model) | {"name": f"{model.name}+flags"} | overrides))
    return model


CATALOG, _ALIASES = _load_catalog()

__all__ = ["CATALOG", "ModelConfig", "get_model", "load_model_file", "resolve_model"]
