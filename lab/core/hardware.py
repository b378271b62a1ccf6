"""Hardware catalog: one typed, sourced record per accelerator.

Every number in the catalog is dense (never a structured-sparsity figure) and carries its source in
``Chip.sources``, keyed by field name (``peak_flops.bf16`` for a dtype entry). Units are SI: FLOP/s,
bytes, bytes/s, seconds, US dollars per chip-hour.

Bandwidth conventions, because they decide every collective estimate:

* ``link_bandwidth`` is **one-way**. On a TPU torus it is one ICI link in one direction (the book's
  "one-way" column); the book's ``W_ici`` is the bidirectional figure, ``2 * link_bandwidth``.
  On a GPU it is the NVLink egress of one GPU into its switch domain (450e9 B/s on H100, i.e. the
  "900 GB/s bidirectional" of the datasheet halved).
* ``scaleout_bandwidth`` is the share of the scale-out network one chip can drive, one way: DCN per
  TPU chip, or the InfiniBand/RoCE NIC bandwidth per GPU (node egress = ``node_size * scaleout_bandwidth``).

Users add or override chips with a TOML or JSON file (``--hardware-file``); calibration writes the
same format. See :func:`load_hardware_file`.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Iterable, Mapping
from pathlib import Path

# the chip type and its tables, re-exported: the catalog's callers name them from here
from lab.core.chip import COLLECTIVE_KINDS as COLLECTIVE_KINDS
from lab.core.chip import COLLECTIVE_SCOPES as COLLECTIVE_SCOPES
from lab.core.chip import FABRIC_STEP_LATENCY as FABRIC_STEP_LATENCY
from lab.core.chip import FABRICS as FABRICS
from lab.core.chip import Chip as Chip
from lab.core.chip import _real
from lab.core.chip import scaleout_step_latency as scaleout_step_latency
from lab.core.errors import UserError
from lab.core.schema import parse_positive_float

TYPE_CHECKING = False  # typing is not imported at run time: annotations only
if TYPE_CHECKING:
    from typing import Any


# Where calibration writes, and where the catalog looks for a host's measured spec.
SPECS_DIR_ENV = "SHARDLAB_SPECS_DIR"


def specs_dir() -> Path:
    """Folder of calibrated specs: ``$SHARDLAB_SPECS_DIR`` or ``./specs``."""
    return Path(os.environ.get(SPECS_DIR_ENV, "specs"))


def _normalise(name: str) -> str:
    return str(name).strip().lower().replace("_", "-").replace(" ", "-")


class Catalog:
    """Chips by name and alias, with user files layered on top of the built-in table."""

    def __init__(self, chips: Iterable[Chip] | None = None):
        self._chips: dict[str, Chip] = {}
        chips = CATALOG if chips is None else chips
        self._broken: dict[str, str] = {}
        for chip in chips:
            self.add(chip)

    def add(self, chip: Chip) -> None:
        """Add or replace a chip (a later file overrides an earlier entry of the same name)."""
        self._chips[chip.name] = chip
        self._broken.pop(chip.name, None)

    def check_aliases(self, chip: Chip, where: str) -> None:
        """A chip's aliases must reach it: one that is another chip's name or alias would be shadowed (names
        resolve first, then the catalog's aliases in order) and silently dropped, so it is refused here; and a new
        chip's name must not be another chip's alias, which it would silently take over."""
        taken = next((c.name for c in self._chips.values() if c.name != chip.name and chip.name in c.aliases), None)
        if taken is not None:
            raise UserError(
                f"{where}: name {chip.name!r} is an alias of {taken}; give the chip a name no other chip answers to"
            )
        for alias in chip.aliases:
            key = _normalise(alias)
            owner = next(
                (c.name for c in self._chips.values() if c.name != chip.name and key in (c.name, *c.aliases)), None
            )
            if owner is not None:
                raise UserError(
                    f"{where}: alias {alias!r} of {chip.name} already names {owner}; give an alias no other chip "
                    "uses, or drop it"
                )

    def mark_broken(self, name: str, message: str) -> None:
        """Keep ``name`` listed (its built-in entry) but refuse to price with it: :meth:`get` raises ``message``."""
        self._broken[self.resolve(name)] = message

    @property
    def broken(self) -> dict[str, str]:
        """Chips whose file could not be read, with the error :meth:`get` raises for them."""
        return dict(self._broken)

    @property
    def names(self) -> list[str]:
        return list(self._chips)

    def chips(self) -> list[Chip]:
        return list(self._chips.values())

    def resolve(self, name: str) -> str:
        """The canonical name of ``name``: a chip's name or one of its aliases, matched whole (case, ``_`` and
        spaces aside); anything else is refused, ``h-1-0-0`` or ``ｈ１００`` with the name it resembles."""
        key = _normalise(name)
        if key in self._chips:
            return key
        for chip in self._chips.values():
            if key in chip.aliases:
                return chip.name
        import unicodedata

        # A name that differs from one only in its hyphens or by full-width letters is refused, but named
        squashed = _normalise(unicodedata.normalize("NFKC", str(name))).replace("-", "")
        close = [c.name for c in self._chips.values() for n in (c.name, *c.aliases) if n.replace("-", "") == squashed]
        hint = f" (did you mean {close[0]}?)" if close else _slice_hint(str(name), self)
        raise UserError(f"unknown hardware {name!r}; valid: {', '.join(self._chips)}{hint}")

    def get(self, name: str) -> Chip:
        key = self.resolve(name)
        if key in self._broken:
            raise UserError(self._broken[key])
        return self._chips[key]


# A Cloud TPU accelerator type names a slice, its chip and a size: TensorCores on v4, v5p and TPU7x (two a chip:
# v5p-128 is 64 chips; tpu7x-128 is a 4x4x4 slice of 64, AI-Hypercomputer accelerator-microbenchmarks' configs), chips
# on v5e and v6e (Cloud TPU docs, "TPU versions"; v5litepod is v5e's).
_SLICE_CORES_PER_CHIP = {"v4": 2, "v5p": 2, "v5e": 1, "v5litepod": 1, "v6e": 1, "tpu7x": 2, "v7x": 2}


def _slice_hint(name: str, catalog: Catalog) -> str:
    """What a slice's name (``v5p-128``) says, for the error that refuses it as a chip."""
    import re

    m = re.fullmatch(r"(?:tpu-?)?(v4|v5p|v5e|v5litepod|v6e|tpu7x|v7x)-(\d+)", name.strip().lower())
    if not m:
        return ""
    chip, size, per_chip = catalog.resolve(m.group(1)), int(m.group(2)), _SLICE_CORES_PER_CHIP[m.group(1)]
    if size < per_chip or size % per_chip:
        return f" ({name} names a slice of {chip}, of no whole number of chips)"
    return f" ({name} is a slice: --hardware {chip} --chips {size // per_chip})"


# What a hardware file may say: bounds far outside every chip built, so that a unit slip (GB for bytes, ms for s)
# or a typo is refused by name instead of priced (a bandwidth of 1e-300 gave NaN step times blamed on --chips). The
# catalog's extremes, for scale: 9e15 FLOP/s (B200 fp4), 192 GB and 8 TB/s of HBM (B200), 900 GB/s of NVLink,
# 2.5 us per hop, about $12 per chip-hour, 8 GPUs per node (the largest NVLink domain announced: 576). Each entry:
# (least, most, unit, example). Only files are held to them: a --scale what-if may go past them on purpose.
PLAUSIBLE = {
    # first: a file's NICs set its scale-out bandwidth, so a bad NIC is named before the figure derived from it
    "nics_per_node": (1, 1024, "NICs", "8"),  # DGX H100: 8; no node carries a thousand
    "nic_bandwidth": (1e6, 1e13, "bytes/s", "5e10 for 400 Gb/s"),  # 8 Mb/s to 80 Tb/s per NIC
    "peak_flops": (1e3, 1e18, "FLOP/s", "9.89e14"),  # at most 100x the fastest peak of any chip
    "hbm_bytes": (1e3, 1e15, "bytes", "8e10 for 80 GB"),  # 1 PB: 5,000x the largest HBM
    "hbm_bandwidth": (1e3, 1e15, "bytes/s", "3.35e12"),  # 1 PB/s: over 100x B200's 8 TB/s
    "link_bandwidth": (1e3, 1e15, "bytes/s", "4.5e11"),
    "scaleout_bandwidth": (1e3, 1e15, "bytes/s", "5e10"),
    "hop_latency_s": (0.0, 1.0, "seconds", "2.5e-6"),  # no fabric takes a second a step: a unit slip (us, ms)
    "scaleout_latency_s": (0.0, 1.0, "seconds", "1e-5"),
    "launch_latency_s": (0.0, 1.0, "seconds", "3.6e-6"),
    "price_per_hour": (0.0, 1e6, "US dollars per chip-hour", "2.5"),  # chips rent for about $1-12 an hour
    "node_size": (1, 10**6, "chips", "8"),  # a million chips in one switch domain is past any machine built
    "wraparound_size": (1, 2**20, "chips", "16"),
}
MAX_POD_CHIPS = 2**20  # the largest torus pod: a million chips is past any machine built (v5p pods: 8,960)


def _check_plausible(chip: Chip, where: str) -> None:
    """Every number of a chip read from a file inside :data:`PLAUSIBLE` (and its pod under a million chips)."""
    values = [(f"peak_flops.{dt}", "peak_flops", v) for dt, v in chip.peak_flops.items()]
    values += [(f, f, getattr(chip, f)) for f in PLAUSIBLE if f != "peak_flops"]
    for label, fname, v in values:
        lo, hi, unit, example = PLAUSIBLE[fname]
        if v is not None and not lo <= v <= hi:
            raise UserError(
                f"{where}: hardware {chip.name!r}: {label} = {v:g} is outside the plausible {lo:g}..{hi:g} {unit}; "
                f"give it in {unit}, e.g. {example}"
            )
    if chip.pod_shape and math.prod(chip.pod_shape) > MAX_POD_CHIPS:
        raise UserError(
            f"{where}: hardware {chip.name!r}: pod_shape {list(chip.pod_shape)} is {math.prod(chip.pod_shape):,} "
            f"chips, more than any machine built; at most {MAX_POD_CHIPS:,} (e.g. [16, 16])"
        )


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object whose keys are unique (TOML refuses a repeated key; JSON would keep the last silently)."""
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"key {key!r} appears twice in one object; keep one")
        out[key] = value
    return out


def _coerce_chip(entry: Mapping[str, Any], base: Chip | None, where: str) -> Chip:
    known = {f.name for f in dataclasses.fields(Chip)}
    if not isinstance(entry, Mapping):
        raise UserError(f"{where}: expected a table of chip fields, got {type(entry).__name__} {entry!r:.60}")
    data = dict(entry)
    fab_lat = FABRIC_STEP_LATENCY.get(data.get("fabric"))  # a file the lab wrote repeats both; a person's may clash
    if fab_lat is not None and "scaleout_latency_s" in data and data["scaleout_latency_s"] != fab_lat:
        raise UserError(
            f"{where}: fabric {data['fabric']!r} sets the step latency across nodes ({fab_lat:g} s); give fabric or "
            f"scaleout_latency_s = {data['scaleout_latency_s']!r}, not both"
        )
    node = data.get("node_size", base.node_size if base else 8)
    stated = (data.get("nics_per_node"), data.get("nic_bandwidth"), node)
    if "scaleout_bandwidth" in data and all(_real(x) for x in stated) and stated[2]:
        derived = stated[0] * stated[1] / stated[2]
        if not math.isclose(derived, data["scaleout_bandwidth"], rel_tol=1e-9):
            raise UserError(
                f"{where}: nics_per_node x nic_bandwidth / node_size = {derived:g} sets scaleout_bandwidth; give the "
                f"NICs or scaleout_bandwidth = {data['scaleout_bandwidth']!r}, not both"
            )
    data.pop("base", None)
    data.pop("derived", None)  # files written by to_dict() carry derived figures; they are recomputed
    unknown = sorted(set(data) - known)
    if unknown:
        raise UserError(f"{where}: unknown field {unknown[0]!r}; valid fields: {', '.join(sorted(known))}")
    for key in ("peak_flops", "sources", "calibration"):
        if key in data and not isinstance(data[key], Mapping):
            raise UserError(f"{where}: {key} = {data[key]!r:.60} must be a table")
    if "nics_per_node" in data or "nic_bandwidth" in data:  # the stated NICs give the scale-out share per chip
        nics = data.get("nics_per_node", base.nics_per_node if base is not None else None)
        rate = data.get("nic_bandwidth", base.nic_bandwidth if base is not None else None)
        node = data.get("node_size", base.node_size if base is not None else None)
        if _real(nics) and _real(rate) and _real(node) and node > 0:
            data["scaleout_bandwidth"] = nics * rate / node
    if base is not None:
        merged = base.fields()
        merged["peak_flops"] = {**base.peak_flops, **dict(data.pop("peak_flops", {}))}
        merged["sources"] = {**base.sources, **dict(data.pop("sources", {}))}
        merged["aliases"] = ()  # aliases belong to the catalog entry, not to a derived chip
        merged.update(data)
        data = merged
    if "name" not in data:
        raise UserError(f"{where}: every chip needs a 'name' (and either 'base' or all fields)")
    missing = [
        f.name
        for f in dataclasses.fields(Chip)
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING and f.name not in data
    ]
    if missing:
        raise UserError(
            f"{where}: chip {data['name']!r} is missing {', '.join(missing)}; "
            f"give them or set base = '<catalog chip>' to inherit"
        )
    if isinstance(data["name"], str) and not data["name"].strip():
        raise UserError(f'{where}: name = {data["name"]!r} is blank; give the chip a name, e.g. "h100-pcie"')
    data["name"] = _normalise(data["name"])
    for key in ("pod_shape", "aliases"):
        if isinstance(data.get(key), list):
            data[key] = tuple(data[key])
    try:
        chip = Chip(**data)
    except UserError as exc:
        raise UserError(f"{where}: {exc}") from None
    except (TypeError, ValueError) as exc:  # wrong value types in the file
        raise UserError(f"{where}: {exc}") from None
    _check_plausible(chip, where)
    return chip


# The built-in catalog: cited data in lab/core/data/chips.json, read by the loader a user's hardware file goes through
# (every field checked by type and range, every number with its source).
CATALOG_FILE = Path(__file__).parent / "data" / "chips.json"


def _load_catalog() -> tuple[Chip, ...]:
    import json

    doc = json.loads(CATALOG_FILE.read_text(encoding="utf-8"))
    return tuple(_coerce_chip(entry, None, f"{CATALOG_FILE.name} chip #{i}") for i, entry in enumerate(doc["chips"], 1))


CATALOG: tuple[Chip, ...] = _load_catalog()


def load_hardware_file(path: str | os.PathLike, catalog: Catalog | None = None) -> list[Chip]:
    """Read chips from TOML or JSON and add them to ``catalog`` (a fresh default one if None).

    The file holds one chip as top-level fields, or several under ``chip`` (TOML ``[[chip]]``) or
    ``chips``. A chip may name ``base = "h100"`` and override only some fields, e.g.::

        name = "h100-pcie"
        base = "h100"
        hbm_bandwidth = 2.0e12
        [sources]
        hbm_bandwidth = "NVIDIA H100 PCIe datasheet"
    """
    catalog = catalog if catalog is not None else Catalog()
    p = Path(path)
    if not p.is_file():
        raise UserError(f"hardware file {str(p)!r} does not exist (or is not a file); pass a .toml or .json file")
    try:
        text = p.read_bytes().decode("utf-8")
    except UnicodeDecodeError as exc:
        raise UserError(f"hardware file {str(p)!r} is not UTF-8 text (byte {exc.start}); save it as UTF-8") from None
    except OSError as exc:
        raise UserError(f"cannot read hardware file {str(p)!r}: {exc.strerror}") from None
    is_json = p.suffix.lower() == ".json"
    import json  # here, with tomllib: a command that reads no hardware file starts without either

    if not is_json:
        import tomllib  # only for TOML: importing it costs a command a few ms at start-up otherwise
    try:
        doc = json.loads(text, object_pairs_hook=_unique_keys) if is_json else tomllib.loads(text)
    except (ValueError, RecursionError) as exc:  # JSONDecodeError and TOMLDecodeError are ValueErrors
        reason = "nested too deeply" if isinstance(exc, RecursionError) else str(exc)
        raise UserError(
            f"hardware file {str(p)!r} is not valid {p.suffix.lstrip('.').upper() or 'TOML'}: {reason}"
        ) from None
    if not isinstance(doc, dict):
        raise UserError(f"hardware file {str(p)!r}: expected a table of chip fields at the top level")
    entries = doc.get("chip", doc.get("chips"))
    if entries is None:
        entries = [doc]
    elif isinstance(entries, dict):
        entries = [entries]
    elif not isinstance(entries, list) or not entries:
        raise UserError(f"hardware file {str(p)!r}: 'chip' (or 'chips') must be a table or a non-empty list of tables")
    out = []
    for i, entry in enumerate(entries):
        where = f"{p}: chip #{i + 1}"
        base = None
        if isinstance(entry, Mapping) and "base" in entry:
            try:
                base = catalog.get(entry["base"])
            except UserError as exc:
                raise UserError(f"{where}: base: {exc}") from None
        chip = _coerce_chip(entry, base, where)
        catalog.check_aliases(chip, where)
        catalog.add(chip)
        out.append(chip)
    return out


def default_catalog(hardware_file: str | os.PathLike | None = None) -> Catalog:
    """The built-in catalog, with this host's calibration and a user file layered on top.

    The host calibration (``cpu.json`` in :func:`specs_dir`) is read when it exists. One that cannot be read
    (binary garbage, truncated, a field of the wrong type) does not break the commands that never price the host:
    the catalog keeps its placeholder ``cpu`` entry, marked broken, so ``hardware list`` and every other chip
    work, and whatever asks for ``cpu`` (or ``calibrated``, which means it) gets a :class:`UserError` naming the
    file and the fix: run ``shardlab calibrate`` again, or delete the file. A ``--hardware-file`` is the user's
    own and any error in it is raised at once.
    """
    catalog = Catalog()
    calibrated = specs_dir() / "cpu.json"
    if calibrated.is_file():
        try:
            chips = load_hardware_file(calibrated, Catalog())  # all or nothing: a half-read file adds no chip
        except UserError as exc:
            reason = str(exc).replace(f"hardware file {str(calibrated)!r} ", "").replace(f"{calibrated}: ", "")
            reason = reason.removeprefix("is ").split("; save it as", 1)[0]
            catalog.mark_broken(
                "cpu",
                f"the host calibration {calibrated} is corrupt ({reason}); run `shardlab calibrate` again, "
                f"or delete {calibrated}",
            )
        else:
            for chip in chips:
                catalog.add(chip)
    if hardware_file:
        load_hardware_file(hardware_file, catalog)
    return catalog


def get_chip(name: str, hardware_file: str | os.PathLike | None = None) -> Chip:
    """Look a chip up by canonical name or alias, case-insensitively."""
    return default_catalog(hardware_file).get(name)


# Short names accepted by --scale, mapped to fields (``flops`` scales every dtype's peak).
SCALE_ALIASES = {
    "flops": "peak_flops",
    "peak": "peak_flops",
    "hbm": "hbm_bytes",
    "hbm_capacity": "hbm_bytes",
    "ici_bandwidth": "link_bandwidth",
    "nvlink_bandwidth": "link_bandwidth",
    "dcn_bandwidth": "scaleout_bandwidth",
    "network_bandwidth": "scaleout_bandwidth",
    "latency": "hop_latency_s",
}


# A what-if factor outside this range is a typo (or an attempt to make a term vanish): refused, like inf and nan.
SCALE_RANGE = (1e-6, 1e6)


def parse_scale(text: str) -> dict[str, float]:
    """``"hbm_bandwidth=2,flops=1.5"`` -> ``{"hbm_bandwidth": 2.0, "peak_flops": 1.5}``.

    Each factor is a positive, finite number in :data:`SCALE_RANGE`: ``inf``, ``nan``, 0, negatives and
    ``1e999`` are refused (an infinite bandwidth would price memory time at zero). A field given twice (or under
    two of its names) multiplies, and the product is held to the same range.
    """
    out: dict[str, float] = {}
    scalable = {f.name for f in dataclasses.fields(Chip) if f.type in ("float", "float | None")} | {"peak_flops"}
    if not str(text).strip():
        raise UserError("--scale is empty; give FIELD=FACTOR pairs, e.g. hbm_bandwidth=2,flops=1.5")
    for part in str(text).split(","):
        if not part.strip():
            raise UserError(f"--scale: {text!r} has an empty item; example: hbm_bandwidth=2,flops=1.5")
        if "=" not in part:
            raise UserError(f"--scale: {part.strip()!r} is not FIELD=FACTOR; example: hbm_bandwidth=2,flops=1.5")
        key, val = (x.strip() for x in part.split("=", 1))
        field_name = SCALE_ALIASES.get(key.lower().replace("-", "_"), key.lower().replace("-", "_"))
        if field_name not in scalable:
            raise UserError(
                f"--scale: unknown field {key!r}; valid: flops, {', '.join(sorted(scalable - {'peak_flops'}))}"
                f", ici_bandwidth"
            )
        if not val.isascii() or "_" in val:  # float() reads '２' and '1_000'; a factor is written plainly
            raise UserError(
                f"--scale {key}: {val!r} is not a plain number; write ASCII digits without '_', e.g. 2 or 0.5"
            )
        factor = parse_positive_float(val, f"--scale {key}", example="2 or 0.5")
        if not SCALE_RANGE[0] <= factor <= SCALE_RANGE[1]:
            raise UserError(
                f"--scale {key}: factor {val} is outside {SCALE_RANGE[0]:g}..{SCALE_RANGE[1]:g}; a what-if "
                "multiplies a field by a realistic factor, e.g. 2 or 0.5"
            )
        out[field_name] = out.get(field_name, 1.0) * factor
        if not SCALE_RANGE[0] <= out[field_name] <= SCALE_RANGE[1]:  # repeated (or aliased) fields multiply
            raise UserError(
                f"--scale {key}: the factors given for {field_name} multiply to {out[field_name]:g}, outside "
                f"{SCALE_RANGE[0]:g}..{SCALE_RANGE[1]:g}; give each field once, e.g. {field_name}=2"
            )
    return out


def scale_chip(chip: Chip, factors: dict[str, float] | str) -> Chip:
    """A what-if copy of ``chip`` with fields multiplied by ``factors`` (see :func:`parse_scale`)."""
    factors = parse_scale(factors) if isinstance(factors, str) else factors
    if not factors:
        return chip
    data = chip.fields()
    for name, f in factors.items():
        if name == "peak_flops":
            data["peak_flops"] = {k: v * f for k, v in chip.peak_flops.items()}
        elif getattr(chip, name) is None:
            raise UserError(f"--scale {name}: {chip.name} has no {name} to scale; scale another field")
        else:
            data[name] = getattr(chip, name) * f
        values = data["peak_flops"].values() if name == "peak_flops" else [data[name]]
        if not all(math.isfinite(v) for v in values):
            raise UserError(f"--scale {name}={f:g} overflows {chip.name}'s {name}; use a smaller factor")
    label = ",".join(f"{k}x{v:g}" for k, v in factors.items())
    data["name"] = f"{chip.name}[{label}]"
    data["aliases"] = ()
    data["notes"] = (chip.notes + " " if chip.notes else "") + f"What-if: {label}."
    return Chip(**data)
