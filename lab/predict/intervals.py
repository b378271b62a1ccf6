"""An 80% interval for every estimate, from the validation residuals of its class, widened where the answer leans on
constants nobody measured for its chip.

**The class** of an estimate is its chip's kind and what it prices: ``GPU training``, ``TPU training``, ``GPU
serving``, ``TPU serving``. Its residuals are ``r = log(measured / predicted)`` over the development set's answered
runs (``lab/studies/intervals_fit.py`` derives them; ``shardlab validate --write-intervals`` writes
:data:`TABLE`, and a test fails when the file no longer matches the model). A run's error is mostly its source's
(the stack, the cluster, how the figure was taken: the development set's sources are each off in their own
direction), so a new run is a new source: the class's spread is the spread **between** its sources' mean residuals
plus the spread **within** a source, ``s_class^2 = s_between^2 + s_within^2``, and its centre the mean of the source
means (each source once, however many rows it has). A class with fewer than three sources takes the between-source
spread of all classes together (its own is not an estimate).

**The estimate's own spread** adds in quadrature what its answer does when each B or C graded constant touching its
chip is swapped for its alternative (:mod:`lab.predict.constants`): ``s^2 = s_class^2 + sum_c log(t_c / t)^2``. An
answer that rests on measured (A) constants keeps the class's width; one dominated by a carried-over or assumed
figure widens.

The interval is ``[t exp(mu - q s), t exp(mu + q s)]``: a prediction interval for a run of a source not yet seen, from
a class whose between-source spread was estimated on ``k`` sources, takes that spread as ``s_between^2 (1 + 1/k)`` and
the 90th percentile ``q`` of Student's t with ``k - 1`` degrees of freedom (1.53 for 5 sources; the normal's 1.28
only with many). The development set is in-sample (the model was changed while it was watched), so its own coverage
says little; the test split's coverage is the check.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from lab.core.errors import UserError

TABLE = Path(__file__).parent / "data" / "intervals.json"
Z80 = 1.2816  # the normal 90th percentile: an 80% interval between the 10th and the 90th
# Student's t 90th percentile by degrees of freedom (any statistics table); between two entries the larger (the wider)
T90 = (
    (1, 3.078),
    (2, 1.886),
    (3, 1.638),
    (4, 1.533),
    (5, 1.476),
    (6, 1.440),
    (7, 1.415),
    (8, 1.397),
    (9, 1.383),
    (10, 1.372),
    (12, 1.356),
    (15, 1.341),
    (20, 1.325),
    (30, 1.310),
    (60, 1.296),
)


def t90(dof: int) -> float:
    """Student's t 90th percentile with ``dof`` degrees of freedom (T90; the normal's beyond 60)."""
    if dof < 1:
        raise UserError(f"no spread can be estimated from {dof + 1} source(s)")
    for d, q in reversed(T90):
        if dof >= d:
            return q if dof < 120 else Z80
    return T90[0][1]


MIN_SOURCES = 3  # below this a class's between-source spread is the pooled one


@dataclass(frozen=True)
class ClassSpread:
    """The residuals of one class (log measured / predicted): their centre and spreads."""

    name: str
    runs: int
    sources: int
    mu: float
    s_between: float
    s_within: float
    dof: int = 0  # degrees of freedom of s_between: the sources it was estimated from, less one
    k: int = 0  # the sources it was estimated from

    @property
    def s(self) -> float:
        """The predictive spread for a run of a new source: the between-source spread widened by 1 + 1/k for its
        centre's own uncertainty, and the within-source spread."""
        between = self.s_between * math.sqrt(1 + 1 / self.k) if self.k else self.s_between
        return math.hypot(between, self.s_within)

    @property
    def q(self) -> float:
        """The quantile the 80% interval takes (t90 of dof; the normal's when dof is not known)."""
        return t90(self.dof) if self.dof else Z80

    def to_dict(self) -> dict[str, float | int | str]:
        return {
            "name": self.name,
            "runs": self.runs,
            "sources": self.sources,
            "mu": self.mu,
            "s_between": self.s_between,
            "s_within": self.s_within,
            "dof": self.dof,
            "k": self.k,
        }


_LOADED: dict[str, ClassSpread] | None = None


def table() -> dict[str, ClassSpread]:
    """The classes of :data:`TABLE` (read once)."""
    global _LOADED
    if _LOADED is None:
        import json  # here: an estimate that prints no interval never reads the table

        data = json.loads(TABLE.read_text())
        _LOADED = {c["name"]: ClassSpread(**c) for c in data["classes"]}
    return _LOADED


def class_of(chip_kind: str, kind: str) -> str:
    """``GPU training`` and the like: the class whose residuals price an estimate's interval."""
    family = {"gpu": "GPU", "tpu": "TPU"}.get(chip_kind)
    if family is None:
        raise UserError(
            f"no published runs validate estimates on a {chip_kind} chip, so no interval can be derived for one; "
            "intervals exist for GPU and TPU estimates (a host's: plan --validate measures it)"
        )
    return f"{family} {kind}"


@dataclass(frozen=True)
class Interval:
    """An estimate's 80% interval and how it was made."""

    lo: float
    hi: float
    estimate: float
    klass: str
    s_class: float
    s_constants: float  # the quadrature sum of the B/C swaps' log shifts for this estimate
    leaning_on: tuple[tuple[str, float], ...] = ()  # the constants that moved it most, and by what factor

    @property
    def half_width(self) -> float:
        """Half the interval's width over the estimate (the figure held to 30%)."""
        return (self.hi - self.lo) / 2 / self.estimate

    def as_list(self) -> list[float]:
        return [self.lo, self.hi]

    def to_dict(self) -> dict[str, object]:
        return {
            "interval_s": [self.lo, self.hi],
            "class": self.klass,
            "confidence": 0.8,
            "s_class": self.s_class,
            "s_constants": self.s_constants,
            "leaning_on": [{"constant": n, "factor": f} for n, f in self.leaning_on],
        }


def interval(estimate: float, klass: str, shifts: dict[str, float] | None = None) -> Interval:
    """The 80% interval of an estimate of ``estimate`` seconds of class ``klass``; ``shifts``: each B/C constant's
    swapped estimate over this one (:func:`constant_shifts`)."""
    spreads = table()
    if klass not in spreads:
        raise UserError(f"no validation residuals for {klass!r}; classes with them: {', '.join(spreads)}")
    c = spreads[klass]
    logs = {n: math.log(r) for n, r in (shifts or {}).items() if r > 0}
    s_k = math.sqrt(sum(v * v for v in logs.values()))
    s = math.hypot(c.s, s_k)
    lo = estimate * math.exp(c.mu - c.q * s)
    hi = estimate * math.exp(c.mu + c.q * s)
    top = sorted(logs.items(), key=lambda kv: -abs(kv[1]))[:3]
    return Interval(lo, hi, estimate, klass, c.s, s_k, tuple((n, math.exp(v)) for n, v in top if abs(v) > 1e-3))


def constant_shifts(price, family: str, kind: str, what: str | None = None) -> dict[str, float]:
    """Each B/C constant touching a chip of ``family`` and ``kind``, swapped in turn: ``price()`` under it over
    ``price()`` as built (``price`` returns seconds)."""
    from lab.predict import constants as K

    base = price()
    out = {}
    for c in K.uncertain(family, kind, what):
        with K.swapped(c.name):
            t = price()
        if base > 0 and t > 0 and t != base:
            out[c.name] = t / base
    return out


def _class_or_none(chip, kind: str) -> str | None:
    try:
        return class_of(chip.kind, kind)
    except UserError:
        return None


def for_training(est) -> Interval | None:
    """The 80% interval of a training estimate's step (None on a chip kind no published run validates)."""
    from lab.predict.efficiency import family
    from lab.predict.training.estimate import estimate

    cfg = est.config
    klass = _class_or_none(cfg.chip, "training")
    if klass is None:
        return None
    price = lambda: estimate(cfg, check=False).step_time_s  # noqa: E731
    shifts = constant_shifts(price, family(cfg.chip), cfg.chip.kind, "training")
    return interval(est.step_time_s, klass, shifts)


def for_inference(cfg, what: str = "decode_step_s") -> Interval | None:
    """The 80% interval of an inference estimate's ``decode_step_s`` or ``prefill_s``, always about the achievable
    prediction (an ideal roofline is a bound, not a prediction); None where nothing validates the chip kind or the
    quantity is not priced."""
    import dataclasses

    from lab.predict.efficiency import family
    from lab.predict.inference.estimate import estimate_inference

    klass = _class_or_none(cfg.chip, "serving")
    if klass is None:
        return None
    cfg = dataclasses.replace(cfg, achievable=True, mfu=None)

    def price() -> float:
        return getattr(estimate_inference(cfg), what) or 0.0

    t = price()
    if not t:
        return None
    return interval(t, klass, constant_shifts(price, family(cfg.chip), cfg.chip.kind, "serving"))


def for_program(program) -> Interval | None:
    """The interval of a Plan's program estimate (:mod:`lab.predict.program.estimate`): its training step's, or
    its decode step's; None for a program the estimators price op by op only, or on a chip kind nothing validates."""
    detail = getattr(program, "detail", None) or {}
    if "train" in detail:
        return for_training(detail["train"])
    if "infer" in detail:
        return for_inference(detail["infer"].config)
    return None


def text(iv: Interval, fmt) -> str:
    """``likely 5.9-7.9 s`` (the 80% interval), with ``fmt`` formatting seconds (one unit named once where both ends
    share it)."""
    lo, hi = fmt(iv.lo), fmt(iv.hi)
    lo_num, _, lo_unit = lo.partition(" ")
    if lo_unit and hi.endswith(" " + lo_unit):
        lo = lo_num
    return f"likely {lo}-{hi}"


__all__ = [
    "TABLE",
    "Z80",
    "ClassSpread",
    "Interval",
    "class_of",
    "constant_shifts",
    "for_inference",
    "for_program",
    "for_training",
    "interval",
    "t90",
    "table",
    "text",
]
