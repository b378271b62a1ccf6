"""Which catalog chip a device is: the device kinds JAX reports, matched whole, and where a device kind's
calibration is kept (``specs/<backend>-<kind>.json``)."""

from __future__ import annotations

import re

from lab.core.errors import UserError

# The device kinds JAX reports (the CUDA device name on GPUs, libtpu's name on TPUs), lower-cased, to the catalog
# chip: matched whole, never by substring, so an H100 PCIe is not priced as an SXM part nor an A100 40GB as 80GB.
DEVICE_KIND_TO_CHIP = {
    "nvidia h100 80gb hbm3": "h100",
    "nvidia h100 sxm5 80gb": "h100",
    "nvidia h100": "h100",
    "nvidia h100 pcie": "h100-pcie",
    "nvidia h200": "h200",
    "nvidia b200": "b200",
    "nvidia h800": "h800",
    "nvidia h20": "h20",
    "nvidia gb200": "gb200",
    "nvidia a800-sxm4-80gb": "a800",
    "amd instinct mi300x": "mi300x",
    "amd instinct mi325x": "mi325x",
    "amd instinct mi355x": "mi355x",
    "nvidia a100-sxm4-80gb": "a100-80gb",
    "nvidia a100-sxm4-40gb": "a100-40gb",
    "tpu v3": "tpu-v3",
    "tpu v4": "tpu-v4",
    "tpu v5 lite": "tpu-v5e",
    "tpu v5e": "tpu-v5e",
    "tpu v5": "tpu-v5p",
    "tpu v5p": "tpu-v5p",
    "tpu v6 lite": "tpu-v6e",
    "tpu v6e": "tpu-v6e",
    "tpu7x": "tpu-v7x",
}
# Kinds whose name leaves the part open: told apart by the memory JAX reports (bytes_limit is a little under the
# HBM size, so the split is between the two sizes).
BY_MEMORY = {"nvidia a100": (60e9, "a100-40gb", "a100-80gb")}


def chip_for_device(device_kind: str, memory_bytes: float | None = None) -> str:
    """The catalog chip of a device kind (and its memory where the kind does not settle it); a
    :class:`UserError` naming the kind and ``--hardware`` for a kind the catalog does not have."""
    kind = " ".join(device_kind.lower().split())
    if kind in DEVICE_KIND_TO_CHIP:
        return DEVICE_KIND_TO_CHIP[kind]
    for prefix, (split, small, large) in BY_MEMORY.items():
        if kind.startswith(prefix) and "pcie" not in kind and memory_bytes:
            return small if memory_bytes < split else large
    raise UserError(
        f"device kind {device_kind!r} is not in the catalog (it has "
        f"{', '.join(sorted(set(DEVICE_KIND_TO_CHIP.values())))}); price with the closest one (--hardware NAME, or "
        'hardware = "NAME" in the experiment), add it with --hardware-file, or calibrate it (`shardlab calibrate`)'
    )


def spec_name(backend: str, device_kind: str) -> str:
    """The file name of a device kind's calibration: ``gpu-nvidia-h100-80gb-hbm3.json``."""
    return f"{backend}-{re.sub(r'[^a-z0-9]+', '-', device_kind.lower()).strip('-')}.json"


__all__ = ["BY_MEMORY", "DEVICE_KIND_TO_CHIP", "chip_for_device", "spec_name"]
