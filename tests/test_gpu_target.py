"""GPU targets, the parts that need no CUDA plugin: names, the target configurations and the install hint
(lab/compile/gpu_target.py; the compile itself is recorded in docs/validation/gpu_cross_compile.md)."""

from __future__ import annotations

import re

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
