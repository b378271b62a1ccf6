"""plan --validate K: the planner's best executable layouts compiled (and run) against its ranking."""

import json
from types import SimpleNamespace

import pytest

from lab.cli.main import main
from lab.run.plan_validate import kendall, spearman

SMALL = [
    "plan", "--model", "llama3-8b", "--layers", "1", "--d-model", "128", "--heads", "4", "--kv-heads", "2",
    "--head-dim", "32", "--d-ff", "512", "--vocab", "1024", "--chips", "8", "--batch-tokens", "4096",
    "--seq-len", "128",
]  # fmt: skip


def test_rank_correlations_on_hand_made_rankings():
    assert spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    assert kendall([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    # one swapped pair of six: tau = (5 - 1) / 6
    assert kendall([1, 2, 3, 4], [1, 2, 4, 3]) == pytest.approx(4 / 6)
    # ranks 1, 2, 3, 4 against 1, 2, 4, 3: rho = 1 - 6 * 2 / (4 * 15)
    assert spearman([1, 2, 3, 4], [1, 2, 4, 3]) == pytest.approx(0.8)
    assert spearman([1.0], [2.0]) is None and kendall([1.0], [2.0]) is None


# Run on this host, a quarter of SMALL's batch: 8 measured steps a layout, 2.3x faster to profile than at 4,096
HOST = [*SMALL[:-4], "--batch-tokens", "1024", "--seq-len", "128"]


def test_the_best_layouts_compile_and_run_on_this_host(tmp_path, capsys):
    # the ranking's data, not a steady median: one untraced call and two profiled ones a layout (--warmup, --repeats)
    calls = ["--warmup", "1", "--repeats", "2"]
    assert main([*HOST, "--hardware", "cpu", "--validate", "2", *calls, "--out", str(tmp_path), "--json"]) == 0
    d = json.loads(capsys.readouterr().out)["validation"]
    for i in (1, 2):
        summary = json.loads((tmp_path / f"validate-{i}" / "report.json").read_text())["summary"]
        assert (summary["warmup"], summary["repeats"]) == (1, 2)
    assert len(d["layouts"]) == 2 and d["compiled_for"] is None
    for r in d["layouts"]:
        assert r["measured_step_s"] > 0 and r["compiled_memory_bytes"] > 0 and r["planner_fits"] is True
        assert {r["predicted_rank"], r["measured_rank"]} <= {1, 2}
    assert d["memory_agrees"] is True and d["spearman"] in (-1.0, 1.0) and d["kendall"] in (-1.0, 1.0)
    est = [r["planner_step_s"] for r in d["layouts"]]
    assert est == sorted(est)  # the planner's order


def test_the_help_states_the_calls_validate_makes(capsys):
    from lab.run.plan_validate import CALLS

    with pytest.raises(SystemExit):
        main(["plan", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert f"profiled ones (default {CALLS['warmup']})" in text
    assert f"profiled calls of each layout's step (default {CALLS['repeats']})" in text


@pytest.mark.parametrize(
    ("extra", "needle"),
    [
        (["--repeats", "2"], "--warmup and --repeats belong to --validate K"),
        (["--warmup", "0"], "--warmup and --repeats belong to --validate K"),
        (["--validate", "1", "--target", "v5e:2x4", "--repeats", "2"], "--repeats time the layouts run on this host"),
    ],
)
def test_calls_without_a_run_on_this_host_are_refused(capsys, extra, needle):
    assert main([*SMALL, "--hardware", "tpu-v5e", *extra]) == 2
    out, err = capsys.readouterr()
    assert out == "" and len(err.strip().splitlines()) == 1 and needle in err, err


def test_a_model_the_lab_cannot_run_is_refused_by_what_it_lacks_before_any_layout_runs(capsys):
    # a 64-token window: the planner prices it, the lab's Transformer does not build it
    assert main([*SMALL, "--hardware", "cpu", "--sliding-window", "64", "--validate", "1"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and len(err.strip().splitlines()) == 1
    assert "does not build what llama3-8b+flags has (a 64-token sliding attention window); drop --validate" in err


@pytest.mark.slow  # 18 s of libtpu from a fresh clone; the next test validates with --target by default
def test_the_best_layouts_cross_compiled_for_a_tpu(capsys):
    assert main([*SMALL, "--hardware", "tpu-v5e", "--validate", "2", "--target", "v5e:2x4", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)["validation"]
    assert d["compiled_for"] == "v5e:2x4" and d["spearman"] is None
    assert all(r["measured_step_s"] is None and r["compiled_memory_bytes"] > 0 for r in d["layouts"])
    assert d["memory_agrees"] is True


# At 1,024 tokens a sequence the planner ranks a context-parallel layout first (its activations split over cp).
LONG = [*SMALL[:-2], "--seq-len", "1024"]


@pytest.mark.slow  # 17 s of v5e compiles; the default suite keeps test_the_best_layouts_compile_and_run_on_this_host
def test_context_parallel_layouts_are_validated_not_skipped(capsys):
    """The planner's best layout here splits the sequence (cp=2); it used to be passed over for a worse one."""
    assert main([*LONG, "--hardware", "tpu-v5e", "--validate", "1", "--target", "v5e:2x4", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    top = out["top"][0]["layout"]
    assert (top["fsdp"], top["cp"], top["pp"], top["zero"]) == (4, 2, 1, 0)
    (r,) = out["validation"]["layouts"]
    assert r["layout"] == "fsdp=4 cp=2, remat none" and r["compiled_memory_bytes"] > 0 and r["compiled_fits"]


def _estimates(chip_name: str):
    """Hand-made planner results for a 2-layer model on 8 chips: a 1F1B pipeline over data parallelism, a pipeline
    with context parallelism (which the lab does not run), ZeRO-1, plain FSDP, and a pipeline over FSDP (which the
    lab runs, but gathering each stage's weights once a step, not as priced), in that order."""
    import dataclasses

    from lab.core.hardware import get_chip
    from lab.core.models import get_model
    from lab.predict.training.config import Layout, TrainConfig
    from lab.predict.training.estimate import estimate

    model = dataclasses.replace(
        get_model("llama3-8b"), layers=2, d_model=128, heads=4, kv_heads=2, head_dim=32, d_ff=512, vocab=1024
    )
    chip = get_chip(chip_name)

    def est(microbatch, **layout):
        cfg = TrainConfig(
            model=model, chip=chip, layout=Layout(**layout), seq_len=128, global_batch=32, microbatch=microbatch,
            remat="none", dtype="bf16",
        )  # fmt: skip
        return estimate(cfg)

    top = [est(2, pp=2, dp=4), est(2, pp=2, cp=2, dp=2), est(4, dp=8, zero=1), est(4, fsdp=8), est(2, pp=2, fsdp=4)]
    return model, chip, top


def test_a_pipeline_is_built_and_priced_with_the_schedule_the_lab_runs():
    from lab.run.plan_validate import as_run, candidates

    model, chip, top = _estimates("tpu-v5e")
    chosen = candidates(SimpleNamespace(top=top), 3, model, "bfloat16", chip.name)
    # cp with pp is refused by the lab's Plan checks, ZeRO-1 and FSDP in stages are not run: the pipeline and FSDP
    assert [est for est, _ in chosen] == [top[0], top[3]]
    (pipe, plan), (_, flat) = chosen
    assert plan.options.pp_schedule == "gpipe" and plan.microbatches() == 4 and plan.degrees()["pp"] == 2
    assert flat.degrees()["pp"] == 1 and flat.degrees()["fsdp"] == 8
    got = as_run(plan, chip).config
    # priced as the lab runs it: GPipe as its SPMD pipeline runs it, the scores stored, fp32 weights
    assert (got.layout.pp_schedule, got.spmd_pipeline, got.flash_attention) == ("gpipe", True, False)
    assert (got.param_dtype, got.microbatch, got.layout.pp, got.layout.dp) == ("fp32", 2, 2, 4)
    # GPipe holds every step's activations where 1F1B holds the stages' count: it needs more memory
    assert as_run(plan, chip).memory.total > pipe.memory.total
    assert as_run(flat, chip).config.flash_attention is False and as_run(flat, chip).config.layout.fsdp == 8


@pytest.mark.slow  # about 30 s: a GPipe pipeline, a circular one and FSDP compiled, run and profiled
def test_pipelines_run_on_this_host_beside_the_planners_schedule(tmp_path):
    from lab.run.plan_validate import table, validate_plan

    model, chip, top = _estimates("cpu")
    d = validate_plan(SimpleNamespace(top=[top[0], top[3]]), model, chip, 2, str(tmp_path))
    pipe, flat = d["layouts"]
    assert pipe["layout"] == "dp=4 pp=2 gpipe M=4, remat none" and pipe["planner_schedule"] == "1f1b"
    assert pipe["measured_step_s"] > 0 and flat["measured_step_s"] > 0 and d["memory_agrees"]
    assert "priced as the lab runs it; the planner's 1f1b estimate is" in table(d)


@pytest.mark.slow  # about 10 s: a context-parallel layout compiled, run and profiled on the emulated devices
def test_a_context_parallel_layout_runs_on_this_host(tmp_path, capsys):
    assert main([*LONG, "--hardware", "cpu", "--validate", "1", "--out", str(tmp_path), "--json"]) == 0
    (r,) = json.loads(capsys.readouterr().out)["validation"]["layouts"]
    assert r["layout"] == "fsdp=4 cp=2, remat none" and r["measured_step_s"] > 0 and r["compiled_fits"]


@pytest.mark.parametrize(
    ("extra", "match"),
    [
        (["--target", "v5e:2x4"], "belong to --validate"),
        (["--validate", "2", "--target", "v5e:2x2"], "has 4 chips; give --chips 4"),
        (["--validate", "2", "--target", "v9:2x4"], "unknown TPU generation"),
    ],
)
def test_bad_validate_input(capsys, extra, match):
    assert main([*SMALL, "--hardware", "cpu", *extra]) == 2
    err = capsys.readouterr().err.strip()
    assert match in err and len(err.splitlines()) == 1, err


@pytest.mark.slow  # about 2 minutes: five layouts compiled, run and profiled
def test_validate_five_on_eight_emulated_devices(tmp_path, capsys):
    argv = [*SMALL, "--layers", "2", "--d-model", "256", "--heads", "8", "--kv-heads", "4", "--d-ff", "1024"]
    assert main([*argv, "--hardware", "cpu", "--validate", "5", "--out", str(tmp_path), "--json"]) == 0
    d = json.loads(capsys.readouterr().out)["validation"]
    assert len(d["layouts"]) == 5 and d["memory_agrees"] and d["spearman"] is not None


def _layouts(planner, xla, measured, spreads):
    return [
        {"planner_memory_bytes": p, "compiled_memory_bytes": x, "measured_step_s": m, "measured_spread": s}
        for p, x, m, s in zip(planner, xla, measured, spreads, strict=True)
    ]


def test_memory_words_say_when_verdicts_agree_but_bytes_do_not():
    from lab.run.plan_validate import memory_words

    close = {"layouts": _layouts([100, 200], [110, 190], [1, 1], [1, 1]), "memory_agrees": True}
    assert memory_words(close).endswith("XLA holds 0.95-1.10x the planner's bytes")
    far = {"layouts": _layouts([100, 200], [210, 400], [1, 1], [1, 1]), "memory_agrees": True}
    assert "2.00-2.10x" in memory_words(far) and "the bytes do not agree, only the verdicts" in memory_words(far)
    assert "DISAGREE" in memory_words(far | {"memory_agrees": False})


@pytest.mark.parametrize(
    ("spearman", "measured", "spreads", "words"),
    [
        (1.0, [1.0, 1.5, 2.0, 2.5, 3.0], [1.05] * 5, "orders the layouts as measured (at or above 0.90"),
        (0.7, [1.0, 1.5, 2.0, 2.5, 3.0], [1.05] * 5, "no evidence of order: below 0.90, the 5% critical value for 5"),
        (-0.6, [1.0, 1.5, 2.0, 2.5, 3.0], [1.05] * 5, "does not order the layouts as measured"),
        (0.7, [1.0, 1.02, 1.05, 1.08, 1.1], [1.3] * 5, "less than a layout's own repeats differ (median 1.30x)"),
    ],
)
def test_rank_words_judge_the_correlation_by_its_critical_value_and_the_repeats(spearman, measured, spreads, words):
    from lab.run.plan_validate import rank_words

    data = {"layouts": _layouts([1] * 5, [1] * 5, measured, spreads), "spearman": spearman, "kendall": 0.0}
    assert words in rank_words(data)
    assert ("mostly noise" in rank_words(data)) == (spreads[0] > max(measured) / min(measured))
