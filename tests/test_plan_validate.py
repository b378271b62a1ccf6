"""plan --validate K: the planner's best executable layouts compiled (and run) against its ranking."""

import json

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


def test_the_best_layouts_compile_and_run_on_this_host(tmp_path, capsys):
    assert main([*SMALL, "--hardware", "cpu", "--validate", "2", "--out", str(tmp_path), "--json"]) == 0
    d = json.loads(capsys.readouterr().out)["validation"]
    assert len(d["layouts"]) == 2 and d["compiled_for"] is None
    for r in d["layouts"]:
        assert r["measured_step_s"] > 0 and r["compiled_memory_bytes"] > 0 and r["planner_fits"] is True
        assert {r["predicted_rank"], r["measured_rank"]} <= {1, 2}
    assert d["memory_agrees"] is True and d["spearman"] in (-1.0, 1.0) and d["kendall"] in (-1.0, 1.0)
    est = [r["planner_step_s"] for r in d["layouts"]]
    assert est == sorted(est)  # the planner's order


def test_the_best_layouts_cross_compiled_for_a_tpu(capsys):
    assert main([*SMALL, "--hardware", "tpu-v5e", "--validate", "2", "--target", "v5e:2x4", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)["validation"]
    assert d["compiled_for"] == "v5e:2x4" and d["spearman"] is None
    assert all(r["measured_step_s"] is None and r["compiled_memory_bytes"] > 0 for r in d["layouts"])
    assert d["memory_agrees"] is True


# At 2,048 tokens a sequence the planner ranks context-parallel layouts first (their activations split over cp).
LONG = [*SMALL[:-4], "--batch-tokens", "8192", "--seq-len", "2048"]


def test_context_parallel_layouts_are_validated_not_skipped(capsys):
    """The planner's best layouts here split the sequence (cp=2); they used to be passed over for worse ones."""
    assert main([*LONG, "--hardware", "tpu-v5e", "--validate", "2", "--target", "v5e:2x4", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    top = out["top"][0]["layout"]
    assert (top["cp"], top["pp"], top["zero"]) == (2, 1, 0)
    d = out["validation"]
    assert [r["layout"] for r in d["layouts"]] == ["fsdp=4 cp=2, remat none", "fsdp=4 cp=2, remat selective"]
    assert all(r["compiled_memory_bytes"] > 0 for r in d["layouts"]) and d["memory_agrees"] is True


@pytest.mark.slow  # about 15 s: a context-parallel layout compiled, run and profiled on the emulated devices
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
