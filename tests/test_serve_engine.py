"""The executed serving engine (lab.run.serve over kernels.transformer.paged): greedy tokens equal the plain decode's
under chunked prefill, preemption and mixed steps, on one device and under TP=2 x DP=2; pages hold what they should."""

import random

import jax
import numpy as np
import pytest

from kernels.transformer.decode import prefill
from kernels.transformer.model import TINY
from lab.core.errors import UserError
from lab.core.rules import PRESETS
from lab.core.serving import PoolConfig, Request, Seq, Step, Work
from lab.run.serve import Engine, reference_greedy, serve

# 14 pages of 4 tokens per replica: a 40-token prompt takes 10, so sequences preempt each other; a 16-token budget
# chunks every prompt longer than that.
POOL = PoolConfig(pages=14, page_size=4, max_seqs=6, token_budget=16)
MESHES = {"one_device": None, "data2_model2": {"data": 2, "model": 2}}


def _load(n=16, seed=0):
    rng = random.Random(seed)
    reqs = [Request(i, 0.0, rng.randint(3, 40), rng.randint(1, 12)) for i in range(n)]
    prompts = {r.rid: [rng.randrange(TINY.vocab) for _ in range(r.prompt_len)] for r in reqs}
    return reqs, prompts


def _engine(mesh_axes, pool):
    from kernels.mesh import make_mesh

    mesh = make_mesh(mesh_axes) if mesh_axes else None
    return Engine(TINY, mesh, PRESETS["tp"], pool, dtype="float32", seed=0)


@pytest.fixture(scope="module", params=list(MESHES))
def engine(request, jax_devices):
    return _engine(MESHES[request.param], POOL)


def test_engine_generates_the_reference_greedy_tokens(engine, monkeypatch):
    reqs, prompts = _load()
    plans = []
    run = engine.run
    monkeypatch.setattr(engine, "run", lambda plan: (plans.append(plan), run(plan))[1])  # what the scheduler asked
    served = serve(engine, reqs, prompts)
    assert served.preemptions > 0
    works = [w for plan in plans for step in plan for w in step.work]
    assert any(w.start > 0 and w.count > 1 for w in works)  # a prompt's later chunk: prefill was chunked
    mixed = [s for p in plans for s in p if any(w.count == 1 for w in s.work) and any(w.count > 1 for w in s.work)]
    assert mixed  # a prefill chunk and decodes of other sequences in one step
    assert sorted(s.req.rid for s in served.seqs) == [r.rid for r in reqs]
    for s in served.seqs:
        got = s.tokens[s.req.prompt_len :]
        assert got == reference_greedy(engine, prompts[s.req.rid], s.req.output_len), s.req


def test_serve_refuses_prompts_that_do_not_match_their_requests(engine):
    req = Request(0, 0.0, 4, 2)
    with pytest.raises(UserError, match="prompt_len 4 but 3 ids"):
        serve(engine, [req], {0: [1, 2, 3]})
    with pytest.raises(UserError, match="in \\[0, 88\\)"):
        serve(engine, [req], {0: [1, 2, 3, 88]})
    with pytest.raises(UserError, match="max_seq_len 64"):
        serve(engine, [Request(0, 0.0, 60, 6)], {0: [1] * 60})


def _seq(rid, tokens, pages, slot):
    return Seq(Request(rid, 0.0, len(tokens), 1), list(tokens), known=len(tokens), pages=list(pages), slot=slot)


@pytest.mark.parametrize("mesh", list(MESHES))
def test_each_token_lands_in_its_page_at_its_offset(mesh, jax_devices):
    """Replica r's sequence of 6 tokens with the page table [4, 1] fills page 4 and half of page 1 with the k, v
    that the plain prefill caches; padding slots and the other pages stay zero; the sample is the prefill's."""
    eng = _engine(MESHES[mesh], PoolConfig(pages=6, page_size=4, max_seqs=3, token_budget=8))
    rng = np.random.default_rng(1)
    seqs = [_seq(r, rng.integers(0, TINY.vocab, 6), [4, 1] if r == 0 else [2, 5], 2 - r) for r in range(eng.replicas)]
    _, sampled = eng.run([Step((Work(s, 0, 6, True),)) for s in seqs])
    params = jax.device_get(eng.params)
    kv = jax.device_get(eng.kv)
    for r, s in enumerate(seqs):
        logits, cache = prefill(params, np.asarray([s.tokens]), TINY)
        assert sampled[s.req.rid] == int(np.argmax(logits[0, -1]))
        for name in ("k", "v"):
            pool = kv[name][:, r]  # [L, P, Z, K, H]
            want = np.zeros_like(pool)
            want[:, s.pages[0]] = cache[name][:, 0, 0:4]
            want[:, s.pages[1], 0:2] = cache[name][:, 0, 4:6]
            np.testing.assert_allclose(pool, want, rtol=1e-5, atol=1e-6)
    # a decode at position 6 goes to the second page's offset 2, nowhere else
    before = jax.device_get(eng.kv)["k"]
    for s in seqs:
        s.tokens.append(3)
    eng.run([Step((Work(s, 6, 1, True),)) for s in seqs])
    after = jax.device_get(eng.kv)["k"]
    changed = np.argwhere(np.any(after != before, axis=(0, 4, 5)))  # (replica, page, offset)
    assert changed.tolist() == [[r, s.pages[1], 2] for r, s in enumerate(seqs)]


def test_a_serve_run_reports_measured_beside_predicted_for_every_request(tmp_path):
    """shardlab run experiments/serve_tp.toml: the profiled step audits whole, and report.json's serving section
    holds the engine's percentiles beside the simulator's for the same requests (timings are not judged here:
    scripts/bench_serve compares them over repeated runs)."""
    import json
    from pathlib import Path

    from lab.run.pipeline import run_experiment

    exp = Path(__file__).resolve().parent.parent / "experiments" / "serve_tp.toml"
    result = run_experiment(str(exp), str(tmp_path), quiet=True, hardware="cpu", overrides={"warmup": 1, "repeats": 1})
    report = json.loads((result.run_dir / "report.json").read_text())
    assert report["audit"]["all_match"]
    serving = report["serving"]
    for side in ("measured", "predicted"):
        s = serving[side]
        assert s["requests"] == 64 and s["steps"] > 64
        for key in ("ttft_s", "tpot_s", "e2e_s"):
            assert 0 < s[key]["p50"] <= s[key]["p90"] <= s[key]["p99"]
    assert [r["rid"] for r in serving["requests"]] == list(range(64))
    # every step of the prediction costs the estimate of the step plus the host's measured work per step
    step = serving["step_s"]
    assert step["predicted"] == pytest.approx(step["estimated_device"] + step["host_overhead"])
    assert step["estimated_device"] == pytest.approx(report["step_time_estimated_s"])
    text = (result.run_dir / "report.md").read_text()
    assert "## Serving under load: measured | predicted" in text and "**emulated**" in text
    assert (result.run_dir / "serving.png").stat().st_size > 10_000
