"""PyTorch eager generate (infer estimate --eager): a step is the longer of the host's measured work and the GPU's."""

import json

import pytest

from lab.cli.main import main
from lab.core.hardware import get_chip
from lab.core.models import get_model
from lab.predict.inference.estimate import InferConfig, estimate_inference

H100 = get_chip("h100")
L8, L13 = get_model("llama3-8b"), get_model("llama2-13b")


def est(model=L8, eager=True, **kw):
    kw = {"batch": 1, "context": 96, "achievable": True} | kw
    return estimate_inference(InferConfig(model=model, chip=H100, eager=eager, **kw))


def test_host_time_is_the_measured_pieces_for_every_layer():
    # microbenchmarks-added.md E1, E2 and O1, by hand: 32 layers x (0.507 ms + 40 x 2.65 us) + 1.09 ms + 64 x 2.65 us
    assert est().host_s == pytest.approx(32 * (0.507e-3 + 40 * 2.65e-6) + 1.09e-3 + 63 * 2.65e-6, rel=1e-9)
    assert est(model=L13).host_s == pytest.approx(40 * (0.507e-3 + 40 * 2.65e-6) + 1.09e-3 + 63 * 2.65e-6, rel=1e-9)


def test_a_small_batch_waits_for_the_host():
    e, graph = est(), est(eager=False)
    assert graph.decode_step_s < 0.5 * e.host_s  # 16 GB of weights stream in ~7 ms; the host takes ~21 ms
    assert e.decode_step_s == e.host_s and e.bound == "host (eager)"


def test_a_large_cache_is_copied_each_step_and_the_gpu_sets_the_pace():
    # 64 sequences of 4,096 tokens: 54 GB of cache, read by attention and, in eager generate, concatenated again
    kw = {"model": L13, "batch": 64, "context": 4096}
    e, graph = est(**kw), est(eager=False, **kw)
    assert e.decode_step_s > e.host_s and e.bound == "KV reads"
    assert e.kv_s == pytest.approx(3 * graph.kv_s, rel=1e-12)
    assert e.decode_step_s - graph.decode_step_s == pytest.approx(2 * graph.kv_s, rel=1e-9)


@pytest.mark.parametrize("batch", [1, 4, 16, 64, 256])
def test_eager_is_never_faster_than_the_same_step_with_graphs(batch):
    assert est(batch=batch, context=2048).decode_step_s >= est(eager=False, batch=batch, context=2048).decode_step_s


def test_cli_prints_the_host_line_and_json(capsys):
    argv = ["infer", "estimate", "--model", "llama3-8b", "--hardware", "h100", "--chips", "1", "--batch", "1"]
    argv += ["--context", "96", "--achievable", "--eager"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "(host (eager)-bound)" in out and "  host (eager)" in out
    assert main([*argv, "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["eager"] is True and d["decode_step_s"] == d["host_s"] > 0.02


@pytest.mark.parametrize(
    "extra, words",
    [
        (["--hardware", "tpu-v5e", "--chips", "8", "--achievable"], "on a GPU; tpu-v5e is a tpu"),
        (["--hardware", "h100", "--chips", "2", "--achievable"], "got tp=2, ep=1: give --tp 1"),
        (["--hardware", "h100", "--chips", "1", "--ideal"], "drop --ideal"),
    ],
)
def test_eager_where_it_cannot_be_priced_is_one_line_and_exit_2(capsys, extra, words):
    argv = ["infer", "estimate", "--model", "llama3-8b", "--batch", "1", "--context", "96", "--eager", *extra]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and words in err[0]


def test_eager_published_runs_are_answered(capsys):
    # optimum's fp16 generate rows were refused before eager generate was priced; now they are answered
    assert main(["validate", "--case", "PS44", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["predicted"] is not None and d["predicted"] > 0.02
