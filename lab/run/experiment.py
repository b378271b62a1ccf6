"""Experiment files: declarative TOML naming what to run, on which mesh, at which sizes.

```toml
# Which question this experiment answers, in a comment.
[experiment]
name = "sharded_matmul_case2"          # defaults to the file name
kernel = "sharded_matmul_case2"        # a kernel from `shardlab audit --list`
hardware = "tpu-v5e"                   # the chip predictions are priced for (default: calibrated)
dtype = "float32"                      # float32 | bfloat16
axes = ["X"]                           # collective microkernels only: the mesh axes they span

[mesh]                                 # axis name = size, major to minor
X = 2
Y = 4

[sizes]                                # the kernel's dims (see its description)
I = 56
J = 88
K = 104
```

Loading validates every field and names it (with its line) when something is wrong. The run harness
adds a ``[run]`` table (warm-up, repeats) to the same format later.
"""

from __future__ import annotations

import math
import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lab.core.errors import UserError

DTYPES = {"float32": "fp32", "fp32": "fp32", "f32": "fp32", "bfloat16": "bf16", "bf16": "bf16"}
SECTIONS = {"experiment", "mesh", "sizes", "run", "model"}
EXPERIMENT_KEYS = {"name", "kernel", "hardware", "dtype", "axes", "question"}


@dataclass(frozen=True)
class Experiment:
    name: str
    kernel: str
    mesh: dict[str, int]
    sizes: dict[str, int]
    hardware: str = "calibrated"
    dtype: str = "fp32"
    axes: tuple[str, ...] | None = None
    path: str | None = None
    run: dict[str, Any] = field(default_factory=dict)
    model: dict[str, Any] = field(default_factory=dict)

    @property
    def devices(self) -> int:
        return math.prod(self.mesh.values())


def _line_of(text: str, section: str, key: str | None = None) -> int | None:
    """1-based line of ``[section]`` (or of ``key`` inside it) in the TOML text."""
    in_section = False
    for i, line in enumerate(text.splitlines(), 1):
        s = line.strip()
        if s.startswith("["):
            in_section = s.strip("[] ") == section
            if in_section and key is None:
                return i
            continue
        if in_section and key is not None and re.match(rf"{re.escape(key)}\s*=", s):
            return i
    return None


def load_experiment(path: str | Path) -> Experiment:
    """Read and validate an experiment file; errors name the field and its line."""
    p = Path(path)
    if not p.is_file():
        raise UserError(f"experiment file {str(p)!r} does not exist; see experiments/ for examples")
    text = p.read_text()
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise UserError(f"{p}: not valid TOML: {exc}") from None

    def bad(section: str, key: str | None, msg: str) -> UserError:
        line = _line_of(text, section, key)
        where = f"{p}:{line}" if line else str(p)
        return UserError(f"{where}: [{section}]{'.' + key if key else ''} {msg}")

    for sec in doc:
        if sec not in SECTIONS:
            raise bad(sec, None, f"is not a known section; valid: {', '.join(sorted(SECTIONS))}")
    exp = doc.get("experiment")
    if not isinstance(exp, dict):
        raise UserError(f'{p}: missing the [experiment] table (with at least kernel = "...")')
    for key in exp:
        if key not in EXPERIMENT_KEYS:
            raise bad("experiment", key, f"is not a known field; valid: {', '.join(sorted(EXPERIMENT_KEYS))}")
    kernel = exp.get("kernel")
    if not isinstance(kernel, str) or not kernel:
        raise bad("experiment", "kernel" if "kernel" in exp else None, 'needs kernel = "<name>"')
    dtype = exp.get("dtype", "float32")
    if dtype not in DTYPES:
        raise bad("experiment", "dtype", f"= {dtype!r} is not one of float32, bfloat16")
    hardware = exp.get("hardware", "calibrated")
    if not isinstance(hardware, str):
        raise bad("experiment", "hardware", 'must be a chip name such as "tpu-v5e"')
    axes = exp.get("axes")
    if axes is not None and (not isinstance(axes, list) or not all(isinstance(a, str) for a in axes)):
        raise bad("experiment", "axes", 'must be a list of mesh axis names, e.g. ["X", "Y"]')

    def int_table(section: str) -> dict[str, int]:
        table = doc.get(section)
        if not isinstance(table, dict) or not table:
            raise UserError(f"{p}: missing the [{section}] table")
        out = {}
        for k, v in table.items():
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise bad(section, k, f"= {v!r} must be a positive integer")
            out[k] = v
        return out

    mesh = int_table("mesh")
    sizes = int_table("sizes")
    if axes is not None:
        for a in axes:
            if a not in mesh:
                raise bad("experiment", "axes", f"names {a!r}, which is not a mesh axis ({', '.join(mesh)})")
    run = doc.get("run", {})
    if not isinstance(run, dict):
        raise bad("run", None, "must be a table")
    model = doc.get("model", {})
    if not isinstance(model, dict):
        raise bad("model", None, "must be a table of the model's dims")
    return Experiment(
        name=exp.get("name", p.stem),
        kernel=kernel,
        mesh=mesh,
        sizes=sizes,
        hardware=hardware,
        dtype=DTYPES[dtype],
        axes=tuple(axes) if axes is not None else None,
        path=str(p),
        run=run,
        model=model,
    )
