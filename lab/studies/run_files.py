"""Published measured runs kept as data files, one file a source: the typed loader of the test split.

A file is TOML: one ``[source]`` table (the citation, the stack, the assumptions made for every run of the source
and the rule that chose its rows) and one ``[[run]]`` table a run, whose fields are :class:`PublicRun`'s. The loader
checks every field's name and type and the catalog names (a chip or model the catalog lacks must come with
``expressible``, the reason the estimators cannot price the run), and refuses a file with one line naming the bad
value. ``python -m lab.studies.run_files FILE...`` checks files without predicting anything: a run enters the test
split, and is committed, before the estimators see it.
"""

from __future__ import annotations

import dataclasses
import sys
import tomllib
from pathlib import Path

from lab.core.errors import UserError
from lab.studies.public_runs import PublicRun

DATA = Path(__file__).parent / "data"
TEST_SPLIT = DATA / "test_split"
# test-split sources moved to the development set by a model change made after looking at their runs (the folder's
# README says which, and why)
DEVELOPMENT = DATA / "development"

KINDS = ("training", "serving")
UNITS = {
    "training": ("s/step", "tokens/s/chip", "mfu"),
    "serving": ("s/token", "s/prefill"),
}
GRADES = ("A", "B", "C")
STATISTICS = ("mean", "median")  # over a loaded run's requests
# run fields with a closed set of values (the inference estimator's MOE_WEIGHTS and TP_ALLREDUCES), checked here so a
# file's typo is named by its row before any pricing
CHOICES = {"moe_weights": ("all", "routed"), "tp_allreduce": ("custom", "nccl")}
SOURCE_FIELDS = {"key": str, "cite": str, "url": str, "grade": str, "stack": str, "assumed": str, "rule": str}
SOURCE_REQUIRED = ("key", "cite", "grade", "stack", "rule")
TRAIN_LAYOUT = {
    "dp": int,
    "fsdp": int,
    "tp": int,
    "pp": int,
    "cp": int,
    "ep": int,
    "zero": int,
    "sequence_parallel": bool,
    "pp_schedule": str,
    "interleave": int,
    "pp_embedding_slots": bool,
    "cross_node": list,
}
# serving under load: ``concurrency`` clients (closed loop) or Poisson ``rate`` requests/s (open loop), ``requests``
# sent in all; the engine's ``token_budget`` (tokens a step: chunked-prefill size / max_num_batched_tokens) and
# ``max_seqs`` (running requests at most) where the source states them
SERVE_LAYOUT = {
    "tp": int,
    "batch": int,
    "prompt": int,
    "generated": int,
    "concurrency": int,
    "rate": float,
    "requests": int,
    "token_budget": int,
    "max_seqs": int,
}
SERVE_REQUIRED = ("tp", "batch", "prompt", "generated")
# fields a file may not set: the loader fills them from [source]
FROM_SOURCE = ("source", "grade", "split", "source_key")


def _fields() -> dict[str, object]:
    return {f.name: f for f in dataclasses.fields(PublicRun)}


def _typed(where: str, name: str, value: object, want: type) -> None:
    ok = isinstance(value, want) and not (want is int and isinstance(value, bool))
    if want is float:
        ok = isinstance(value, int | float) and not isinstance(value, bool)
    if not ok:
        raise UserError(f"{where}: {name} must be {want.__name__}, got {value!r}")


def _annotation_type(field) -> type:
    text = str(field.type)
    for name, typ in (("dict", dict), ("bool", bool), ("int", int), ("float", float), ("str", str)):
        if text.startswith(name):
            return typ
    return object


def _check_layout(where: str, kind: str, layout: object) -> None:
    if not isinstance(layout, dict):
        raise UserError(f"{where}: layout must be a table, got {layout!r}")
    allowed = TRAIN_LAYOUT if kind == "training" else SERVE_LAYOUT
    for k, v in layout.items():
        if k not in allowed:
            raise UserError(f"{where}: layout.{k} is not a {kind} layout field; valid: {', '.join(allowed)}")
        _typed(where, f"layout.{k}", v, allowed[k])
        if allowed[k] is int and v < (0 if k == "zero" else 1):
            raise UserError(f"{where}: layout.{k} must be positive, got {v!r}")
        if allowed[k] is float and not 0 < v < float("inf"):
            raise UserError(f"{where}: layout.{k} must be a positive, finite number, got {v!r}")
    if kind == "serving":
        missing = [k for k in SERVE_REQUIRED if k not in layout]
        if missing:
            raise UserError(f"{where}: a serving layout needs {', '.join(missing)}")
        if "concurrency" in layout and "rate" in layout:
            raise UserError(f"{where}: a load is concurrency (clients) or rate (requests/s), not both")


def _check_catalog(where: str, run: PublicRun) -> None:
    from lab.core.hardware import get_chip
    from lab.core.models import get_model

    if run.expressible:
        return
    for what, name, get in (("chip", run.chip, get_chip), ("model", run.model, get_model)):
        try:
            get(name)
        except (UserError, KeyError) as exc:
            raise UserError(
                f'{where}: {what} {name!r} is not in the catalog; give expressible = "..." saying so ({exc})'
            ) from None


def parse(text: str, path: str = "<text>", split: str = "test") -> tuple[PublicRun, ...]:
    """The runs of one source file's ``text`` (see the module docstring)."""
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise UserError(f"{path}: not TOML ({exc})") from None
    unknown = set(doc) - {"source", "run"}
    if unknown:
        raise UserError(f"{path}: unknown top-level key {sorted(unknown)[0]!r}; a file has [source] and [[run]]")
    src = doc.get("source")
    if not isinstance(src, dict):
        raise UserError(f"{path}: no [source] table")
    for k, v in src.items():
        if k not in SOURCE_FIELDS:
            raise UserError(f"{path}: [source] {k} is not a source field; valid: {', '.join(SOURCE_FIELDS)}")
        _typed(f"{path} [source]", k, v, SOURCE_FIELDS[k])
    for k in SOURCE_REQUIRED:
        if not src.get(k):
            raise UserError(f"{path}: [source] needs {k}")
    if src["grade"] not in GRADES:
        raise UserError(f"{path}: [source] grade {src['grade']!r} is not one of {', '.join(GRADES)}")
    runs = doc.get("run")
    if not isinstance(runs, list) or not runs:
        raise UserError(f"{path}: no [[run]] tables")
    fields = _fields()
    out = []
    for i, row in enumerate(runs):
        where = f"{path} run {row.get('case_id', i + 1)}"
        for k, v in row.items():
            if k in FROM_SOURCE or k not in fields:
                valid = ", ".join(n for n in fields if n not in FROM_SOURCE)
                raise UserError(f"{where}: {k} is not a run field; valid: {valid}")
            _typed(where, k, v, _annotation_type(fields[k]))
        kind = row.get("kind")
        if kind not in KINDS:
            raise UserError(f"{where}: kind {kind!r} is not one of {', '.join(KINDS)}")
        if row.get("unit") not in UNITS[kind]:
            raise UserError(f"{where}: unit {row.get('unit')!r} is not one of {', '.join(UNITS[kind])}")
        _check_layout(where, kind, row.get("layout", {}))
        for k, valid in CHOICES.items():
            if k in row and row[k] not in valid:
                raise UserError(f"{where}: {k} {row[k]!r} is not one of {', '.join(valid)}")
        if row.get("statistic", "mean") not in STATISTICS:
            raise UserError(f"{where}: statistic {row['statistic']!r} is not one of {', '.join(STATISTICS)}")
        if not (isinstance(row.get("measured"), int | float) and row["measured"] > 0):
            raise UserError(f"{where}: measured must be a positive number, got {row.get('measured')!r}")
        if kind == "serving":
            lay = row["layout"]
            row.setdefault("seq_len", lay["prompt"] + lay["generated"])
            row.setdefault("global_batch", lay["batch"])
            row.setdefault("microbatch", lay["batch"])
            row.setdefault("remat", "none")
        missing = [
            n for n, f in fields.items() if n not in row and n not in FROM_SOURCE and n != "stack" and _required(f)
        ]
        if missing:
            raise UserError(f"{where}: missing {', '.join(missing)}")
        stack = row.pop("stack", None) or src["stack"]
        run = PublicRun(
            **row,
            source=src["cite"] + (f" ({src['url']})" if src.get("url") else ""),
            grade=src["grade"],
            stack=stack,
            split=split,
            source_key=src["key"],
        )
        if src.get("assumed"):  # the source's assumptions, then the run's own
            run = dataclasses.replace(run, assumed="; ".join(a for a in (src["assumed"], run.assumed) if a))
        _check_catalog(where, run)
        out.append(run)
    return tuple(out)


def _required(field) -> bool:
    return field.default is dataclasses.MISSING and field.default_factory is dataclasses.MISSING


def load(path: Path, split: str = "test") -> tuple[PublicRun, ...]:
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise UserError(f"{path}: cannot read ({exc.strerror})") from None
    return parse(text, str(path), split)


def load_folder(folder: Path = TEST_SPLIT, split: str = "test") -> tuple[PublicRun, ...]:
    """Every run of every ``*.toml`` in ``folder``, files in name order; case ids must be unique."""
    runs: list[PublicRun] = []
    for path in sorted(Path(folder).glob("*.toml")):
        runs.extend(load(path, split))
    seen: set[str] = set()
    for r in runs:
        if r.case_id in seen:
            raise UserError(f"{folder}: case {r.case_id} appears twice")
        seen.add(r.case_id)
    return tuple(runs)


def main(argv: list[str]) -> int:
    """Check source files without predicting anything: one line a file."""
    if not argv:
        print("usage: python -m lab.studies.run_files FILE.toml...", file=sys.stderr)
        return 2
    bad = 0
    for arg in argv:
        try:
            runs = load(Path(arg))
        except UserError as exc:
            print(f"error: {exc}", file=sys.stderr)
            bad += 1
            continue
        kinds = {k: sum(r.kind == k for r in runs) for k in KINDS}
        print(
            f"{arg}: {len(runs)} runs ({kinds['training']} training, {kinds['serving']} serving), "
            f"{sum(bool(r.expressible) for r in runs)} marked not expressible"
        )
    return 2 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
