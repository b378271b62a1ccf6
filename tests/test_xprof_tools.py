"""lab.measure.xprof_tools: TensorBoard profile-plugin links for a run, and the plugin's HLO op stats.

The links need no plugin. What each tool shows on an emulated CPU run is checked against the installed plugin's
own converter (``xprof.convert.raw_to_tool_data.xspace_to_tool_data``) on a freshly recorded trace; those tests
skip only where the plugin is not installed. The converter writes caches beside the ``.xplane.pb`` it reads, so
the tests convert a copy.
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from urllib.parse import parse_qs, quote, urlsplit

import pytest

from lab.core.errors import UserError
from lab.measure import xprof_tools
from lab.measure.profile import record
from lab.measure.xprof_tools import TOOLS, hlo_stats, run_name, tool_links

PLUGIN = "xprof.convert.raw_to_tool_data"
NO_PLUGIN = "the TensorBoard profile plugin (xprof / tensorboard-plugin-profile) is not installed"
EMPTY_ON_CPU = {"op_profile", "hlo_stats", "roofline_model"}


@pytest.fixture(scope="module")
def cpu_run(jax_devices, tmp_path_factory):
    import jax
    import jax.numpy as jnp

    fn = jax.jit(lambda x: jnp.tanh(x @ x) + 1)
    return record(fn, (jnp.ones((32, 32)),), tmp_path_factory.mktemp("tb"), repeats=2)


def _convert(tmp_path, xplane: str, tool: str, params: dict | None = None):
    """The converter's answer for ``tool`` on a copy of ``xplane`` (None, text, or the exception raised)."""
    convert = pytest.importorskip(PLUGIN, reason=NO_PLUGIN).xspace_to_tool_data
    copy = tmp_path / os.path.basename(xplane)
    if not copy.exists():
        shutil.copyfile(xplane, copy)
    try:
        data, _ = convert([str(copy)], tool, {"use_saved_result": False, **(params or {})})
    except ValueError as e:
        return e
    return data.decode() if isinstance(data, bytes) else data


# ----- links ---------------------------------------------------------------------------------------------------


def test_tools_are_the_seven_a_run_opens_with():
    assert [t.id for t in TOOLS] == [
        "trace_viewer@",
        "overview_page",
        "op_profile",
        "hlo_stats",
        "roofline_model",
        "memory_viewer",
        "graph_viewer",
    ]
    assert len({t.name for t in TOOLS}) == len(TOOLS)


def test_tool_links_name_every_tool_and_the_run(cpu_run):
    run = os.path.basename(cpu_run.run_dir)
    links = tool_links(cpu_run.run_dir, "cpu")
    assert [link["tool"] for link in links] == [t.id for t in TOOLS]
    assert [link["name"] for link in links] == [t.name for t in TOOLS]
    for link in links:
        url = urlsplit(link["url"])
        assert (url.scheme, url.netloc, url.path, url.fragment) == ("http", "localhost:6006", "/", "profile")
        assert parse_qs(url.query) == {"tool": [link["tool"]], "run": [run]}
    assert links[0]["url"] == f"http://localhost:6006/?tool=trace_viewer%40&run={run}#profile"
    # What record returned works as well as its run folder; port and host are the caller's.
    assert tool_links(cpu_run, "cpu") == links
    other = tool_links(cpu_run, "gpu", 7007, host="127.0.0.1")
    assert all(link["url"].startswith("http://127.0.0.1:7007/?tool=") for link in other)


def test_cpu_reasons_only_on_cpu(cpu_run):
    cpu = {link["tool"]: link["empty_on_cpu"] for link in tool_links(cpu_run, "cpu")}
    assert {tool for tool, why in cpu.items() if why} == EMPTY_ON_CPU
    assert all("XLA:CPU" in cpu[tool] and "\n" not in cpu[tool] for tool in EMPTY_ON_CPU)
    for backend in ("gpu", "tpu"):
        assert all(link["empty_on_cpu"] is None for link in tool_links(cpu_run, backend))


def test_run_name_relative_to_the_tensorboard_logdir(tmp_path):
    run_dir = tmp_path / "runs" / "r1" / "tensorboard" / "plugins" / "profile" / "2025_01_02_03_04_05"
    run_dir.mkdir(parents=True)
    assert run_name(run_dir) == "2025_01_02_03_04_05"
    assert run_name(run_dir, tmp_path / "runs" / "r1" / "tensorboard") == "2025_01_02_03_04_05"
    assert run_name(run_dir, tmp_path / "runs") == "r1/tensorboard/2025_01_02_03_04_05"
    link = tool_links(run_dir, "cpu", logdir=tmp_path / "runs")[0]["url"]
    assert f"run={quote('r1/tensorboard/2025_01_02_03_04_05', safe='')}#" in link
    with pytest.raises(UserError, match="not under the TensorBoard logdir"):
        run_name(run_dir, tmp_path / "elsewhere")
    with pytest.raises(UserError, match="not a profile run folder"):
        tool_links(tmp_path / "runs", "cpu")


# ----- what the plugin's converter does with an emulated CPU run -------------------------------------------------


def test_the_plugin_lists_every_tool_for_a_jax_run(cpu_run, tmp_path):
    convert = pytest.importorskip(PLUGIN, reason=NO_PLUGIN)
    copy = tmp_path / os.path.basename(cpu_run.xplane)
    shutil.copyfile(cpu_run.xplane, copy)
    listed = convert.xspace_to_tool_names([str(copy)])
    assert {t.id for t in TOOLS} <= set(listed), listed


def test_the_cpu_reasons_are_what_the_converter_returns(cpu_run, tmp_path):
    xplane = cpu_run.xplane
    # Empty on CPU: no device ops.
    op_profile = json.loads(_convert(tmp_path, xplane, "op_profile"))
    assert op_profile["deviceType"] == "CPU_ONLY" and op_profile["byProgram"]["children"] == []
    stats = json.loads(_convert(tmp_path, xplane, "hlo_stats"))
    assert "hlo_op_name" in [c["id"] for c in stats["cols"]] and stats["rows"] == []
    roofline = json.loads(_convert(tmp_path, xplane, "roofline_model"))
    assert all(table.get("rows", []) == [] for table in roofline)
    assert float(roofline[0]["p"]["peak_flop_rate"]) == 0
    # Data on CPU: the host threads, the step-time graph, and the HLO of each module the trace carries.
    trace = json.loads(_convert(tmp_path, xplane, "trace_viewer@"))
    processes = [e["args"]["name"] for e in trace["traceEvents"] if e.get("name") == "process_name"]
    assert processes and all(p.endswith("/host:CPU") for p in processes)  # host threads only, no device plane
    assert {"step 0", "step 1"} <= {e.get("name") for e in trace["traceEvents"] if e.get("ph") == "X"}
    overview = json.loads(_convert(tmp_path, xplane, "overview_page"))
    steps = overview[1]
    assert steps["p"]["hardware_type"] == "CPU_ONLY" and len(steps["rows"]) == 2
    # The plugin's module list: listing the tools writes each module's <name>.hlo_proto.pb beside the xplane.
    pytest.importorskip(PLUGIN, reason=NO_PLUGIN).xspace_to_tool_names([str(tmp_path / os.path.basename(xplane))])
    modules = [os.path.basename(p)[: -len(".hlo_proto.pb")] for p in glob.glob(str(tmp_path / "*.hlo_proto.pb"))]
    jit = [m for m in modules if m.startswith("jit__lambda")]
    assert jit, modules
    memory = json.loads(_convert(tmp_path, xplane, "memory_viewer", {"module_name": jit[0]}))
    assert memory["maxHeap"]
    graph = _convert(
        tmp_path, xplane, "graph_viewer", {"graph_viewer_options": {"module_name": jit[0], "type": "long_txt"}}
    )
    assert isinstance(graph, str) and graph.startswith("HloModule jit__lambda")
    # Without a module (the UI picks one from its module list) both answer nothing.
    assert _convert(tmp_path, xplane, "memory_viewer") is None
    assert isinstance(_convert(tmp_path, xplane, "graph_viewer"), ValueError)


# ----- hlo_stats -----------------------------------------------------------------------------------------------


def test_hlo_stats_is_none_on_cpu_and_leaves_the_run_folder_alone(cpu_run):
    pytest.importorskip(PLUGIN, reason=NO_PLUGIN)
    before = sorted(os.listdir(cpu_run.run_dir))
    assert hlo_stats(cpu_run.xplane) is None  # the converter's table has columns and no rows on CPU
    assert hlo_stats(cpu_run) is None
    assert sorted(os.listdir(cpu_run.run_dir)) == before


def test_hlo_stats_of_an_unreadable_file_is_none_and_of_no_file_an_error(tmp_path):
    pytest.importorskip(PLUGIN, reason=NO_PLUGIN)
    bad = tmp_path / "host.xplane.pb"
    bad.write_bytes(b"\x00\x01garbage\xff")
    assert hlo_stats(bad) is None
    with pytest.raises(UserError, match=r"no \.xplane\.pb"):
        hlo_stats(tmp_path / "missing.xplane.pb")


def test_hlo_stats_without_the_plugin_is_none(cpu_run, monkeypatch):
    monkeypatch.setattr(xprof_tools, "_converter", lambda: None)
    assert hlo_stats(cpu_run.xplane) is None


def test_rows_of_a_converter_table():
    table = {
        "cols": [{"id": "rank"}, {"id": "hlo_op_name"}, {"id": "total_self_time"}],
        "rows": [{"c": [{"v": 1}, {"v": "fusion.3"}, {"v": 12.5}]}, {"c": [{"v": 2}, {"v": "all-reduce.1"}, {}]}],
    }
    expected = [
        {"rank": 1, "hlo_op_name": "fusion.3", "total_self_time": 12.5},
        {"rank": 2, "hlo_op_name": "all-reduce.1", "total_self_time": None},
    ]
    assert xprof_tools._rows(json.dumps(table)) == expected
    assert xprof_tools._rows(json.dumps(table).encode()) == expected
    assert xprof_tools._rows(json.dumps([table, {"cols": [], "rows": []}])) == expected
    assert xprof_tools._rows(json.dumps({"cols": table["cols"], "rows": []})) is None
    for nothing in (None, b"", "{not json", "[]", "3"):
        assert xprof_tools._rows(nothing) is None


# ----- TensorBoard itself (slow: starts a server) ----------------------------------------------------------------


def _get_json(url: str):
    import gzip

    with urllib.request.urlopen(url, timeout=10) as resp:
        body = resp.read()
    return json.loads(gzip.decompress(body) if body[:2] == b"\x1f\x8b" else body)


@pytest.mark.slow
def test_tensorboard_serves_the_run_and_every_tool_under_the_linked_names(cpu_run, tmp_path):
    pytest.importorskip(PLUGIN, reason=NO_PLUGIN)
    logdir = tmp_path / "logs"
    shutil.copytree(os.path.dirname(os.path.dirname(os.path.dirname(cpu_run.run_dir))), logdir / "job")
    run_dir = logdir / "job" / "plugins" / "profile" / os.path.basename(cpu_run.run_dir)
    links = tool_links(run_dir, "cpu", logdir=logdir)
    run = parse_qs(urlsplit(links[0]["url"]).query)["run"][0]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    exe = os.path.join(os.path.dirname(sys.executable), "tensorboard")
    cmd = [exe, "--logdir", str(logdir), "--host", "127.0.0.1", "--port", str(port)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        base = f"http://127.0.0.1:{port}/data/plugin/profile"
        runs, deadline = [], time.time() + 90
        while not runs and time.time() < deadline:
            try:
                runs = _get_json(f"{base}/runs")
            except (OSError, ValueError):
                time.sleep(0.5)
        assert runs == [run]
        listed = _get_json(f"{base}/run_tools?run={quote(run, safe='')}")
        assert {link["tool"] for link in links} <= set(listed), listed
    finally:
        proc.terminate()
        proc.wait(timeout=20)


def test_xprofs_self_times_join_the_ledger_by_hlo_op_name():
    from lab.run.point import _trim, _xprof_rows, xprof_self_times

    rows = [
        {"hlo_op_name": "fusion.3", "avg_self_time": 12.5, "total_self_time": 75.0, "category": "convolution"},
        {"hlo_op_name": "all-reduce.1", "avg_self_time": 40.0, "total_self_time": 240.0, "category": "all-reduce"},
        {"hlo_op_name": "", "avg_self_time": 1.0},
        {"hlo_op_name": "copy", "avg_self_time": "n/a"},
    ]
    assert xprof_self_times(rows) == pytest.approx({"fusion.3": 12.5e-6, "all-reduce.1": 40.0e-6}, rel=1e-12)
    top = _trim(rows, limit=1)
    assert top == [
        {
            "hlo_op_name": "all-reduce.1",
            "category": "all-reduce",
            "occurrences": None,
            "avg_self_time": 40.0,
            "total_self_time": 240.0,
            "bound_by": None,
        }
    ]
    assert _xprof_rows(None, "gpu") is None and _trim(None) is None
