"""Start-up of the analytic commands: what Python does on every start that they can skip.

An analytic command (``hardware``, ``roofline``, ``train estimate``, ...) never starts JAX; its start-up is the
interpreter's plus the lab's imports. Measured with valgrind on Python 3.11 (``scripts/bench_startup
--instructions``), two costs of the standard library dominated those imports; both are done away with here without
changing what any class or module is:

- :func:`defer_inspect`: ``dataclasses`` imports ``inspect`` only to write a docstring for a dataclass that has none.
- :func:`cache_dataclass_methods`: ``dataclasses`` writes each class's ``__init__``, ``__repr__``, ``__eq__``,
  ``__hash__``, ``__setattr__`` and ``__delattr__`` as source text and compiles it, every start (the twelve classes on
  ``train estimate``'s path cost 65 M instructions of 237 M, nearly all of it Python's parser). The compiled code is
  kept, like a ``.pyc``, keyed by the exact source text, so a class whose fields change compiles anew.

A third is Python's own exit: its last garbage collection walks every object the imports made, which live until the
process ends anyway (:func:`skip_collection_at_exit`). The cache and the frozen collector took ``train estimate``
from 236.9 M to 164.5 M instructions (2.68x a bare ``python -c pass`` to 1.86x), ``hardware list`` from 1.75x to
1.50x.
"""

from __future__ import annotations

import contextlib
import marshal
import os
import sys
import types


def defer_inspect() -> None:
    """Load ``inspect`` on first use instead of at start-up.

    On Python 3.11 ``dataclasses`` imports ``inspect`` (and with it ``ast``, ``dis`` and ``tokenize``: about 8 ms, a
    sixth of an analytic command's start-up) only to write a signature as the docstring of a dataclass that has none.
    A stand-in module takes its place in ``sys.modules``; the first attribute anyone reads from it imports the real
    module and copies its namespace into the stand-in, so a module that imported the stand-in sees the real functions
    from then on. The analytic modules' dataclasses all have docstrings (tests/test_cli.py checks that nothing loads
    it). From 3.12 every dataclass reads its annotations through ``inspect``, so there is nothing to defer.
    """
    if "inspect" in sys.modules or sys.version_info >= (3, 12):
        return

    class _Deferred(types.ModuleType):
        def __getattr__(self, name: str):
            import importlib

            if sys.modules.get("inspect") is self:
                del sys.modules["inspect"]
            real = importlib.import_module("inspect")
            self.__dict__.update(real.__dict__)
            return getattr(real, name)

    sys.modules["inspect"] = _Deferred("inspect")


class _Methods:
    """The compiled methods of one module's dataclasses, kept beside that module's bytecode."""

    def __init__(self, module_file: str):
        import importlib.util

        self.known: dict = {}
        self.used: dict = {}
        self.missed = False
        try:
            self.path = importlib.util.cache_from_source(module_file)[: -len(".pyc")] + ".dataclass-methods"
        except NotImplementedError:  # an interpreter without bytecode caching: nothing to keep
            self.path = None
            return
        try:
            with open(self.path, "rb") as f:
                # at once: marshal.load reads a file object a few bytes a call
                self.known = marshal.loads(f.read())
            if not isinstance(self.known, dict):
                self.known = {}
        except (OSError, EOFError, ValueError, TypeError):  # none yet, unreadable, or another version's
            self.known = {}

    def code(self, source: str):
        code = self.known.get(source)
        if not isinstance(code, types.CodeType):
            # compiled as ``exec`` compiles it: without this module's ``__future__`` flags
            code = compile(source, "<string>", "exec", dont_inherit=True)
            self.missed = True
        self.used[source] = code
        return code

    def write(self) -> None:
        """Keep what this process used, if any of it was new (which drops the methods of fields since edited),
        atomically: a process writing the same file at the same time leaves one whole table or the other."""
        if not self.missed or self.path is None:
            return
        from lab.core.files import write_atomic  # at exit, and only after a miss

        with contextlib.suppress(OSError):  # a read-only install: every start compiles, as it would without the cache
            os.makedirs(os.path.dirname(self.path), exist_ok=True)
            write_atomic(self.path, marshal.dumps(self.used))


def cache_dataclass_methods(packages: tuple[str, ...] = ("lab",)) -> None:
    """Compile each method ``dataclasses`` generates once, not on every start.

    ``dataclasses`` turns each generated method's text into a function with the builtin ``exec``, looked up as a
    global of its module. A global ``exec`` there that finds the text's code object in a table of the class's module
    first (compiling and adding it when absent) gives the class the same functions: the same text compiled by the
    same interpreter, as ``exec`` compiles it. Each module's table is read once, beside its ``.pyc`` (and under
    ``PYTHONPYCACHEPREFIX`` when set), and written back at exit when it missed; not at all where Python writes no
    bytecode (``PYTHONDONTWRITEBYTECODE``). Only the classes of ``packages`` (the lab's own) are cached: nothing is
    written beside another package's bytecode. Call it only where the process is the command's own: it lasts until
    exit.
    """
    import dataclasses

    if "exec" in vars(dataclasses):
        return
    tables: dict[str, _Methods] = {}

    def cached_exec(source, globals=None, locals=None, /):
        ours = isinstance(source, str) and isinstance(globals, dict) and _in(globals.get("__name__"), packages)
        file = globals.get("__file__") if ours else None
        if not isinstance(file, str) or not file.endswith(".py"):  # compiled as always (not with our __future__)
            code = compile(source, "<string>", "exec", dont_inherit=True) if isinstance(source, str) else source
            return exec(code, globals, locals)
        if file not in tables:
            tables[file] = _Methods(file)
        return exec(tables[file].code(source), globals, locals)

    def write_all() -> None:
        for table in tables.values():
            table.write()

    dataclasses.exec = cached_exec
    if not sys.dont_write_bytecode:
        import atexit

        atexit.register(write_all)


def _in(module: object, packages: tuple[str, ...]) -> bool:
    return isinstance(module, str) and any(module == p or module.startswith(p + ".") for p in packages)


def skip_collection_at_exit() -> None:
    """Move every object alive now out of the garbage collector's reach (``gc.freeze``), once the command has done
    its work: the collection at interpreter exit then skips the modules, classes and functions the imports made
    (about 14 M instructions of ``train estimate``'s 177 M), which are freed with the process whatever it does.
    Objects made after this are collected as usual."""
    import gc

    gc.freeze()
