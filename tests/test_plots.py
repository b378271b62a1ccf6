"""The plots and the markdown report, read back from what they draw and write (not only that a file exists)."""

from __future__ import annotations

import math

import pytest
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.collections import LineCollection, PathCollection, PolyCollection
from matplotlib.text import Text

from lab.report import writer
from lab.report.plots import BAND, FAST_TEXT, bus_factor, figures, plots, step_bars

PEAKS = {"fp32": 4.0e13, "bf16": 1.6e14, "int8": 3.2e14}  # the int8 roof is the highest: an fp32 run must not use it


def _op(name, kind, predicted, measured, flops=0.0, nbytes=1e6, coll=0.0, spread=1.2, estimate=None, axes=None):
    ratio = measured / predicted if measured and predicted else None
    return {
        **({"axes": axes} if axes else {}),
        "name": name,
        "kind": kind,
        "predicted_s": predicted,
        "measured_s": measured,
        "ratio": ratio,
        "flops": flops,
        "bytes": nbytes,
        "collective_bytes": coll,
        "scope": "",
        "estimate_op": estimate,
        "spread": spread,
    }


def _report(ops, **extra):
    named = [
        {
            "name": "mlp/up",
            "kind": "matmul",
            "estimated_s": 2e-3,
            "predicted_s": 2e-3,
            "measured_s": 3e-3,
            "ratio": 1.5,
            "flops_estimated": 1e9,
            "flops_compiled": 1e9,
            "bytes_estimated": 0.0,
            "bytes_compiled": 1e6,
            "hlo_ops": 1,
        },
        {
            "name": "all-reduce over Y",
            "kind": "all-reduce",
            "estimated_s": 4e-4,
            "predicted_s": 5e-4,
            "measured_s": 6e-4,
            "ratio": 1.5,
            "flops_estimated": 0.0,
            "flops_compiled": 0.0,
            "bytes_estimated": 1e6,
            "bytes_compiled": 1e6,
            "hlo_ops": 1,
        },
    ]
    rows = [o for o in ops]
    report = {
        "experiment": "exp",
        "run_id": "exp",
        "emulated": True,
        "backend": "cpu",
        "devices": 8,
        "mesh": {"X": 2, "Y": 4},
        "dtype": "fp32",
        "hardware": {
            "name": "chip",
            "kind": "cpu",
            "peak_flops": PEAKS,
            "hbm_bandwidth": 1e12,
            "link_bandwidth": 1e11,
            "calibrated": True,
        },
        "ops": rows,
        "estimated_ops": named,
        "coverage": 1.0,
        "estimate_coverage": 1.0,
        "step_time_measured_s": 5e-3,
        "step_time_predicted_s": sum(o["predicted_s"] or 0 for o in rows),
        "step_time_estimated_s": 2.4e-3,
        "breakdown": writer.breakdown(rows, named),
        "summary": {
            "median_ratio_large": 1.5,
            "ops_large": 2,
            "ops": len(rows),
            "repeats": 5,
            "warmup": 10,
            "spread_large": 1.2,
            "unsteady": False,
            "host_load": 0.05,
        },
        "audit": {"all_match": True},
        "tensorboard": "runs/exp/tensorboard",
    }
    return report | extra


OPS = [
    _op("dot.1", "matmul", 2e-3, 3e-3, flops=1e9, nbytes=4e6, estimate="mlp/up"),
    _op("dot.2", "matmul", 1e-3, 1.2e-3, flops=5e8, nbytes=2e6),
    _op("all-reduce.1", "all-reduce", 5e-4, 6e-4, coll=1e6, estimate="all-reduce over Y", axes=["Y"]),
    _op("fusion.1", "elementwise", 1e-5, 5e-5, nbytes=1e4),  # 5x its roofline
    _op("copy.1", "elementwise", 1e-8, 5e-7, nbytes=10.0),  # under 1 us: left out of the per-op chart
]


def test_the_roofline_is_the_programs_dtype_and_every_op_with_flops_is_on_it():
    roof_fig = figures(_report(OPS))["roofline.png"]
    ax, cx = roof_fig.axes
    roof_line = ax.get_lines()[0]
    assert max(roof_line.get_ydata()) == PEAKS["fp32"]  # not the int8 peak
    texts = " ".join(t.get_text() for t in ax.texts)
    assert "peak 40 TFLOP/s (fp32)" in texts and "ridge 40 FLOP/B" in texts and "host memory 1 TB/s" in texts
    roof_fig.canvas.draw()  # ticks in engineering units, as plain text (no mathtext 10^n)
    ticks = [t.get_text() for t in ax.get_yticklabels() + cx.get_xticklabels() if t.get_text()]
    assert any(t.endswith("FLOP/s") for t in ticks) and not any("$" in t for t in ticks), ticks
    points = sum(len(c.get_offsets()) for c in ax.collections if isinstance(c, PathCollection))
    assert points == 2  # the two ops with FLOPs and a measured time
    measured, predicted = (c for c in cx.collections if isinstance(c, PathCollection) and len(c.get_offsets()))
    assert len(measured.get_offsets()) == 1 and len(predicted.get_offsets()) == 1
    assert max(cx.get_lines()[0].get_ydata()) == 1e11  # the link's roof


def test_the_bandwidth_roofs_label_runs_along_the_roof_on_the_page():
    """The HBM label is drawn at the roof's own angle on the page (which depends on the axes' ranges), measured here
    from the drawn roof's two ends in display coordinates."""
    angles = []
    for ops in (OPS, [_op("dot.9", "matmul", 1e-3, 1e-3, flops=1e12, nbytes=1e4)]):
        fig = figures(_report(ops))["roofline.png"]
        ax = fig.axes[0]
        FigureCanvasAgg(fig).draw()
        (label,) = [t for t in ax.texts if t.get_text().startswith("host memory")]  # emulated: the host's RAM
        xs, ys = ax.get_lines()[0].get_data()
        (x0, y0), (x1, y1) = ax.transData.transform([(xs[0], ys[0]), (xs[1], ys[1])])
        drawn = math.degrees(math.atan2(y1 - y0, x1 - x0))
        assert label.get_rotation() == pytest.approx(drawn, abs=0.5)
        angles.append(drawn)
    assert abs(angles[0] - angles[1]) > 5  # two ranges, two angles: not one fixed rotation


def test_collectives_are_drawn_at_their_bus_bandwidth_measured_and_predicted():
    """An AllReduce of 1 MB over Y (4 devices) moves 2 (4 - 1) / 4 = 1.5 MB over each link: in 0.6 ms measured
    that is 2.5 GB/s, in 0.5 ms predicted 3 GB/s (nccl-tests' bus bandwidth, comparable with the link's)."""
    _, cx = figures(_report(OPS))["roofline.png"].axes
    measured, predicted = (c for c in cx.collections if isinstance(c, PathCollection) and len(c.get_offsets()))
    assert measured.get_offsets()[0][0] == 1e6 and measured.get_offsets()[0][1] == pytest.approx(2.5e9)
    assert predicted.get_offsets()[0][1] == pytest.approx(3e9)
    assert predicted.get_facecolors().size == 0 or predicted.get_facecolors()[0][3] == 0  # hollow: a prediction
    assert cx.get_ylim()[1] >= 6 * 3e9  # room above the highest point for the legend
    labels = [t.get_text() for t in cx.get_legend().get_texts()]
    assert labels[0] == "host link fit (AllGather) 100 GB/s" and "predicted" in labels  # an emulated run's "link"


@pytest.mark.parametrize(
    ("kind", "group", "factor"),
    [
        ("all-reduce", 4, 1.5),  # 2 (n - 1) / n
        ("all-gather", 8, 0.875),  # (n - 1) / n
        ("reduce-scatter", 2, 0.5),
        ("all-to-all", 4, 0.1875),  # each device's V / 4, three quarters of it sent: 3 / 16 of the whole V
        ("collective-permute", 8, 1.0),
        ("all-reduce", 1, 1.0),  # no group: nothing moves, drawn at V / time
    ],
)
def test_bus_factors_are_nccl_tests_on_the_labs_v(kind, group, factor):
    assert bus_factor(kind, group) == factor


def test_a_collective_over_two_axes_is_priced_over_both_and_a_torus_gets_its_both_ways_roof():
    """An AllGather of 4 MB over X and Y (2 x 4 = 8 devices) in 0.2 ms moves 7/8 of it out of each device:
    17.5 GB/s. On a torus chip the roof is drawn one way and, dashed, both ways."""
    only = [_op("all-gather.1", "all-gather", 1e-4, 2e-4, coll=4e6, axes=["X", "Y"])]
    hw = _report(OPS)["hardware"] | {"kind": "tpu", "topology": "torus"}
    _, cx = figures(_report(only, estimated_ops=[], hardware=hw, emulated=False))["roofline.png"].axes
    measured = next(c for c in cx.collections if isinstance(c, PathCollection) and len(c.get_offsets()))
    assert measured.get_offsets()[0][1] == pytest.approx(4e6 * 7 / 8 / 2e-4)
    roofs = [(line.get_label(), max(line.get_ydata())) for line in cx.get_lines()]
    assert roofs == [("link, one way 100 GB/s", 1e11), ("link, both ways", 2e11)]


def test_a_collective_whose_group_is_unknown_is_drawn_at_v_over_time_and_counted():
    only = [_op("all-gather.1", "all-gather", 1e-4, 2e-4, coll=4e6)]  # no mesh axes recorded
    hw = _report(OPS)["hardware"] | {"kind": "gpu"}
    _, cx = figures(_report(only, estimated_ops=[], hardware=hw, emulated=False))["roofline.png"].axes
    measured = next(c for c in cx.collections if isinstance(c, PathCollection) and len(c.get_offsets()))
    assert measured.get_offsets()[0][1] == pytest.approx(4e6 / 2e-4)
    assert cx.get_title() == "Collectives (1); 1 at V / time (group unknown)"
    assert cx.get_legend().get_texts()[0].get_text() == "link, one way 100 GB/s"


def test_the_heaviest_ops_labels_do_not_cover_one_another_or_the_peak():
    """Five heavy matmuls in a cluster (a train step's): each numbered, no two numbers (nor the peak's label)
    overlap, a number moved off its point has a line back to it, and the key names each one whole."""
    cluster = [
        _op(f"dot.{i}", "matmul", 1e-3, 1e-3 * (1 + i / 50), flops=1e9, nbytes=1e7, estimate=f"layer/op{i}")
        for i in range(5)
    ]
    fig = figures(_report(cluster, estimated_ops=[]))["roofline.png"]
    renderer = FigureCanvasAgg(fig).get_renderer()
    fig.draw(renderer)
    ax = fig.axes[0]
    names = [t for t in ax.texts if t.get_text() in {"1", "2", "3", "4", "5"} or t.get_text().startswith("peak")]
    assert len(names) == 6
    (key,) = [t for t in ax.texts if t.get_text().startswith("the heaviest ops:")]
    assert [line.split()[1] for line in key.get_text().splitlines()[1:]] == [f"layer/op{i}" for i in range(4, -1, -1)]
    boxes = [Text.get_window_extent(t, renderer).frozen() for t in names]  # the text alone, not its line
    overlaps = [
        (a.get_text(), b.get_text())
        for i, a in enumerate(names)
        for b in names[i + 1 :]
        if boxes[names.index(a)].overlaps(boxes[names.index(b)])
    ]
    assert not overlaps, overlaps
    moved = [t for t in names if t.get_text().isdigit() and t.arrow_patch is not None]
    assert moved  # some had to move, and kept a line to their point


def test_ops_faster_than_their_roof_are_counted_in_the_title():
    """1 GFLOP over 1 GB (intensity 1: roof 1 TB/s x 1 = 1 TFLOP/s) in 0.1 ms is 10 TFLOP/s: above its roof."""
    fast = _op("dot.9", "matmul", 1e-3, 1e-4, flops=1e9, nbytes=1e9)
    assert figures(_report(OPS))["roofline.png"].axes[0].get_title() == "Roofline: exp (emulated)"
    fig = figures(_report([*OPS, fast]))["roofline.png"]
    assert fig.axes[0].get_title() == "Roofline: exp (emulated); 1 op above the roof"
    note = fig.texts[0].get_text()  # what the roof is, and why a dot can sit above it
    assert note.startswith("roof: the spec's peak, or its host memory bandwidth") and "a dot above it" in note
    assert any(t.get_text().startswith("host memory ") for t in fig.axes[0].texts)  # not "HBM": the host's RAM
    real = figures(_report(OPS, emulated=False))["roofline.png"]
    assert "HBM bandwidth" in real.texts[0].get_text() and "a dot above it" not in real.texts[0].get_text()


def test_log_axes_keep_minor_ticks_only_where_they_carry_the_labels():
    """Past two decades every decade has a labelled major tick and matplotlib labels no minor one: none are laid
    out (each cost as much as a labelled one). A narrower axis keeps them, and is still read by its labels."""
    fig = figures(_report(OPS))["roofline.png"]
    fig.canvas.draw()
    ax, cx = fig.axes
    lo, hi = ax.get_xlim()
    assert hi / lo > 100 and len(ax.xaxis.get_minorticklocs()) == 0
    near = _report(OPS)
    near["hardware"] = near["hardware"] | {"link_bandwidth": 4e9}  # the roof near the collective's 2.5-3 GB/s
    fig = figures(near)["roofline.png"]
    fig.canvas.draw()
    cx = fig.axes[1]
    lo, hi = cx.get_ylim()  # one collective: its rates and the link's roof, under two decades apart
    assert hi / lo <= 100 and len(cx.yaxis.get_minorticklocs()) > 0
    labels = [t.get_text() for t in cx.get_yticklabels(minor=True) + cx.get_yticklabels()]
    assert sum(1 for t in labels if t.endswith("B/s")) >= 2, labels
    shown = [t for t in cx.get_yticklabels(minor=True) if lo <= t.get_position()[1] <= hi]
    assert shown and all(t.get_text() for t in shown), [t.get_text() for t in shown]  # no minor tick left bare


def test_the_plots_are_written_with_fast_text_and_leave_the_sessions_settings_alone(tmp_path):
    """A report draws its text unhinted (FAST_TEXT: most of the drawing time) without changing the rcParams of the
    Python session that called it."""
    import matplotlib

    session = {"text.hinting": "auto"}  # whatever the session set, other than FAST_TEXT
    assert session.keys() == FAST_TEXT.keys() and session != FAST_TEXT
    with matplotlib.rc_context(session):
        assert plots(_report(OPS), tmp_path) == ["roofline.png", "predicted_vs_measured.png", "breakdown.png"]
        assert {k: matplotlib.rcParams[k] for k in FAST_TEXT} == session
    for name in ("roofline.png", "predicted_vs_measured.png", "breakdown.png"):
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_collective_only_run_is_not_an_empty_chart():
    only = [_op("all-gather.1", "all-gather", 1e-4, 2e-4, coll=4e6, axes=["X"])]
    _, cx = figures(_report(only, estimated_ops=[]))["roofline.png"].axes
    drawn = [len(c.get_offsets()) for c in cx.collections if isinstance(c, PathCollection)]
    assert drawn == [1, 1, 0]  # measured, predicted, and the legend's "predicted" ring
    assert cx.get_title() == "Collectives (1)"


def test_predicted_vs_measured_draws_the_band_both_predictions_and_hides_tiny_ops():
    ax = figures(_report(OPS))["predicted_vs_measured.png"].axes[0]
    (band,) = [c for c in ax.collections if isinstance(c, PolyCollection)]
    ys = band.get_paths()[0].vertices[:, 1]
    xs = band.get_paths()[0].vertices[:, 0]
    assert min(ys / xs) == pytest.approx(BAND[0]) and max(ys / xs) == pytest.approx(BAND[1])
    dots = [c for c in ax.collections if isinstance(c, PathCollection)]
    assert sum(len(c.get_offsets()) for c in dots) == 4 + 2  # 4 HLO ops of 1 us or more, 2 named ops
    sizes = [s for c in dots for s in c.get_sizes()]
    assert max(sizes) > 3 * min(sizes)  # sized by measured time
    assert "1 ops under 1 us left out" in ax.get_title()
    (key,) = [t.get_text() for t in ax.texts if t.get_text().startswith("dot area: measured time")]
    assert {"mlp/up", "all-reduce over Y"} <= {line.split("  ", 1)[1] for line in key.splitlines()[1:]}
    # every op with repeats gets a bar over its repeats' spread, centred on its median in log space
    bars = [c for c in ax.collections if isinstance(c, LineCollection)]
    spread = [r for r in OPS if r.get("spread") and r["measured_s"] >= 1e-6 and r["predicted_s"]]
    assert sum(len(c.get_segments()) for c in bars) == len(spread) > 0
    for seg in (s for c in bars for s in c.get_segments()):
        (x0, y0), (x1, y1) = seg
        assert x0 == x1 and y0 < y1


def test_the_breakdown_bars_add_up_to_their_steps():
    report = _report(OPS)
    bars = step_bars(report)
    assert sum(bars["measured"].values()) == pytest.approx(report["step_time_measured_s"])
    assert sum(bars["estimated"].values()) == pytest.approx(report["step_time_estimated_s"])
    assert bars["measured"]["idle"] > 0  # the op times are less than the step
    fig = figures(report)["breakdown.png"]
    ax = fig.axes[0]
    assert [t.get_text() for t in ax.get_yticklabels()] == ["measured", "predicted", "estimated"]
    fig.draw_without_rendering()
    legend = ax.get_legend().get_window_extent()
    assert legend.y1 < ax.xaxis.label.get_window_extent().y0  # below the data and its x label
    note = fig.texts[0].get_window_extent()  # how the measured ops were placed: under the legend
    assert note.y1 < legend.y0
    assert 0 <= note.y0 <= 0.2 * fig.dpi  # inside the figure, with no more than a fifth of an inch under it


def test_a_pipelines_measured_bar_draws_its_bubble_and_the_chart_says_how_ops_were_placed():
    report = _report(OPS) | {"pipeline_bubble": {"measured": 0.4, "predicted": 0.43, "stages": 4, "steps": 7}}
    step = report["step_time_measured_s"]
    bars = step_bars(report)
    assert bars["measured"]["bubble"] == pytest.approx(0.4 * step)
    assert sum(bars["measured"].values()) == pytest.approx(step)  # still the step, the bubble included
    fig = figures(report)["breakdown.png"]
    texts = [t.get_text() for t in fig.texts]
    assert len(texts) == 1 and texts[0].startswith("measured: op times (each on its slowest device) sum to")
    assert "bubble" in [t.get_text() for t in fig.axes[0].get_legend().get_texts()]


def test_the_markdown_report_says_what_a_reader_needs():
    many = OPS + [_op(f"fusion.{i}", "elementwise", 1e-6, 2e-6) for i in range(2, 40)]
    md = writer.markdown(_report(many))
    assert md.startswith("# exp\n")  # the title once
    assert f"the 25 heaviest of {len(many)} ops, all in `ops.csv`" in md
    assert "elementwise ops ran 3x or more their roofline" in md
    assert "median measured/predicted 1.50 over 2 ops" in md
    assert "- trust: steady (repeats differ by" in md and "other processes 5% of the host" in md
    assert "UNSTEADY" not in md
    assert "may add up to more than the step" in md and f"{writer.GLOSSARY}." in md
    shaky = _report(OPS, summary=_report(OPS)["summary"] | {"spread_large": 3.1})
    assert "**UNSTEADY**" in writer.markdown(shaky) and "differ by 3.10x" in writer.markdown(shaky)
    no_spread = _report(OPS, summary=_report(OPS)["summary"] | {"spread_large": None})
    assert "\n- trust: steady (spread not measurable: " in writer.markdown(no_spread)
    busy = _report(OPS, summary=_report(OPS)["summary"] | {"host_load": 0.87})  # the host's load alone flags it
    assert "**UNSTEADY**" in writer.markdown(busy) and "other processes held 87% of the host" in writer.markdown(busy)


def test_the_ledger_states_each_ops_spread_and_marks_one_wider_than_the_band():
    ops = [*OPS[:2], _op("all-reduce.1", "all-reduce", 5e-4, 6e-4, coll=1e6, spread=3.0)]  # 3x > 1.5 / 0.67
    lines = {line.split()[0]: line for line in writer.ledger_table(ops).splitlines()[2:]}
    assert lines["all-reduce.1"].split()[-3:-2] == ["!"] and "3.00x !" in lines["all-reduce.1"]
    assert "1.20x" in lines["dot.1"] and "!" not in lines["dot.1"]
    assert "`!` past 2.24x" in writer.markdown(_report(ops))


def test_the_markdown_report_lists_the_processes_of_a_multi_process_run():
    procs = [
        {"rank": r, "host": f"h{r}", "local_devices": 4, "step_time_measured_s": t, "tensorboard": f"runs/x{r}/tb"}
        for r, t in ((0, 2e-3), (1, 3e-3))
    ]
    md = writer.markdown(_report(OPS) | {"processes": procs, "slowest_process": 1})
    assert "## Processes (2; the ledger's measured times are process 1's, the slowest)" in md
    assert "   1  h1          4         3 ms  runs/x1/tb" in md
    assert "gloo on loopback" in md  # emulated: the reader is told what carried the collectives


def test_ops_csv_quotes_names_with_commas(tmp_path):
    import csv

    rows = [_op("all-reduce.1", "all-reduce", 1e-4, 2e-4, coll=8.0, estimate='TP AllReduces: 2 fwd, 5 bwd + "x"')]
    writer.write_csv(rows, tmp_path / "ops.csv")
    with open(tmp_path / "ops.csv", newline="") as f:
        (back,) = list(csv.DictReader(f))
    assert back["estimate_op"] == 'TP AllReduces: 2 fwd, 5 bwd + "x"'
    assert float(back["spread"]) == 1.2  # each op's spread over its repeats, as in the ledger


def test_the_report_says_which_module_to_pick_in_tensorboard_and_where_the_empty_tools_facts_are():
    from lab.measure.xprof_tools import tool_links

    links = tool_links("/tmp/run/tensorboard/plugins/profile/2025_01_02_03_04_05", backend="cpu")
    md = writer.markdown(
        _report(OPS) | {"tensorboard": "/tmp/run/tensorboard", "tensorboard_tools": links, "hlo_module": "jit_body"}
    )
    picks = [line for line in md.splitlines() if "pick the module `jit_body`" in line]
    assert [line.split("]")[0] for line in picks] == ["- [Memory Viewer", "- [Graph Viewer"]
    assert "the lab's own view has the same facts" in md


def test_a_named_op_whose_matmul_was_fused_elsewhere_gets_a_note():
    row = dict(
        kind="matmul",
        estimated_s=1e-3,
        predicted_s=None,
        measured_s=None,
        ratio=None,
        bytes_estimated=0,
        bytes_compiled=0,
    )
    up = row | {"name": "mlp/up", "flops_estimated": 537e6, "flops_compiled": 0, "hlo_ops": 0}
    gate = row | {"name": "mlp/gate", "flops_estimated": 537e6, "flops_compiled": 1074e6, "hlo_ops": 1}
    text = writer.named_table([up, gate])
    assert "work compiled 0 for mlp/up:" in text and "fused its matmul into an op named for another scope" in text
    assert "work compiled 0" not in writer.named_table([gate])


def test_each_collective_kind_gets_its_own_fitted_roof_on_a_calibrated_host():
    """calibration.collective_factor 2.0 for all-reduce: its bandwidth term costs twice the link's, so its roof is
    half the link (100 GB/s -> 50 GB/s); a factor of 1 is the link's own roof, not drawn twice."""
    report = _report(OPS)
    report["hardware"] = report["hardware"] | {
        "calibration": {"collective_factor": {"all-reduce": 2.0, "all-gather": 1.0}}
    }
    _, cx = figures(report)["roofline.png"].axes
    fits = {line.get_label(): line.get_ydata()[0] for line in cx.get_lines() if " fit, whole mesh " in line.get_label()}
    assert fits == {"all-reduce fit, whole mesh 50 GB/s": pytest.approx(5e10)}
    _, plain = figures(_report(OPS))["roofline.png"].axes  # uncalibrated factors: the link's roof alone
    assert not [line for line in plain.get_lines() if "fit, whole mesh" in line.get_label()]


def test_the_report_names_the_perfetto_copys_device_tracks_on_emulated_devices():
    from lab.measure.profile import DEVICES_PROCESS
    from lab.measure.xprof_tools import tool_links

    links = tool_links("/tmp/run/tensorboard/plugins/profile/2025_01_02_03_04_05", backend="cpu")
    extra = {"tensorboard": "/tmp/run/tensorboard", "tensorboard_tools": links, "perfetto_trace": "/tmp/p.json.gz"}
    added = extra | {"perfetto_device_tracks": DEVICES_PROCESS}  # what a run records where it added them
    assert f'"{DEVICES_PROCESS}" with one track per emulated device' in writer.markdown(_report(OPS) | added)
    assert "one track per emulated device" not in writer.markdown(_report(OPS, emulated=False) | extra)


def test_ops_csv_lists_the_heaviest_measured_op_first(tmp_path):
    import csv

    rows = [
        _op("a", "matmul", 1e-3, 1e-3) | {"measured_s": None},
        _op("b", "matmul", 1e-3, 2e-3),
        _op("c", "matmul", 1e-3, 5e-3),
    ]
    writer.write_csv(rows, tmp_path / "ops.csv")
    with open(tmp_path / "ops.csv", newline="") as f:
        assert [r["name"] for r in csv.DictReader(f)] == ["c", "b", "a"]
