"""Start-up of the analytic commands (lab.cli.fast_start): the cached dataclass methods are the ones ``dataclasses``
compiles, are read and written where bytecode is, and change nothing a command prints."""

import json
import marshal
import os
import subprocess
import sys
import textwrap

RECORDS = '''
from __future__ import annotations

import dataclasses
from dataclasses import InitVar, dataclass, field
from typing import ClassVar


@dataclass(frozen=True)
class Chip:
    """A frozen record (hashable)."""

    name: str
    peaks: tuple = ()
    links: int = 4
    KIND: ClassVar[str] = "chip"


@dataclass(order=True)
class Point:
    """Ordered, with a default factory, an InitVar and a post-init."""

    x: float
    y: float = 0.0
    history: list = field(default_factory=list)
    scale: InitVar[float] = 1.0
    norm: float = field(init=False, default=0.0)

    def __post_init__(self, scale):
        self.norm = scale * (self.x**2 + self.y**2) ** 0.5


@dataclass(frozen=True, kw_only=True)
class Opts:
    """Keyword-only, frozen."""

    depth: int
    tags: tuple = ()
'''

DRIVER = """
import dataclasses, inspect, json, sys
from lab.cli.fast_start import cache_dataclass_methods
if sys.argv[1] == "cached":
    cache_dataclass_methods(packages=("records",))
elif sys.argv[1] == "lab-only":
    cache_dataclass_methods()
sys.path.insert(0, sys.argv[2])
import records as r
a, b = r.Chip("h100"), r.Chip("h100")
try:
    a.links = 8
    frozen = "assigned"
except dataclasses.FrozenInstanceError as e:
    frozen = type(e).__name__
p, q = r.Point(3.0, 4.0, scale=2.0), r.Point(3.0, 5.0)
o = r.Opts(depth=2)
print(json.dumps({
    "repr": [repr(a), repr(p), repr(o)],
    "eq": [a == b, p.history is not q.history, p == r.Point(3.0, 4.0, scale=2.0), p < q, hash(a) == hash(b)],
    "frozen": frozen,
    "norm": p.norm,
    "signatures": [str(inspect.signature(c)) for c in (r.Chip, r.Point, r.Opts)],
    "init_annotations": [repr(c.__init__.__annotations__) for c in (r.Chip, r.Point, r.Opts)],
    "fields": [[f.name for f in dataclasses.fields(c)] for c in (r.Chip, r.Point, r.Opts)],
    "methods": sorted(n for n in vars(r.Chip) if n.startswith("__") and callable(getattr(r.Chip, n))),
}))
"""


def run_records(tmp_path, mode: str, write: bool = True):
    """The records module's behaviour, with or without the cache."""
    (tmp_path / "records.py").write_text(RECORDS)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    if not write:
        env["PYTHONDONTWRITEBYTECODE"] = "1"
    r = subprocess.run(
        [sys.executable, "-c", DRIVER, mode, str(tmp_path)], capture_output=True, text=True, env=env, timeout=60
    )
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def table_of(tmp_path):
    return next((tmp_path / "__pycache__").glob("records.*.dataclass-methods"), None)


def test_cached_methods_behave_as_the_compiled_ones_and_are_compiled_once(tmp_path):
    plain = run_records(tmp_path, "plain", write=False)
    first = run_records(tmp_path, "cached")
    table = table_of(tmp_path)
    assert table is not None
    written = (table.read_bytes(), table.stat().st_mtime_ns)
    second = run_records(tmp_path, "cached")
    assert first == plain and second == plain
    assert plain["frozen"] == "FrozenInstanceError" and plain["eq"] == [True, True, True, True, True]
    # the generated annotations are the classes' own strings, not ``from __future__`` of the caching module
    assert plain["init_annotations"][0] == "{'name': 'str', 'peaks': 'tuple', 'links': 'int', 'return': None}"
    # every class's __init__, __repr__ and __eq__, the frozen ones' __hash__, __setattr__ and __delattr__, and
    # the ordered one's four comparisons: one text each (from 3.13 dataclasses writes a class's methods as one)
    assert len(marshal.loads(written[0])) == (3 * 3 + 2 * 3 + 4 if sys.version_info < (3, 13) else 3)
    # the second run found every method in the table: nothing missed, so nothing was written again
    assert (table.read_bytes(), table.stat().st_mtime_ns) == written


def test_a_damaged_table_is_ignored_and_replaced(tmp_path):
    run_records(tmp_path, "cached")
    table = table_of(tmp_path)
    whole = marshal.loads(table.read_bytes())
    table.write_bytes(b"not marshal data")
    assert run_records(tmp_path, "cached") == run_records(tmp_path, "plain", write=False)
    assert marshal.loads(table.read_bytes()).keys() == whole.keys()


def test_a_changed_class_compiles_anew_and_drops_its_old_methods(tmp_path):
    run_records(tmp_path, "cached")
    (tmp_path / "records.py").write_text(RECORDS.replace("links: int = 4", "links: int = 4\n    ports: int = 2"))
    before = marshal.loads(table_of(tmp_path).read_bytes())
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    code = "from lab.cli.fast_start import cache_dataclass_methods as c\nc(('records',))\nimport records\n"
    code += "print(records.Chip('x'))"
    r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, env=env, timeout=60)
    assert r.stdout.strip() == "Chip(name='x', peaks=(), links=4, ports=2)", r.stderr
    after = marshal.loads(table_of(tmp_path).read_bytes())
    assert len(after) == len(before) and after.keys() != before.keys()  # the old __init__ is gone, not kept


def test_nothing_is_written_where_python_writes_no_bytecode_or_beside_another_package(tmp_path):
    plain = run_records(tmp_path, "plain", write=False)
    assert run_records(tmp_path, "cached", write=False) == plain
    assert table_of(tmp_path) is None
    assert run_records(tmp_path, "lab-only") == plain  # the lab's classes only: records is someone else's
    assert table_of(tmp_path) is None and (tmp_path / "__pycache__").is_dir()


ESTIMATE = ["train", "estimate", "--model", "llama3-8b", "--hardware", "h100", "--chips", "8", "--json"]


def test_the_command_prints_the_same_with_the_cache_and_only_the_command_itself_installs_it(tmp_path):
    """``python -m lab`` (the process is the command's) caches, under PYTHONPYCACHEPREFIX when set, and freezes the
    collector after the work; ``main(argv)`` called from a program (a test, a notebook) leaves both alone."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    env["PYTHONPYCACHEPREFIX"] = str(tmp_path / "pyc")
    no_cache = {**env, "PYTHONDONTWRITEBYTECODE": "1"}
    outputs = [
        subprocess.run([sys.executable, "-m", "lab", *ESTIMATE], capture_output=True, text=True, env=e, timeout=60)
        for e in (no_cache, env, env)
    ]
    assert all(o.returncode == 0 for o in outputs), [o.stderr for o in outputs]
    assert outputs[0].stdout == outputs[1].stdout == outputs[2].stdout
    tables = {p.name.split(".")[0] for p in (tmp_path / "pyc").rglob("*.dataclass-methods")}
    assert {"models", "hardware", "train_config", "training"} <= tables
    probe = textwrap.dedent(f"""
        import contextlib, dataclasses, gc, io, sys
        from lab.cli.main import main
        with contextlib.redirect_stdout(io.StringIO()):
            rc = main({ESTIMATE!r})
        print(rc, "exec" in vars(dataclasses), gc.get_freeze_count())
        sys.argv = ["shardlab", *{ESTIMATE!r}]
        with contextlib.redirect_stdout(io.StringIO()):
            rc = main()
        print(rc, "exec" in vars(dataclasses), gc.get_freeze_count() > 0)
    """)
    r = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env, timeout=60)
    assert r.stdout.split("\n")[:2] == ["0 False 0", "0 True True"], r.stderr
