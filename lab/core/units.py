"""Dtypes and human-readable units.

Code and JSON stay in SI (bytes, seconds, FLOP/s, bytes/s); these helpers are for tables only.
"""

from __future__ import annotations

from lab.core.errors import UserError

# Bytes per element. int4 packs two values per byte.
DTYPE_BYTES: dict[str, float] = {
    "fp32": 4.0,
    "bf16": 2.0,
    "fp16": 2.0,
    "fp8": 1.0,
    "int8": 1.0,
    "int4": 0.5,
    "fp4": 0.5,
}

_DTYPE_ALIASES = {
    "float32": "fp32",
    "f32": "fp32",
    "bfloat16": "bf16",
    "float16": "fp16",
    "f16": "fp16",
    "half": "fp16",
    "float8": "fp8",
    "f8": "fp8",
    "float8_e4m3fn": "fp8",
    "float8_e5m2": "fp8",
    "fp8_e4m3": "fp8",
    "fp8_e5m2": "fp8",
    "s8": "int8",
    "i8": "int8",
    "s4": "int4",
    "float4": "fp4",
    "float4_e2m1fn": "fp4",
    "nvfp4": "fp4",
    "i4": "int4",
}


# The numpy name of each short name a program can run in (kernels and experiment files spell dtypes this way), and the
# spellings a command's --dtype accepts for a program that runs.
NUMPY_NAME = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
RUN_DTYPES = ("float32", "bfloat16", "fp32", "bf16")


def numpy_name(name: str) -> str:
    """``bf16`` -> ``bfloat16``: the numpy spelling of a dtype a program runs in (other dtypes keep their name)."""
    dt = canonical_dtype(name)
    return NUMPY_NAME.get(dt, dt)


def canonical_dtype(name: str) -> str:
    """Map a dtype spelling (``bfloat16``, ``f32``, ``float8_e4m3fn``...) to the lab's short name."""
    key = str(name).strip().lower()
    key = _DTYPE_ALIASES.get(key, key)
    if key not in DTYPE_BYTES:
        raise UserError(f"unknown dtype {name!r}; valid: {', '.join(DTYPE_BYTES)}")
    return key


def dtype_bytes(name: str) -> float:
    """Bytes per element of a dtype given in any accepted spelling."""
    return DTYPE_BYTES[canonical_dtype(name)]


def wire_bytes(compute: str) -> float:
    """Bytes per activation element a collective moves when the matmuls compute in ``compute``: its width, and 16 bits
    for narrower recipes (fp8 and int8 matmuls take and give 16-bit activations)."""
    return max(2.0, dtype_bytes(compute))


def _scaled(value: float, steps: list[tuple[float, str]], unit: str, digits: int = 3) -> str:
    for factor, prefix in steps:
        # the value as it will print (999.97 rounds to 1e+03: that is the next prefix's 1)
        if abs(float(f"{value:.{digits}g}")) >= factor:
            return f"{value / factor:.{digits}g} {prefix}{unit}"
    factor, prefix = steps[-1]
    return f"{value / factor:.{digits}g} {prefix}{unit}"


_SI = [(1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k"), (1.0, "")]


def fmt_seconds(s: float) -> str:
    """``0.000373`` -> ``'373 us'``."""
    if s == 0:
        return "0 s"
    return _scaled(s, [(1.0, ""), (1e-3, "m"), (1e-6, "u"), (1e-9, "n")], "s")


def fmt_bytes(n: float) -> str:
    """Decimal units (GB = 1e9 bytes), as datasheets quote them."""
    return _scaled(n, _SI[1:], "B")


def fmt_rate(x: float, unit: str) -> str:
    """``9.89e14, 'FLOP/s'`` -> ``'989 TFLOP/s'``."""
    return _scaled(x, _SI, unit)


def fmt_share(x: float) -> str:
    """A share as a percentage with one decimal; a positive share too small for it is ``<0.1%``, not ``0.0%`` (a
    toy model's MFU: its FLOPs are real, just few)."""
    return "<0.1%" if 0 < x < 0.0005 else f"{100 * x:.1f}%"


def fmt_count(x: float) -> str:
    return _scaled(x, _SI, "").strip()
