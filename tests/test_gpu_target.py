"""GPU targets, the parts that need no CUDA plugin: names, the target configurations and the install hint
(lab/compile/gpu_target.py; the compile itself is recorded in docs/validation/gpu_cross_compile.md)."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest

from lab.compile.gpu_target import GPUS, parse_gpu_target, target_config
from lab.core.errors import UserError


@pytest.mark.parametrize(
    ("text", "chips", "hosts", "topology"),
    [("h100:8", 8, 1, "1x1x8"), ("H200:8", 8, 1, "1x1x8"), ("b200:2x8", 16, 2, "1x2x8"), ("a100:4", 4, 1, "1x1x4")],
)
def test_a_gpu_target_names_its_gpus_and_hosts(text, chips, hosts, topology):
    t = parse_gpu_target(text)
    assert (t.chips, t.hosts, t.topology) == (chips, hosts, topology)
    assert t.chip in ("h100", "h200", "b200", "a100-80gb") and t.device_kind.startswith("NVIDIA ")
    from lab.core.hardware import get_chip

    assert get_chip(t.chip).name == t.chip  # priced on a catalog chip


@pytest.mark.parametrize(
    ("text", "said"), [("h100", "not a GPU target"), ("v5e:8", "unknown GPU"), ("h100:0", "no GPUs")]
)
def test_a_bad_gpu_target_is_one_line_naming_the_known_ones(text, said):
    with pytest.raises(UserError, match=said) as err:
        parse_gpu_target(text)
    assert "\n" not in str(err.value) and "h100:8" in str(err.value)


def test_each_configuration_states_its_compute_capability_and_memory():
    """Hopper is compute capability 9.0 with 80 GB (H100 SXM) or 141 GB (H200) of HBM; Blackwell B200 is 10.0;
    A100 is 8.0 (NVIDIA's datasheets). The text is what XLA's GpuTargetConfigProto parser reads."""
    majors = {"h100": 9, "h200": 9, "b200": 10, "a100": 8}
    for gpu, major in majors.items():
        text = target_config(gpu)
        assert re.search(rf"cuda_compute_capability\s*\{{\s*major:\s*{major}\b", text), gpu
        memory = int(re.search(r"device_memory_size:\s*(\d+)", text).group(1))
        assert {"h100": 75e9, "h200": 130e9, "b200": 170e9, "a100": 75e9}[gpu] < memory < 200e9, (gpu, memory)
    assert set(GPUS) == set(majors)


def test_a_configuration_that_is_not_there_is_one_line(tmp_path):
    with pytest.raises(UserError, match="no GPU target configuration"):
        target_config(str(tmp_path / "missing.txtpb"))


# ----- --target takes a GPU: the audit and the explanations compile for XLA:GPU -------------------------------------

EXPERIMENTS = Path(__file__).resolve().parent.parent / "experiments"


def _has_cuda_plugin() -> bool:
    from lab.compile.gpu_target import cuda_plugin_installed

    return cuda_plugin_installed()


needs_cuda_plugin = pytest.mark.skipif(
    not _has_cuda_plugin(), reason="JAX's CUDA plugin (the gpu-aot extra) is not installed"
)


def test_every_target_flag_reads_a_tpu_topology_or_gpus():
    from lab.compile.target import parse_target

    assert (parse_target("h100:8").backend, parse_target("h100:8").chips) == ("gpu", 8)
    assert (parse_target("v5e:2x4").backend, parse_target("v5e:2x4").chips) == ("tpu", 8)
    with pytest.raises(UserError, match="not a TPU topology or GPU name") as err:
        parse_target("x100:8")
    assert "h100" in str(err.value) and "v5e:2x4" in str(err.value)


def test_a_gpu_target_without_the_cuda_plugin_is_one_line_naming_the_install(monkeypatch, capsys):
    import lab.compile.gpu_target as gpu_target
    from lab.cli.main import main

    monkeypatch.setattr(gpu_target, "cuda_plugin_installed", lambda: False)
    assert main(["audit", str(EXPERIMENTS / "train_fsdp_tp.toml"), "--target", "h100:8"]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert "CUDA plugin" in line and "pip install 'jax[cuda12-local]==" in line


def test_xla_gpu_gathers_the_output_table_in_fp32_where_the_tpu_compiler_casts_first():
    """train_fsdp_tp compiled for h100:8 gathers 10,080 B outside its layer loop (the final norm scale, 224 B, and
    both tables in fp32, 4,928 B each: read from XLA:GPU's HLO, docs/explain.md); for v5e:2x4 the output table
    crosses in bf16 (2,464 B)."""
    from lab.compile.target import for_target, parse_target
    from lab.core.hardware import get_chip
    from lab.predict.program.estimate import estimate_program
    from lab.run.experiment import load_experiment

    plan = load_experiment(EXPERIMENTS / "train_fsdp_tp.toml").plan
    plan = dataclasses.replace(plan, dtype="bf16")

    def gathered(target: str) -> dict[str, float]:
        est = estimate_program(for_target(plan, parse_target(target)), get_chip("h100"))
        return {o.name: o.bytes for o in est.ops if o.is_collective and o.kind == "all-gather" and "table" in o.name}

    table = "FSDP: the input table, kept"
    assert gathered("h100:8") == {table: 4928, "FSDP: the output table, kept (cast after)": 4928}
    assert gathered("v5e:2x4") == {table: 4928, "FSDP: the output table, cast, kept": 2464}


@needs_cuda_plugin
@pytest.mark.parametrize(
    "experiment", ["train_fsdp_tp", "train_dp", "train_cp_dp_tp", "decode_tp", "llama3_8b_train_2layer"]
)
def test_the_audit_compiled_for_h100s_matches(experiment):
    from cli_runner import run_cli

    code, out, err = run_cli(
        ["audit", str(EXPERIMENTS / f"{experiment}.toml"), "--target", "h100:8", "--dtype", "bf16", "--json"]
    )
    assert code == 0, err
    data = json.loads(out)
    assert data["backend"] == "gpu" and data["compiled_for"] == "h100:8" and data["emulated"] is False
    assert data["all_match"], data["entries"]


@needs_cuda_plugin
def test_explain_memory_for_h100s_adds_up_within_1_percent():
    from cli_runner import run_cli

    toml = str(EXPERIMENTS / "train_fsdp_tp.toml")
    code, out, err = run_cli(["explain", "memory", toml, "--target", "h100:8", "--dtype", "bf16", "--json"])
    assert code == 0, err
    data = json.loads(out)
    assert abs(data["peak_bytes"] / data["xla_peak_bytes"] - 1) <= 0.01
    assert data["heap"]["fragmentation"] is None  # libtpu's figure: not on XLA:GPU
