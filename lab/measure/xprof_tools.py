"""Links into TensorBoard's profile plugin (xprof) for one recorded run, and its per-HLO-op table.

**Tools and their ids.** The plugin (``tensorboard-plugin-profile`` 2.24, a shim over ``xprof``) names its tools
by id; :data:`TOOLS` holds the ones a run of the lab should be opened with, under the ids the installed plugin's
``/data/plugin/profile/run_tools`` lists for a JAX ``.xplane.pb`` (``trace_viewer@`` is the streaming trace viewer,
which the plugin lists instead of ``trace_viewer``; HLO op stats is ``hlo_stats``, its name in ``XPLANE_TOOLS``).

**URLs.** TensorBoard serves the plugin at ``#profile``; the plugin's frontend reads ``run`` and ``tool`` (or
``tag``) from the query string of the TensorBoard page, and builds its own cross-tool links as
``<origin>?tool=<id>&run=<run>#profile``. A profile run's name is its run folder (``2025_01_02_03_04_05``) when
TensorBoard's ``--logdir`` is the folder holding ``plugins/profile/``, else that folder's path relative to the
logdir, then the run folder (``tensorboard/2025_01_02_03_04_05``).

**On an emulated CPU run** (verified with xprof 2.24.2 on a ``jax.profiler.trace`` of XLA:CPU, through
``xprof.convert.raw_to_tool_data.xspace_to_tool_data``): XLA:CPU runs HLO as thunks on host threads and the
XSpace has no device plane, so op profile (``deviceType: CPU_ONLY``, no children), HLO op stats (a table with
columns and no rows) and roofline (no rows, peak FLOP rate and bandwidths 0) are empty. The trace viewer shows the
host threads; the overview page has its step-time graph, all of it host compute; the memory viewer (XLA's buffer
assignment) and the graph viewer (the HLO graph) read the HLO protos the XSpace carries, so they have data once a
module is picked (the converter returns nothing without one). ``memory_profile`` (allocator events; not in
:data:`TOOLS`) is empty on CPU too.

The converter writes caches (``ALL_HOSTS.op_stats_v2.pb``, ``*.hlo_proto.pb``, ``*.SSTABLE``) beside the
``.xplane.pb`` it reads, even with ``use_saved_result`` off; :func:`hlo_stats` therefore converts a copy in a
temporary folder and leaves the run folder as it was. Nothing here imports the plugin at import time.
"""

from __future__ import annotations

import importlib
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from urllib.parse import urlencode

from lab.core.errors import UserError
from lab.measure.trace import TraceFiles

_NO_DEVICE_OPS = "XLA:CPU runs HLO as host thunks and the trace has no device plane"


@dataclass(frozen=True)
class Tool:
    """One tool of the profile plugin: its id (the ``tool=`` of its URL), its name in the plugin's menu, and why it
    shows nothing on an emulated CPU run (None where it shows data there)."""

    id: str
    name: str
    empty_on_cpu: str | None


TOOLS: tuple[Tool, ...] = (
    Tool("trace_viewer@", "Trace Viewer", None),
    Tool("overview_page", "Overview Page", None),
    Tool("op_profile", "Op Profile", f"no device ops to profile: {_NO_DEVICE_OPS}"),
    Tool("hlo_stats", "HLO Op Stats", f"the table has no rows: {_NO_DEVICE_OPS}"),
    Tool(
        "roofline_model", "Roofline Model", f"no device ops and no device peak FLOP rate or bandwidth: {_NO_DEVICE_OPS}"
    ),
    Tool("memory_viewer", "Memory Viewer", None),
    Tool("graph_viewer", "Graph Viewer", None),
)


def _run_dir(run_dir: TraceFiles | str | os.PathLike) -> str:
    path = run_dir.run_dir if isinstance(run_dir, TraceFiles) else os.fspath(run_dir)
    path = os.path.abspath(path)
    parent = os.path.dirname(path)
    if os.path.basename(parent) != "profile" or os.path.basename(os.path.dirname(parent)) != "plugins":
        raise UserError(f"{path!r} is not a profile run folder (<logdir>/plugins/profile/<run>)")
    return path


def run_name(run_dir: TraceFiles | str | os.PathLike, logdir: str | os.PathLike | None = None) -> str:
    """The name TensorBoard's profile plugin gives the run in ``run_dir`` when started with ``--logdir logdir``.

    ``logdir`` defaults to the folder holding ``plugins/profile/`` (what ``record`` was given).

    Raises:
        UserError: ``run_dir`` is not ``<folder>/plugins/profile/<run>``, or it lies outside ``logdir``.
    """
    path = _run_dir(run_dir)
    holder = os.path.dirname(os.path.dirname(os.path.dirname(path)))
    if logdir is None:
        return os.path.basename(path)
    rel = os.path.relpath(holder, os.path.abspath(os.fspath(logdir)))
    if rel == os.pardir or rel.startswith(os.pardir + os.sep):
        raise UserError(f"the run folder {path!r} is not under the TensorBoard logdir {os.fspath(logdir)!r}")
    parts = [] if rel == os.curdir else rel.split(os.sep)
    return "/".join([*parts, os.path.basename(path)])


def tool_links(
    run_dir: TraceFiles | str | os.PathLike,
    backend: str,
    port: int = 6006,
    *,
    host: str = "localhost",
    logdir: str | os.PathLike | None = None,
) -> list[dict]:
    """One link per tool of :data:`TOOLS`, for the profile run in ``run_dir``.

    Args:
        run_dir: the run folder (``<logdir>/plugins/profile/<run>``) or what ``profile.record`` returned.
        backend: the backend the trace was recorded on (``Trace.backend``: ``cpu``, ``gpu``, ``tpu``).
        port, host: where TensorBoard serves (``tensorboard --logdir ... --port``).
        logdir: the ``--logdir`` TensorBoard is started with; by default the folder holding ``plugins/``.

    Returns:
        ``{"tool": id, "name": name, "url": ..., "empty_on_cpu": reason or None}`` per tool, in :data:`TOOLS`
        order; ``empty_on_cpu`` is None for every tool unless ``backend`` is ``cpu``.

    Raises:
        UserError: ``run_dir`` is not a profile run folder (or not under ``logdir``).
    """
    run = run_name(run_dir, logdir)
    on_cpu = backend.lower() == "cpu"
    return [
        {
            "tool": t.id,
            "name": t.name,
            "url": f"http://{host}:{port}/?{urlencode({'tool': t.id, 'run': run})}#profile",
            "empty_on_cpu": t.empty_on_cpu if on_cpu else None,
        }
        for t in TOOLS
    ]


def _converter():
    """``xspace_to_tool_data`` of the installed plugin, or None."""
    for module in ("xprof.convert.raw_to_tool_data", "tensorboard_plugin_profile.convert.raw_to_tool_data"):
        try:
            mod = importlib.import_module(module)
        except ImportError:
            continue
        fn = getattr(mod, "xspace_to_tool_data", None)
        if fn is not None:
            return fn
    return None


def _rows(data: bytes | str | None) -> list[dict] | None:
    """The rows of a converter table (``{"cols": [{"id": ...}], "rows": [{"c": [{"v": ...}]}]}``) as dicts keyed by
    column id; None when there is no table or it has no rows."""
    if data is None:
        return None
    try:
        table = json.loads(data)
    except (TypeError, ValueError):
        return None
    if isinstance(table, list):  # some tools answer a list of tables; HLO op stats answers one
        table = table[0] if table else None
    if not isinstance(table, dict):
        return None
    ids = [c.get("id") for c in table.get("cols") or []]
    out = []
    for row in table.get("rows") or []:
        cells = (row.get("c") or []) if isinstance(row, dict) else []
        out.append({k: (c.get("v") if isinstance(c, dict) else None) for k, c in zip(ids, cells, strict=False)})
    return out or None


def hlo_stats(xplane_path: TraceFiles | str | os.PathLike) -> list[dict] | None:
    """Per-HLO-op device statistics from the profile plugin's ``hlo_stats`` converter.

    Each row is a dict keyed by the converter's column ids; in xprof 2.24 these are ``rank``, ``program_id``,
    ``category`` (HLO op category), ``hlo_op_name``, ``hlo_op_expression`` (the HLO text), ``tf_op_name`` (the
    framework op, e.g. the JAX name stack), ``occurrences``, ``total_time``, ``avg_time``, ``total_self_time``,
    ``avg_self_time`` (microseconds), ``total_self_time_percent``, ``cumulative_total_self_time_percent``,
    ``dma_stall_percent``, ``model_flop_rate``, ``normalized_flop_rate`` (GFLOP/s), ``measured_memory_bw``,
    ``hbm_bw``, ``cmem_read_bw``, ``cmem_write_bw`` (GiB/s), ``operational_intensity`` (FLOP/byte), ``bound_by``,
    ``hlo_rematerialization``, ``outside_compilation``, ``autotuned``, ``source_info``, ``core_type``,
    ``parent_op_name`` and ``vdd_energy`` (J). Another plugin version may add or drop columns.

    Returns None where the plugin (``xprof`` / ``tensorboard-plugin-profile``) is not installed, where the
    converter fails (an unreadable file) and where its table has no rows: always on an emulated CPU trace, whose
    ops are host thunks, not device ops. The file is converted as a copy in a temporary folder, since the
    converter writes its caches beside what it reads.

    Args:
        xplane_path: a ``<host>.xplane.pb``, or what ``profile.record`` returned.

    Raises:
        UserError: no such file.
    """
    path = xplane_path.xplane if isinstance(xplane_path, TraceFiles) else os.fspath(xplane_path)
    if not path or not os.path.isfile(path):
        raise UserError(f"no .xplane.pb at {path!r}")
    convert = _converter()
    if convert is None:
        return None
    with tempfile.TemporaryDirectory(prefix="shardlab-xprof-") as tmp:
        copy = os.path.join(tmp, os.path.basename(path))
        shutil.copyfile(path, copy)
        try:
            data, _ = convert([copy], "hlo_stats", {"use_saved_result": False})
        except (ValueError, RuntimeError, OSError):
            return None
    return _rows(data)


__all__ = ["TOOLS", "Tool", "hlo_stats", "run_name", "tool_links"]
