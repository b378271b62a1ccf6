"""How far to trust one run's measured numbers, said in one verdict wherever the run's numbers are shown.

A run is **steady** when nothing says its timings are noise; **UNSTEADY** when its own repeats disagree by more
than the band a ratio is judged by, or when other processes held more than :data:`HOST_BUSY` of the host's CPU
time while it was profiled (with one repeat the spread is not measurable, so the host's load alone decides);
**not measured** when it was compiled only. The spec it was priced against is a separate fact: a calibration
taken on a busy host (``calibrate --force``) is marked BUSY, since every figure priced with it is likely too slow.

The terminal's step line, ``report.md`` and ``report.json`` (``summary.trust``) all read :func:`verdict`, so the
three never disagree. JAX-free.
"""

from __future__ import annotations

from typing import Any

from lab.core.limits import HOST_BUSY  # the threshold a calibration refuses a host at, too


def spec_busy(hw: dict[str, Any]) -> bool:
    """The spec was calibrated on a busy host (kept with ``calibrate --force``): its figures are likely too slow."""
    host = (hw.get("calibration") or {}).get("host") or {}
    return bool((host.get("load") or {}).get("busy"))


def spec_words(hw: dict[str, Any]) -> str:
    """``cpu (calibrated)``, ``cpu (calibrated on a BUSY host: ...)``, ``cpu (NOT calibrated: ...)``, or a catalog
    chip's ``tpu-v5e (catalog: datasheet figures)``."""
    if not hw.get("calibrated"):
        if hw.get("kind") == "cpu":
            return f"{hw['name']} (NOT calibrated: placeholder figures; run `shardlab calibrate`)"
        return f"{hw['name']} (catalog: datasheet figures)"
    if spec_busy(hw):
        return (
            f"{hw['name']} (calibrated on a BUSY host: its figures are likely too slow; run `shardlab calibrate` "
            "on an idle host)"
        )
    return f"{hw['name']} (calibrated)"


def verdict(
    summary: dict[str, Any], band_width: float, compile_only: bool = False, siblings: int = 0
) -> dict[str, Any]:
    """``{"verdict": "steady" | "UNSTEADY" | "not measured", "reasons": [...]}`` of one run's summary.

    Args:
        summary: the run's ``summary`` (``spread_large``: the median over ops of 1 MB or more of their slowest
            repeat over their fastest; ``host_load``: other processes' share of CPU time while profiled;
            ``repeats``).
        band_width: the width of the band a ratio is judged by (its upper over its lower edge).
        compile_only: nothing was profiled.
        siblings: this run's own other processes on the same host (``launch --local-processes``): the host's
            "other" load counts them, so it is stated but does not flag the run.
    """
    if compile_only:
        return {"verdict": "not measured", "reasons": ["compiled only: nothing ran"]}
    spread, load = summary.get("spread_large"), summary.get("host_load")
    reasons, unsteady = [], False
    if spread is None:
        few = summary.get("repeats", 0) < 2
        reasons.append("spread not measurable: " + ("one repeat" if few else "no op of 1 MB or more"))
    elif spread > band_width:
        unsteady = True
        reasons.append(f"repeats differ by {spread:.2f}x, more than the band's {band_width:.2f}x")
    else:
        reasons.append(f"repeats differ by {spread:.2f}x")
    if load is not None and siblings:
        reasons.append(f"other processes {100 * load:.0f}% of the host, this run's own {siblings} other included")
    elif load is not None and load > HOST_BUSY:
        unsteady = True
        reasons.append(f"other processes held {100 * load:.0f}% of the host while it was profiled")
    elif load is not None:
        reasons.append(f"other processes {100 * load:.0f}% of the host")
    return {"verdict": "UNSTEADY" if unsteady else "steady", "reasons": reasons}


def verdict_words(trust: dict[str, Any]) -> str:
    """``steady (repeats differ by 1.05x)``; an UNSTEADY run says to read its ratios as noise."""
    words = f"{trust['verdict']} ({'; '.join(trust['reasons'])})"
    return words + (": read its ratios as noise" if trust["verdict"] == "UNSTEADY" else "")


__all__ = ["spec_busy", "spec_words", "verdict", "verdict_words"]
