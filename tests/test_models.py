import pytest

from lab.core.errors import UserError
from lab.core.models import CATALOG, get_model, load_model_file, resolve_model


def narayanan_f1(layers, h, v=51200, s=2048):
    # Narayanan et al. 2021 Eq. 2 (GPT with learned positions and tied embeddings).
    return 12 * layers * h * h * (1 + 13 / (12 * h) + (v + s) / (12 * layers * h))


@pytest.mark.parametrize(
    ("name", "layers", "h"),
    [
        ("megatron-22b", 48, 6144),
        ("megatron-175b", 96, 12288),
        ("megatron-530b", 105, 20480),
        ("megatron-1t", 128, 25600),
        ("megatron-1.7b", 24, 2304),
        ("megatron-310.1b", 96, 16384),
    ],
)
def test_megatron_params_follow_f1(name, layers, h):
    # F1 omits the final LayerNorm (2h parameters); everything else must agree exactly.
    assert get_model(name).params - 2 * h == pytest.approx(narayanan_f1(layers, h), rel=1e-12)


@pytest.mark.parametrize(
    ("name", "params", "rel"),
    [
        ("llama3-70b", 70.55e9, 0.001),  # applied-training.md, recomputed from exact dims
        ("llama3-8b", 8.03e9, 0.001),
        ("llama3-405b", 405.85e9, 0.001),
        ("llama2-13b", 13.0e9, 0.005),  # training.md: 13.0e9
        ("gpt3-175b", 175e9, 0.005),
    ],
)
def test_published_parameter_counts(name, params, rel):
    assert get_model(name).params == pytest.approx(params, rel=rel)


def test_moe_active_params():
    m = get_model("mixtral-8x7b")  # Mistral's announcement: 46.7B total, 12.9B active
    assert m.params == pytest.approx(46.7e9, rel=0.005)
    assert m.active_params == pytest.approx(12.9e9, rel=0.005)


def test_kv_cache_book_numbers():
    # inference.md: LLaMA-3 70B int8 KV is 2*8*128*80 = 160 kB per token; LLaMA-2 13B bf16 about 6.7 GB for 8192 tokens.
    assert get_model("llama3-70b").kv_bytes_per_token("int8") == 2 * 8 * 128 * 80
    assert get_model("llama2-13b").kv_bytes_per_token("bf16") * 8192 == pytest.approx(6.7e9, rel=0.01)


def test_flops_conventions_match_the_papers():
    s, h, L, V = 2048, 12288, 96, 51200
    m = get_model("megatron-175b")
    f2 = 72 * L * s * h * h * (1 + s / (6 * h) + V / (12 * h * L))  # Korthikanti Eq. 7 (per sequence)
    f3 = 72 * L * s * h * h * (1 + s / (3 * h) + V / (12 * h * L))  # Eq. 8, selective recompute
    f4 = 96 * s * L * h * h * (1 + s / (6 * h) + V / (16 * L * h))  # Narayanan Eq. 3, full recompute
    assert m.flops_per_token(s, causal=False) * s == pytest.approx(f2, rel=1e-12)
    assert m.flops_per_token(s, causal=False, recompute="selective") * s == pytest.approx(f3, rel=1e-12)
    assert m.flops_per_token(s, causal=False, recompute="full") * s == pytest.approx(f4, rel=1e-12)
    assert m.flops_per_token() == 6 * m.params


def test_gqa_swiglu_causal_matches_megatron_bridge():
    # F12: 12 L h^2 [(1 + G/a + s/(2h)) + 1.5 ffn/h + V/(2 L h)] per token.
    m, s = get_model("llama3-70b"), 8192
    L, h, a, g, f, V = 80, 8192, 64, 8, 28672, 128256
    f12 = 12 * L * h * h * ((1 + g / a + s / (2 * h)) + 1.5 * f / h + V / (2 * L * h))
    assert m.flops_per_token(s) == pytest.approx(f12, rel=1e-12)


def test_custom_models_from_flags_and_files(tmp_path):
    m = resolve_model(None, {"layers": 2, "d_model": 64, "d_ff": 256, "heads": 4, "vocab": 1000})
    assert m.head_dim == 16 and m.kv_heads == 4 and m.gated_mlp
    assert m.params == 2 * (2 * 64 * 64 * 2 + 3 * 64 * 256 + 2 * 64) + 2 * 1000 * 64 + 64
    over = resolve_model("llama3-8b", {"layers": 16})
    assert over.layers == 16 and over.d_model == 4096
    f = tmp_path / "tiny.toml"
    f.write_text('name = "tiny"\nbase = "llama3-8b"\nlayers = 4\n')
    assert load_model_file(f).layers == 4 and load_model_file(f).vocab == 128256


@pytest.mark.parametrize(
    ("spec", "overrides", "match"),
    [
        ("llama9", {}, "unknown model 'llama9'"),
        (None, {}, "name a model"),
        (None, {"layers": 2, "d_model": 64}, "missing --d-ff"),
        (None, {"layers": 2, "d_model": 64, "d_ff": 8, "heads": 4, "kv_heads": 3, "vocab": 10}, "not a multiple"),
        ("llama3-8b", {"layers": 0}, "layers must be a positive integer"),
    ],
)
def test_bad_models(spec, overrides, match):
    with pytest.raises(UserError, match=match):
        resolve_model(spec, overrides)


def test_catalog_names_unique():
    names = [m.name for m in CATALOG]
    assert len(names) == len(set(names))


def test_every_catalog_model_cites_its_source_and_every_alias_names_one():
    from lab.core.models import _ALIASES

    for m in CATALOG:
        assert m.source and m.source != "user", m.name
    names = {m.name for m in CATALOG}
    assert set(_ALIASES.values()) <= names and not set(_ALIASES) & names


def test_a_bad_catalog_entry_is_refused_by_name(tmp_path, monkeypatch):
    import json

    from lab.core import models

    doc = json.loads(models.CATALOG_FILE.read_text(encoding="utf-8"))
    doc["models"][0]["heads"] = 0
    bad = tmp_path / "models.json"
    bad.write_text(json.dumps(doc), encoding="utf-8")
    monkeypatch.setattr(models, "CATALOG_FILE", bad)
    with pytest.raises(UserError, match="model 'llama3-8b': heads must be a positive integer, got 0"):
        models._load_catalog()


# Totals their publishers state (model cards, papers), against the counts from the catalog's dims: a wrong dim in
# models.json shows here (1% where the card rounds, or counts a part the lab leaves out: q/k/v biases, an MTP head).
@pytest.mark.parametrize(
    ("name", "params", "active"),
    [
        ("mistral-7b", 7.24e9, None),  # Mistral's announcement: 7.3B
        ("mixtral-8x22b", 141e9, 39e9),  # Mistral AI: 141B total, 39B active
        ("qwen2.5-72b", 72.7e9, None),  # Qwen2.5-72B model card
        ("qwen3-235b-a22b", 235e9, 22e9),  # the name and the Qwen3 model card
        ("qwen3-30b-a3b", 30.5e9, 3.3e9),
        ("gemma2-27b", 27.2e9, None),  # Gemma 2 report
        ("deepseek-v3", 671e9, 37e9),  # DeepSeek-V3 model card: 671B total, 37B activated (MTP module apart)
        ("llama1-65b", 65.2e9, None),  # LLaMA paper Table 2
        ("bloom-176b", 176.2e9, None),  # BLOOM model card
        ("nemotron4-340b", 341e9, None),  # Nemotron-4 340B model card
        ("internlm2-20b", 19.86e9, None),  # InternLM2 model card
        ("gpt-neox-20b", 20.55e9, None),  # Black et al. 2022 (GPT-NeoX-20B), 20.55B
    ],
)
def test_added_models_have_their_published_sizes(name, params, active):
    m = get_model(name)
    assert m.params == pytest.approx(params, rel=0.012)
    if active is not None:
        assert m.active_params == pytest.approx(active, rel=0.03)


@pytest.mark.parametrize(
    ("spelling", "name"),
    [
        ("meta-llama/Llama-3.1-8B-Instruct", "llama3-8b"),
        ("Llama-2-70b-chat-hf", "llama2-70b"),
        ("mistralai/Mistral-7B-v0.1", "mistral-7b"),
        ("Qwen/Qwen2.5-72B-Instruct", "qwen2.5-72b"),
        ("deepseek-ai/DeepSeek-V3", "deepseek-v3"),
        ("llama-3.3-70b", "llama3-70b"),
        ("gemma-2-9b-it", "gemma2-9b"),  # Gemma's instruction-tuned suffix
        ("mistralai/Mistral-7B-Instruct-v0.3", "mistral-7b-v0.3"),  # a variant before the version
        ("Mistral-7B-Instruct-v0.2", "mistral-7b-v0.2"),
    ],
)
def test_a_checkpoints_repository_id_or_variant_names_its_network(spelling, name):
    assert resolve_model(spelling).name == name


def test_a_name_that_differs_in_its_hyphens_alone_is_refused_with_the_model_it_resembles():
    with pytest.raises(UserError, match=r"unknown model 'llama370b' \(did you mean llama3-70b\?\)"):
        get_model("llama370b")
    with pytest.raises(UserError, match=r"unknown model 'llama9'; valid"):
        get_model("llama9")


def test_a_repository_id_keeps_its_dots_so_a_size_is_not_taken_for_another():
    # megatron-17b is no megatron-1.7b, nor llama-3-170b llama3-70b: refused, not priced as the smaller model
    for spelling in ("nvidia/megatron-17b", "x/llama-3-170b", "x/tinyllama-11b"):
        with pytest.raises(UserError, match="unknown model"):
            resolve_model(spelling)


def test_mistral_7b_keeps_its_window_in_v0_1_only_and_v0_3_its_larger_vocabulary():
    v1, v2, v3 = (get_model(n) for n in ("mistral-7b", "mistral-7b-v0.2", "mistral-7b-v0.3"))
    assert (v1.sliding_window, v2.sliding_window, v3.sliding_window) == (4096, 0, 0)
    assert v3.params - v2.params == 2 * (32768 - 32000) * 4096  # untied input and output tables grow alike
    assert v2.params == pytest.approx(7.24e9, rel=0.002)  # Mistral's 7.3B, as v0.1


def test_gpt_oss_has_its_model_cards_totals():
    # OpenAI's model card (arXiv:2508.10925): 116.8B and 20.9B in all; 5.1B and 3.6B active, a count that leaves out
    # the input embedding table (a lookup, not a matmul), which the catalog's active_params keeps
    for name, total, active in (("gpt-oss-120b", 116.8e9, 5.13e9), ("gpt-oss-20b", 20.9e9, 3.61e9)):
        m = get_model(name)
        assert m.params == pytest.approx(total, rel=0.002)
        assert m.active_params - m.vocab * m.d_model == pytest.approx(active, rel=0.01)
        assert (m.sliding_window, m.window_layers, m.global_layers) == (128, m.layers // 2, m.layers // 2)


def _brute_keys(model, positions):
    """Keys the queries at ``positions`` attend to, summed over the layers, counted one query and layer at a time."""
    whole = model.global_layers if model.sliding_window else model.layers
    return sum(whole * p + model.window_layers * min(p, model.sliding_window) for p in positions)


@pytest.mark.parametrize(
    ("start", "count"), [(0, 1), (0, 5000), (100, 1), (4095, 1), (4096, 1), (3000, 2000), (9000, 7)]
)
def test_a_window_caps_the_keys_each_query_attends_to(start, count):
    import dataclasses

    m = dataclasses.replace(get_model("llama3-8b"), sliding_window=4096, global_layers=8)
    assert m.window_layers == 24
    assert m.attended_span(start, count) == pytest.approx(_brute_keys(m, range(start + 1, start + count + 1)))
    plain = get_model("llama3-8b")  # no window: every layer attends to the whole prefix
    assert plain.attended_span(start, count) == _brute_keys(plain, range(start + 1, start + count + 1))


def test_a_window_stops_the_cache_growing_and_halves_little_below_it():
    mistral, gemma = get_model("mistral-7b"), get_model("gemma2-9b")
    per_token = mistral.kv_bytes_per_token("bf16")
    assert mistral.kv_bytes(1000) == per_token * 1000  # inside the window: every position, as before
    assert mistral.kv_bytes(32768) == mistral.kv_bytes(4096) == per_token * 4096
    # Gemma 2: 21 of 42 layers keep every position, 21 the last 4096
    assert gemma.kv_bytes(8192) == pytest.approx(gemma.kv_bytes_per_token("bf16") * (8192 + 4096) / 2)
    # causal prefill FLOPs: the mean query of an 8192-token sequence sees min(i, 4096) keys, 3072 on average
    mean_keys = _brute_keys(mistral, range(1, 8193)) / 8192 / mistral.layers
    per_key = 2.0 * (mistral.q_dim + mistral.v_dim) * mistral.layers
    assert mistral.attention_flops_per_token(8192) == pytest.approx(per_key * mean_keys, rel=1e-3)
    # shorter than the window: what LLaMA 3 8B's attention costs (the same 32 layers of 32 heads of 128)
    assert mistral.attention_flops_per_token(2048) == get_model("llama3-8b").attention_flops_per_token(2048)


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        ({"global_layers": 4}, "global-layers=4 are the layers a sliding window leaves whole, and the model has no"),
        ({"sliding_window": 512, "global_layers": 32}, "global-layers=32 leaves no windowed layer of 32; use --global"),
        ({"sliding_window": -1}, r"sliding-window must be an integer from 0 to 2\*\*30, got -1"),
        ({"sliding_window": 2**40}, r"sliding-window must be an integer from 0 to 2\*\*30, got 1099511627776"),
    ],
)
def test_a_window_that_cannot_be_is_refused_by_name(overrides, match):
    with pytest.raises(UserError, match=match):
        resolve_model("llama3-8b", overrides)
