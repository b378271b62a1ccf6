"""lab.compile.hlo: the JAX-free parser of optimized HLO text.

The synthetic modules below follow XLA's printed format (``HloModule`` header, ``%name (params) -> type {``
computations, ``ENTRY``, layouts, ``metadata={...}``, ``backend_config={...}``). Every expected number is
worked out here from the shapes written in the text, never by calling the code under test. The last test
compiles a real ``shard_map`` program on the 8 emulated CPU devices of ``conftest.py``.

Mesh used for axis names: ``{"X": 2, "Y": 4}``; device d sits at (x, y) = (d // 4, d % 4), so groups
along Y are {0,1,2,3},{4,5,6,7} and groups along X are {0,4},{1,5},{2,6},{3,7}.
"""

import json
import re
from pathlib import Path

import pytest

from lab.compile.hlo import (
    Shape,
    axes_of_groups,
    axes_of_pairs,
    collectives,
    mesh_groups,
    parse_module,
    parse_replica_groups,
    parse_shapes,
)
from lab.compile.hlo_dots import dots

MESH = {"X": 2, "Y": 4}
F32, BF16 = 4, 2  # bytes per element

ALONG_Y = [[0, 1, 2, 3], [4, 5, 6, 7]]
ALONG_X = [[0, 4], [1, 5], [2, 6], [3, 7]]
ALL_8 = [[0, 1, 2, 3, 4, 5, 6, 7]]
RING_Y = ((0, 1), (1, 2), (2, 3), (3, 0), (4, 5), (5, 6), (6, 7), (7, 4))


def hlo(text: str, **subs: str) -> str:
    """HLO text as XLA prints it: one instruction a line.

    Here long lines are wrapped after a ``,`` with a 6-space indent to fit the line length; this joins them
    back with one space (what XLA prints after each comma) and fills ``@NAME@`` with ``subs``.
    """
    out: list[str] = []
    for line in text.splitlines():
        if line.startswith("      ") and out:
            out[-1] += " " + line.strip()
        else:
            out.append(line)
    joined = "\n".join(out) + "\n"
    for key, value in subs.items():
        joined = joined.replace(f"@{key}@", value)
    assert not re.search(r"@[A-Z_]+@", joined), "unfilled placeholder"
    return joined


# backend configs as XLA:GPU prints them (compact JSON), too long for one source line
ASYNC_CFG = json.dumps(
    {
        "operation_queue_id": "0",
        "wait_on_operation_queues": [],
        "collective_backend_config": {"is_sync": False, "no_parallel_custom_call": False},
    },
    separators=(",", ":"),
)
GEMM_CFG = json.dumps(
    {
        "operation_queue_id": "0",
        "wait_on_operation_queues": [],
        "gemm_backend_config": {
            "alpha_real": 1,
            "beta": 0,
            "dot_dimension_numbers": {
                "lhs_contracting_dimensions": ["1"],
                "rhs_contracting_dimensions": ["0"],
                "lhs_batch_dimensions": [],
                "rhs_batch_dimensions": [],
            },
            "alpha_imag": 0,
            "precision_config": {"operand_precision": ["DEFAULT", "DEFAULT"], "algorithm": "ALG_UNSET"},
            "epilogue": "DEFAULT",
            "lhs_stride": "1728",
            "rhs_stride": "2880",
            "grad_x": False,
            "grad_y": False,
            "damax_output": False,
        },
        "force_earliest_schedule": False,
    },
    separators=(",", ":"),
)


def by_name(items):
    out = {c.name: c for c in items}
    assert len(out) == len(items), "names must be unique"
    return out


# ----- shapes ------------------------------------------------------------------------------------


def test_parse_shapes_reads_arrays_tuples_and_layouts():
    shapes = parse_shapes("(f32[8,16]{1,0}, bf16[4,32]{0,1:T(8,128)(2,1)}, s32[], u32[]{:S(2)}, pred[3])")
    assert shapes == [
        Shape("f32", (8, 16)),
        Shape("bf16", (4, 32)),
        Shape("s32", ()),
        Shape("u32", ()),
        Shape("pred", (3,)),
    ]
    assert [s.elements for s in shapes] == [8 * 16, 4 * 32, 1, 1, 3]
    assert [s.bytes for s in shapes] == [8 * 16 * F32, 4 * 32 * BF16, 4, 4, 3]
    # A long tuple carries /*index=N*/ comments; a token is not an array.
    assert parse_shapes("(f32[2], f32[2], f32[2], f32[2], f32[2], /*index=5*/f8e4m3fn[7,3], token[])") == [
        Shape("f32", (2,))
    ] * 5 + [Shape("f8e4m3fn", (7, 3))]
    assert Shape("s4", (10,)).bytes == 5  # half a byte each


# ----- replica groups ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "groups"),
    [
        ("{{0,1,2,3},{4,5,6,7}}", ALONG_Y),
        ("{{0,4},{1,5},{2,6},{3,7}}", ALONG_X),
        ("{{0,1,2,3,4,5,6,7}}", ALL_8),
        ("{{0,2},{1,3},{4,6},{5,7}}", [[0, 2], [1, 3], [4, 6], [5, 7]]),
        ("[2,4]<=[8]", ALONG_Y),
        ("[1,8]<=[8]", ALL_8),
        # iota [2,4] transposed to [4,2]: rows are the columns of [[0,1,2,3],[4,5,6,7]]
        ("[4,2]<=[2,4]T(1,0)", ALONG_X),
        # iota [2,2,2] with the two outer dims swapped: x=(a,b,c) -> 4a+2b+c, groups over c for each (b,a)
        ("[4,2]<=[2,2,2]T(1,0,2)", [[0, 1], [4, 5], [2, 3], [6, 7]]),
        # the mesh form: row-major device ids over the named mesh, grouped by the axes in braces
        ("mesh['axis_0'=1,'axis_1'=2,'axis_2'=4] {'axis_1'}", ALONG_X),
        ("mesh['axis_0'=1,'axis_1'=2,'axis_2'=4] {'axis_2'}", ALONG_Y),
        ("mesh['axis_0'=1,'axis_1'=2,'axis_2'=4] {'axis_1','axis_2'}", ALL_8),
        ("mesh['x'=8] {'x'}", ALL_8),
    ],
)
def test_parse_replica_groups_exactly(text, groups):
    assert parse_replica_groups(text) == groups


def test_parse_replica_groups_empty_forms():
    assert parse_replica_groups(None) is None
    assert parse_replica_groups("") is None
    assert parse_replica_groups("{}") == []


@pytest.mark.parametrize(
    ("groups", "axes"),
    [
        (ALONG_Y, ("Y",)),
        (ALONG_X, ("X",)),
        (ALL_8, ("X", "Y")),
        ([[i] for i in range(8)], ()),  # every device alone: no axis
        ([], ("X", "Y")),  # replica_groups={} means every device
        (None, ("X", "Y")),
        ([[4, 0], [7, 3], [5, 1], [6, 2]], ("X",)),  # order inside and across groups does not matter
        # pairs of neighbours inside a Y row, and X-pairs shifted by one: neither is any subset of {X, Y}
        ([[0, 1], [2, 3], [4, 5], [6, 7]], None),
        ([[0, 5], [1, 6], [2, 7], [3, 4]], None),
    ],
)
def test_axes_of_groups_on_a_2x4_mesh(groups, axes):
    assert axes_of_groups(groups, MESH) == axes


def test_axes_of_parsed_groups_all_formats():
    for text, axes in [
        ("{{0,1,2,3},{4,5,6,7}}", ("Y",)),
        ("[2,4]<=[8]", ("Y",)),
        ("[4,2]<=[2,4]T(1,0)", ("X",)),
        ("mesh['axis_0'=1,'axis_1'=2,'axis_2'=4] {'axis_1'}", ("X",)),
        ("{{0,1,2,3,4,5,6,7}}", ("X", "Y")),
    ]:
        assert axes_of_groups(parse_replica_groups(text), MESH) == axes, text


def test_mesh_groups_by_hand():
    assert mesh_groups([2, 4], [1]) == {frozenset(g) for g in ALONG_Y}
    assert mesh_groups([2, 4], [0]) == {frozenset(g) for g in ALONG_X}
    assert mesh_groups([2, 4], [0, 1]) == {frozenset(range(8))}
    # 2x2x2: axis 1 has stride 2
    assert mesh_groups([2, 2, 2], [1]) == {frozenset(g) for g in [[0, 2], [1, 3], [4, 6], [5, 7]]}


def test_axes_of_pairs():
    assert axes_of_pairs(list(RING_Y), MESH) == ("Y",)
    assert axes_of_pairs([(0, 4), (4, 0), (1, 5), (5, 1)], MESH) == ("X",)
    assert axes_of_pairs([(0, 5), (5, 0)], MESH) == ("X", "Y")  # (0,0) <-> (1,1)
    assert axes_of_pairs([], MESH) is None


# ----- every collective kind, synchronous ------------------------------------------------------------

SYNC = hlo(
    """\
HloModule jit_sync, is_scheduled=true, entry_computation_layout={(f32[8,16]{1,0}, bf16[4,32]{1,0},
      f32[4,32]{1,0})->f32[8,16]{1,0}}, num_partitions=8

%region_0.1 (a.1: f32[], b.1: f32[]) -> f32[] {
  %a.1 = f32[] parameter(0)
  %b.1 = f32[] parameter(1)
  ROOT %add.1 = f32[] add(%a.1, %b.1)
}

%region_1.2 (a.2: bf16[], b.2: bf16[]) -> bf16[] {
  %a.2 = bf16[] parameter(0)
  %b.2 = bf16[] parameter(1)
  ROOT %add.2 = bf16[] add(%a.2, %b.2)
}

ENTRY %main.20_spmd (param.0: f32[8,16], param.1: bf16[4,32], param.2: f32[4,32]) -> f32[8,16] {
  %param.0 = f32[8,16]{1,0} parameter(0), sharding={devices=[2,4]<=[8]}
  %param.1 = bf16[4,32]{1,0} parameter(1)
  %param.2 = f32[4,32]{1,0} parameter(2)
  %copy.1 = f32[8,16]{1,0} copy(%param.0)
  %all-gather.1 = f32[32,16]{1,0} all-gather(%copy.1), channel_id=1, replica_groups={{0,1,2,3},{4,5,6,7}},
      dimensions={0}, use_global_device_ids=true, metadata={op_name="jit(f)/all_gather"}
  %all-gather.2 = f32[16,16]{1,0} all-gather(f32[8,16]{1,0} %copy.1), channel_id=2, replica_groups=[4,2]<=[2,4]T(1,0),
      dimensions={0}, use_global_device_ids=true
  %reduce-scatter.3 = bf16[1,32]{1,0} reduce-scatter(%param.1), channel_id=3, replica_groups=[2,4]<=[8],
      use_global_device_ids=true, dimensions={0}, to_apply=%region_1.2
  %all-reduce.4 = f32[8,16]{1,0} all-reduce(%copy.1), channel_id=4,
      replica_groups=mesh['axis_0'=1,'axis_1'=2,'axis_2'=4] {'axis_1'}, use_global_device_ids=true,
      to_apply=%region_0.1
  %all-reduce.5 = (f32[8,16]{1,0}, f32[4,32]{1,0}) all-reduce(%copy.1, %param.2), channel_id=5,
      replica_groups={{0,1,2,3,4,5,6,7}}, use_global_device_ids=true, to_apply=%region_0.1
  %all-to-all.6 = f32[8,16]{1,0} all-to-all(%copy.1), channel_id=6, replica_groups={{0,1,2,3,4,5,6,7}}, dimensions={0}
  %slice.0 = f32[2,16]{1,0} slice(%copy.1), slice={[0:2], [0:16]}
  %slice.1 = f32[2,16]{1,0} slice(%copy.1), slice={[2:4], [0:16]}
  %slice.2 = f32[2,16]{1,0} slice(%copy.1), slice={[4:6], [0:16]}
  %slice.3 = f32[2,16]{1,0} slice(%copy.1), slice={[6:8], [0:16]}
  %all-to-all.7 = (f32[2,16]{1,0}, f32[2,16]{1,0}, f32[2,16]{1,0}, f32[2,16]{1,0}) all-to-all(%slice.0, %slice.1,
      %slice.2, %slice.3), channel_id=7, replica_groups={{0,1,2,3},{4,5,6,7}}
  %all-to-all.8 = (bf16[2,32]{1,0}, bf16[2,32]{1,0}) all-to-all(bf16[2,32]{1,0} %s.0, bf16[2,32]{1,0} %s.1),
      channel_id=8, replica_groups={{0,4},{1,5},{2,6},{3,7}}
  %collective-permute.9 = f32[8,16]{1,0} collective-permute(%copy.1), channel_id=9,
      source_target_pairs={{0,1},{1,2},{2,3},{3,0},{4,5},{5,6},{6,7},{7,4}}
  ROOT %add.10 = f32[8,16]{1,0} add(%all-reduce.4, %collective-permute.9)
}
"""
)


def test_sync_collectives_kinds_bytes_groups():
    got = by_name(collectives(parse_module(SYNC)))
    assert set(got) == {
        "all-gather.1",
        "all-gather.2",
        "reduce-scatter.3",
        "all-reduce.4",
        "all-reduce.5",
        "all-to-all.6",
        "all-to-all.7",
        "all-to-all.8",
        "collective-permute.9",
    }  # the add inside %region_0.1 and the other instructions are not collectives

    # AllGather: V is the output.
    ag1 = got["all-gather.1"]
    assert (ag1.kind, ag1.dtype, ag1.bytes, ag1.elements) == ("all-gather", "f32", 32 * 16 * F32, 32 * 16)
    assert ag1.groups == tuple(map(tuple, ALONG_Y)) and ag1.group_size == 4
    assert axes_of_groups([list(g) for g in ag1.groups], MESH) == ("Y",)
    assert ag1.op_name == "jit(f)/all_gather" and ag1.times == 1
    # operand printed with its shape, iota groups with a transpose
    ag2 = got["all-gather.2"]
    assert (ag2.bytes, ag2.elements, ag2.group_size) == (16 * 16 * F32, 16 * 16, 2)
    assert ag2.groups == tuple(map(tuple, ALONG_X))

    # ReduceScatter: V is the operand (bf16[4,32]), not the bf16[1,32] output.
    rs = got["reduce-scatter.3"]
    assert (rs.kind, rs.dtype, rs.bytes, rs.elements) == ("reduce-scatter", "bf16", 4 * 32 * BF16, 4 * 32)
    assert rs.groups == tuple(map(tuple, ALONG_Y)) and rs.group_size == 4

    # AllReduce: V is the operand; mesh-form groups over axis_1 (size 2) are the X groups.
    ar = got["all-reduce.4"]
    assert (ar.kind, ar.bytes, ar.elements, ar.group_size) == ("all-reduce", 8 * 16 * F32, 8 * 16, 2)
    assert axes_of_groups([list(g) for g in ar.groups], MESH) == ("X",)
    # a combined (tuple) all-reduce counts the sum of its operands
    arc = got["all-reduce.5"]
    assert arc.bytes == (8 * 16 + 4 * 32) * F32 and arc.elements == 8 * 16 + 4 * 32
    assert arc.group_size == 8

    # AllToAll: V is the operand times the group size.
    a2a = got["all-to-all.6"]
    assert (a2a.kind, a2a.bytes, a2a.elements, a2a.group_size) == ("all-to-all", 8 * 16 * F32 * 8, 8 * 16 * 8, 8)
    # tuple form, one operand per peer (operands resolved by name): the operands together are the
    # f32[8,16] buffer each device holds, so V is the same as the array form over a group of 4
    a2at = got["all-to-all.7"]
    assert a2at.bytes == 4 * (2 * 16 * F32) * 4 == 8 * 16 * F32 * 4
    assert a2at.elements == 4 * 2 * 16 * 4 and a2at.group_size == 4
    assert axes_of_groups([list(g) for g in a2at.groups], MESH) == ("Y",)
    # tuple form with operands printed with shapes
    a2ab = got["all-to-all.8"]
    assert (a2ab.dtype, a2ab.bytes, a2ab.group_size) == ("bf16", 2 * (2 * 32 * BF16) * 2, 2)

    # permute: V is the operand; source/target pairs kept.
    cp = got["collective-permute.9"]
    assert (cp.kind, cp.bytes, cp.elements, cp.group_size) == ("permute", 8 * 16 * F32, 8 * 16, 0)
    assert cp.pairs == RING_Y and cp.groups == ()
    assert axes_of_pairs(list(cp.pairs), MESH) == ("Y",)


def test_operands_resolved_through_the_computation_table():
    m = parse_module(SYNC)
    assert m.entry == "main.20_spmd"
    assert set(m.computations) == {"region_0.1", "region_1.2", "main.20_spmd"}
    table = m.table("main.20_spmd")
    assert table["copy.1"].result == (Shape("f32", (8, 16)),)
    assert table["all-reduce.5"].result == (Shape("f32", (8, 16)), Shape("f32", (4, 32)))
    ag = table["all-gather.1"]
    assert ag.opcode == "all-gather" and ag.operands_text == "%copy.1"
    assert ag.attr("replica_groups") == "{{0,1,2,3},{4,5,6,7}}"
    assert ag.attr("dimensions") == "{0}"
    assert table["all-gather.2"].attr("replica_groups") == "[4,2]<=[2,4]T(1,0)"
    assert table["all-reduce.4"].attr("replica_groups") == "mesh['axis_0'=1,'axis_1'=2,'axis_2'=4] {'axis_1'}"
    assert table["all-reduce.4"].attr("to_apply") == "%region_0.1"


# ----- async pairs -----------------------------------------------------------------------------------

ASYNC = hlo(
    """\
HloModule jit_async, is_scheduled=true, entry_computation_layout={(f32[8,16]{1,0})->(f32[64,16]{1,0}, f32[8,16]{1,0},
      f32[8,16]{1,0}, f32[16,16]{1,0})}, num_partitions=8

%add.clone (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %add = f32[] add(%x, %y)
}

ENTRY %main.9_spmd (param.0: f32[8,16]) -> (f32[64,16], f32[8,16], f32[8,16], f32[16,16]) {
  %param.0 = f32[8,16]{1,0} parameter(0)
  %all-gather-start = (f32[8,16]{1,0}, f32[64,16]{1,0}) all-gather-start(%param.0), channel_id=1,
      replica_groups=[1,8]<=[8], dimensions={0}, use_global_device_ids=true, backend_config=@ASYNC_CFG@
  %all-reduce-start = f32[8,16]{1,0} all-reduce-start(%param.0), channel_id=2, replica_groups={{0,1,2,3},{4,5,6,7}},
      use_global_device_ids=true, to_apply=%add.clone, backend_config=@ASYNC_CFG@
  %collective-permute-start = (f32[8,16]{1,0}, f32[8,16]{1,0}, u32[]{:S(2)},
      u32[]{:S(2)}) collective-permute-start(%param.0), channel_id=3,
      source_target_pairs={{0,4},{4,0},{1,5},{5,1},{2,6},{6,2},{3,7},{7,3}}
  %all-gather-start.1 = (f32[8,16]{1,0}, f32[16,16]{1,0}) all-gather-start(f32[8,16]{1,0} %param.0), channel_id=4,
      replica_groups={{0,4},{1,5},{2,6},{3,7}}, dimensions={0}, use_global_device_ids=true
  %all-gather-done = f32[64,16]{1,0} all-gather-done(%all-gather-start)
  %all-reduce-done = f32[8,16]{1,0} all-reduce-done(%all-reduce-start)
  %collective-permute-done = f32[8,16]{1,0} collective-permute-done(%collective-permute-start)
  %all-gather-done.1 = f32[16,16]{1,0} all-gather-done(%all-gather-start.1)
  ROOT %tuple = (f32[64,16]{1,0}, f32[8,16]{1,0}, f32[8,16]{1,0}, f32[16,16]{1,0}) tuple(%all-gather-done,
      %all-reduce-done, %collective-permute-done, %all-gather-done.1)
}
""",
    ASYNC_CFG=ASYNC_CFG,
)


def test_async_pairs_count_once_with_the_same_bytes():
    got = by_name(collectives(parse_module(ASYNC)))
    assert set(got) == {"all-gather-start", "all-reduce-start", "collective-permute-start", "all-gather-start.1"}
    # all-gather-start's result is (operand, output): V is the output f32[64,16], not operand + output
    ag = got["all-gather-start"]
    assert (ag.kind, ag.bytes, ag.elements, ag.group_size) == ("all-gather", 64 * 16 * F32, 64 * 16, 8)
    assert ag.groups == tuple(map(tuple, ALL_8)) and ag.times == 1
    ag1 = got["all-gather-start.1"]  # operand printed with its shape
    assert (ag1.bytes, ag1.group_size) == (16 * 16 * F32, 2)
    assert axes_of_groups([list(g) for g in ag1.groups], MESH) == ("X",)
    ar = got["all-reduce-start"]
    assert (ar.kind, ar.bytes, ar.elements, ar.group_size) == ("all-reduce", 8 * 16 * F32, 8 * 16, 4)
    # collective-permute-start's result is (operand, output, u32 contexts): V is the operand alone
    cp = got["collective-permute-start"]
    assert (cp.kind, cp.dtype, cp.bytes, cp.elements) == ("permute", "f32", 8 * 16 * F32, 8 * 16)
    assert axes_of_pairs(list(cp.pairs), MESH) == ("X",)


# XLA prints an async-wrapped reduce-scatter / all-to-all with the "syntax sugar" form
# (HloPrintOptions::syntax_sugar_async_ops, on by default): the opcode becomes
# "<wrapped opcode>-start", the wrapped instruction's attributes are printed on it, and the wrapped
# async computation is not printed at all. This is what XLA:GPU emits for async reduce-scatter and
# all-to-all (e.g. xla/service/... tests: "((f32[20]{0}), f32[10]{0}) reduce-scatter-start(%p)").
ASYNC_SUGAR = hlo(
    """\
HloModule jit_async_sugar, is_scheduled=true, entry_computation_layout={(f32[32,16]{1,0})->(f32[8,16]{1,0},
      f32[32,16]{1,0})}, num_partitions=8

%add.clone (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %add = f32[] add(%x, %y)
}

ENTRY %main.5_spmd (param.0: f32[32,16]) -> (f32[8,16], f32[32,16]) {
  %param.0 = f32[32,16]{1,0} parameter(0)
  %reduce-scatter-start = ((f32[32,16]{1,0}), f32[8,16]{1,0}) reduce-scatter-start(%param.0), channel_id=1,
      replica_groups={{0,1,2,3},{4,5,6,7}}, use_global_device_ids=true, dimensions={0}, to_apply=%add.clone
  %all-to-all-start = ((f32[32,16]{1,0}), f32[32,16]{1,0}) all-to-all-start(%param.0), channel_id=2,
      replica_groups={{0,4},{1,5},{2,6},{3,7}}, dimensions={0}
  %reduce-scatter-done = f32[8,16]{1,0} reduce-scatter-done(%reduce-scatter-start)
  %all-to-all-done = f32[32,16]{1,0} all-to-all-done(%all-to-all-start)
  ROOT %tuple = (f32[8,16]{1,0}, f32[32,16]{1,0}) tuple(%reduce-scatter-done, %all-to-all-done)
}
"""
)


def test_async_reduce_scatter_and_all_to_all_start_forms():
    got = by_name(collectives(parse_module(ASYNC_SUGAR)))
    assert set(got) == {"reduce-scatter-start", "all-to-all-start"}
    rs = got["reduce-scatter-start"]
    assert (rs.kind, rs.bytes, rs.group_size) == ("reduce-scatter", 32 * 16 * F32, 4)
    a2a = got["all-to-all-start"]
    assert (a2a.kind, a2a.bytes, a2a.group_size) == ("all-to-all", 32 * 16 * F32 * 2, 2)


# The TPU compiler's async collective fusions (libtpu, seen in a cross-compiled FSDP train step): one all-gather
# split into a start fusion, a continuation fusion that computes while it is in flight, and a done fusion, each
# holding a copy of the all-gather with the same channel_id. And a gradient reduce-scatter padded to a tile
# multiple (4 rows as 2 x 3), whose overhang row is sent on to the device that owns it by a collective-permute.
TPU_ASYNC = hlo(
    """\
HloModule jit_tpu_async, is_scheduled=true, num_partitions=8

%add.clone (x: bf16[], y: bf16[]) -> bf16[] {
  %x = bf16[] parameter(0)
  %y = bf16[] parameter(1)
  ROOT %add = bf16[] add(%x, %y)
}

%fused_computation.1 (param_0.1: bf16[64,32]) -> (bf16[64,32], bf16[128,32]) {
  %param_0.1 = bf16[64,32]{1,0} parameter(0)
  %all-gather.1 = bf16[128,32]{1,0} all-gather(%param_0.1), channel_id=7, replica_groups=[4,2]<=[2,4]T(1,0),
      dimensions={0}, use_global_device_ids=true
  ROOT %tuple.1 = (bf16[64,32]{1,0}, bf16[128,32]{1,0}) tuple(%param_0.1, %all-gather.1)
}

%async_collective_fusion.3 (param_0.2: bf16[64,32], param_1.2: bf16[8,32]) -> (bf16[8,32], bf16[128,32]) {
  %param_0.2 = bf16[64,32]{1,0} parameter(0)
  %param_1.2 = bf16[8,32]{1,0} parameter(1)
  %all-gather.2 = bf16[128,32]{1,0} all-gather(%param_0.2), channel_id=7, replica_groups=[4,2]<=[2,4]T(1,0),
      dimensions={0}, use_global_device_ids=true
  %negate.2 = bf16[8,32]{1,0} negate(%param_1.2)
  ROOT %tuple.2 = (bf16[8,32]{1,0}, bf16[128,32]{1,0}) tuple(%negate.2, %all-gather.2)
}

%fused_computation.4 (param_0.4: bf16[64,32]) -> bf16[128,32] {
  %param_0.4 = bf16[64,32]{1,0} parameter(0)
  ROOT %all-gather.4 = bf16[128,32]{1,0} all-gather(%param_0.4), channel_id=7, replica_groups=[4,2]<=[2,4]T(1,0),
      dimensions={0}, use_global_device_ids=true
}

%all-reduce-scatter.5 (input.5: bf16[4,32]) -> bf16[3,32] {
  %input.5 = bf16[4,32]{1,0} parameter(0)
  %constant.5 = bf16[] constant(0)
  %pad.5 = bf16[6,32]{1,0} pad(%input.5, %constant.5), padding=0_2x0_0
  %all-reduce.5 = bf16[6,32]{1,0} all-reduce(%pad.5), channel_id=9, replica_groups={{0,4},{1,5},{2,6},{3,7}},
      use_global_device_ids=true, to_apply=%add.clone
  %partition-id.5 = u32[] partition-id()
  %constant.6 = u32[] constant(0)
  ROOT %dynamic-slice.5 = bf16[3,32]{1,0} dynamic-slice(%all-reduce.5, %partition-id.5, %constant.6),
      dynamic_slice_sizes={3,32}
}

ENTRY %main.9_spmd (param.0: bf16[64,32], param.1: bf16[8,32], param.2: bf16[4,32]) -> (bf16[128,32], bf16[1,32]) {
  %param.0 = bf16[64,32]{1,0} parameter(0)
  %param.1 = bf16[8,32]{1,0} parameter(1)
  %param.2 = bf16[4,32]{1,0} parameter(2)
  %async-collective-start = (bf16[64,32]{1,0}, bf16[128,32]{1,0}) fusion(%param.0), kind=kCustom,
      calls=%fused_computation.1
  %fusion.3 = (bf16[8,32]{1,0}, bf16[128,32]{1,0}) fusion(%param.0, %param.1), kind=kCustom,
      calls=%async_collective_fusion.3
  %async-collective-done = bf16[128,32]{1,0} fusion(%param.0), kind=kCustom, calls=%fused_computation.4
  %fusion.5 = bf16[3,32]{1,0} fusion(%param.2), kind=kCustom, calls=%all-reduce-scatter.5
  %slice.5 = bf16[1,32]{1,0} slice(%fusion.5), slice={[2:3], [0:32]}
  %collective-permute-start = (bf16[1,32]{1,0}, bf16[1,32]{1,0}, u32[], u32[]) collective-permute-start(%slice.5),
      channel_id=1, source_target_pairs={{0,4},{1,5},{2,6},{3,7}}
  %collective-permute-done = bf16[1,32]{1,0} collective-permute-done(%collective-permute-start)
  ROOT %tuple.9 = (bf16[128,32]{1,0}, bf16[1,32]{1,0}) tuple(%async-collective-done, %collective-permute-done)
}
"""
)


def test_tpu_async_collective_fusions_count_one_all_gather():
    got = collectives(parse_module(TPU_ASYNC))
    gathers = [c for c in got if c.kind == "all-gather"]
    assert len(gathers) == 1  # start, continuation and done hold one all-gather (channel 7), not three
    (ag,) = gathers
    assert (ag.bytes, ag.dtype, ag.group_size) == (128 * 32 * BF16, "bf16", 2)
    assert axes_of_groups([list(g) for g in ag.groups], MESH) == ("X",)


def test_the_overhang_of_a_padded_reduce_scatter_is_explained():
    got = by_name(collectives(parse_module(TPU_ASYNC)))
    rs = got["fusion.5"]  # the all-reduce-scatter fusion: one reduce-scatter of its unpadded operand
    assert (rs.kind, rs.bytes) == ("reduce-scatter", 4 * 32 * BF16) and not rs.explained
    cp = got["collective-permute-start"]
    assert (cp.kind, cp.bytes) == ("permute", 1 * 32 * BF16)
    assert "overhang of the padded reduce-scatter fusion.5" in cp.explained


# ----- loops -------------------------------------------------------------------------------------------

LOOP = hlo(
    """\
HloModule jit_loop, is_scheduled=true, entry_computation_layout={(f32[8,16]{1,0}, f32[16,16]{1,0},
      s32[])->f32[8,16]{1,0}}, num_partitions=8

%inner_body (p.2: (s32[], f32[8,16])) -> (s32[], f32[8,16]) {
  %p.2 = (s32[], f32[8,16]{1,0}) parameter(0)
  %j = s32[] get-tuple-element(%p.2), index=0
  %y = f32[8,16]{1,0} get-tuple-element(%p.2), index=1
  %one.2 = s32[] constant(1)
  %j.next = s32[] add(%j, %one.2)
  %ar.inner = f32[8,16]{1,0} all-reduce(%y), channel_id=3, replica_groups={{0,4},{1,5},{2,6},{3,7}},
      use_global_device_ids=true, to_apply=%sum
  ROOT %t.2 = (s32[], f32[8,16]{1,0}) tuple(%j.next, %ar.inner)
}

%inner_cond (p.3: (s32[], f32[8,16])) -> pred[] {
  %p.3 = (s32[], f32[8,16]{1,0}) parameter(0)
  %j.1 = s32[] get-tuple-element(%p.3), index=0
  %two = s32[] constant(2)
  ROOT %lt.1 = pred[] compare(%j.1, %two), direction=LT
}

%sum (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %add.0 = f32[] add(%a, %b)
}

%body (p: (s32[], f32[8,16], f32[16,16])) -> (s32[], f32[8,16], f32[16,16]) {
  %p = (s32[], f32[8,16]{1,0}, f32[16,16]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %x = f32[8,16]{1,0} get-tuple-element(%p), index=1
  %w = f32[16,16]{1,0} get-tuple-element(%p), index=2
  %one = s32[] constant(1)
  %i.next = s32[] add(%i, %one)
  %cp = f32[8,16]{1,0} collective-permute(%x), channel_id=1,
      source_target_pairs={{0,1},{1,2},{2,3},{3,0},{4,5},{5,6},{6,7},{7,4}},
      metadata={op_name="jit(f)/while/body/ppermute"}
  %dot.1 = f32[8,16]{1,0} dot(%cp, %w), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  %zero.1 = s32[] constant(0)
  %init.1 = (s32[], f32[8,16]{1,0}) tuple(%zero.1, %dot.1)
  %while.inner = (s32[], f32[8,16]{1,0}) while(%init.1), condition=%inner_cond, body=%inner_body,
      backend_config={"known_trip_count":{"n":"2"}}
  %x.next = f32[8,16]{1,0} get-tuple-element(%while.inner), index=1
  ROOT %t = (s32[], f32[8,16]{1,0}, f32[16,16]{1,0}) tuple(%i.next, %x.next, %w)
}

%cond (p.1: (s32[], f32[8,16], f32[16,16])) -> pred[] {
  %p.1 = (s32[], f32[8,16]{1,0}, f32[16,16]{1,0}) parameter(0)
  %i.1 = s32[] get-tuple-element(%p.1), index=0
  %five = s32[] constant(5)
  ROOT %lt = pred[] compare(%i.1, %five), direction=LT
}

%body.2 (q: (s32[], f32[8,16])) -> (s32[], f32[8,16]) {
  %q = (s32[], f32[8,16]{1,0}) parameter(0)
  %k = s32[] get-tuple-element(%q), index=0
  %z = f32[8,16]{1,0} get-tuple-element(%q), index=1
  %ag.unknown = f32[16,16]{1,0} all-gather(%z), channel_id=4, replica_groups={{0,4},{1,5},{2,6},{3,7}},
      dimensions={0}, use_global_device_ids=true
  %z.next = f32[8,16]{1,0} slice(%ag.unknown), slice={[0:8], [0:16]}
  %one.3 = s32[] constant(1)
  %k.next = s32[] subtract(%k, %one.3)
  ROOT %t.3 = (s32[], f32[8,16]{1,0}) tuple(%k.next, %z.next)
}

%cond.2 (q.1: (s32[], f32[8,16])) -> pred[] {
  %q.1 = (s32[], f32[8,16]{1,0}) parameter(0)
  %k.1 = s32[] get-tuple-element(%q.1), index=0
  %zero.2 = s32[] constant(0)
  ROOT %gt.2 = pred[] compare(%k.1, %zero.2), direction=GT
}

ENTRY %main.30_spmd (param.0: f32[8,16], param.1: f32[16,16], param.2: s32[]) -> f32[8,16] {
  %param.0 = f32[8,16]{1,0} parameter(0)
  %param.1 = f32[16,16]{1,0} parameter(1)
  %param.2 = s32[] parameter(2)
  %zero = s32[] constant(0)
  %init = (s32[], f32[8,16]{1,0}, f32[16,16]{1,0}) tuple(%zero, %param.0, %param.1)
  %while = (s32[], f32[8,16]{1,0}, f32[16,16]{1,0}) while(%init), condition=%cond, body=%body,
      metadata={op_name="jit(f)/while"}, backend_config={"known_trip_count":{"n":"5"}}
  %out = f32[8,16]{1,0} get-tuple-element(%while), index=1
  %ar.outer = f32[8,16]{1,0} all-reduce(%out), channel_id=2, replica_groups={{0,1,2,3},{4,5,6,7}},
      use_global_device_ids=true, to_apply=%sum
  %init.2 = (s32[], f32[8,16]{1,0}) tuple(%param.2, %ar.outer)
  %while.2 = (s32[], f32[8,16]{1,0}) while(%init.2), condition=%cond.2, body=%body.2
  ROOT %res = f32[8,16]{1,0} get-tuple-element(%while.2), index=1
}
"""
)


def test_loop_trip_counts_multiply():
    m = parse_module(LOOP)
    got = by_name(collectives(m))
    assert set(got) == {"cp", "ar.inner", "ar.outer", "ag.unknown"}
    cp = got["cp"]
    assert (cp.kind, cp.bytes, cp.times) == ("permute", 8 * 16 * F32, 5)
    assert cp.op_name == "jit(f)/while/body/ppermute"
    assert got["ar.inner"].times == 5 * 2  # a loop of 2 inside the loop of 5
    assert got["ar.outer"].times == 1
    assert got["ag.unknown"].times == 1  # data-dependent loop, no known_trip_count: counted once
    (d,) = dots(m)
    assert d.name == "dot.1" and d.times == 5
    assert d.flops == 2 * (8 * 16) * 16  # per execution; the trip count is in .times


# ----- matmuls ------------------------------------------------------------------------------------------

DOTS = hlo(
    """\
HloModule jit_dots, is_scheduled=true, entry_computation_layout={(f32[4,8,16]{2,1,0}, f32[4,16,32]{2,1,0},
      bf16[56,88]{1,0}, bf16[88,40]{1,0}, f32[6,10,12]{2,1,0}, /*index=5*/f32[10,12,7]{2,1,0}, f32[24,72]{1,0},
      f32[72,40]{1,0})->(f32[4,8,32]{2,1,0}, bf16[56,40]{1,0}, f32[6,7]{1,0}, f32[24,40]{1,0})}

%fused_computation (param_0: bf16[56,88], param_1: bf16[88,40]) -> bf16[56,40] {
  %param_0 = bf16[56,88]{1,0} parameter(0)
  %param_1 = bf16[88,40]{1,0} parameter(1)
  %dot.2 = bf16[56,40]{1,0} dot(%param_0, %param_1), lhs_contracting_dims={1}, rhs_contracting_dims={0},
      metadata={op_name="jit(f)/dot_general"}
  %constant.1 = bf16[] constant(2)
  %broadcast.1 = bf16[56,40]{1,0} broadcast(%constant.1), dimensions={}
  ROOT %multiply.1 = bf16[56,40]{1,0} multiply(%dot.2, %broadcast.1)
}

ENTRY %main.12 (Arg_0.1: f32[4,8,16], Arg_1.2: f32[4,16,32], Arg_2.3: bf16[56,88], Arg_3.4: bf16[88,40],
      Arg_4.5: f32[6,10,12], Arg_5.6: f32[10,12,7], Arg_6.7: f32[24,72], Arg_7.8: f32[72,40]) -> (f32[4,8,32],
      bf16[56,40], f32[6,7], f32[24,40]) {
  %Arg_0.1 = f32[4,8,16]{2,1,0} parameter(0)
  %Arg_1.2 = f32[4,16,32]{2,1,0} parameter(1)
  %Arg_2.3 = bf16[56,88]{1,0} parameter(2)
  %Arg_3.4 = bf16[88,40]{1,0} parameter(3)
  %Arg_4.5 = f32[6,10,12]{2,1,0} parameter(4)
  %Arg_5.6 = f32[10,12,7]{2,1,0} parameter(5)
  %Arg_6.7 = f32[24,72]{1,0} parameter(6)
  %Arg_7.8 = f32[72,40]{1,0} parameter(7)
  %dot.1 = f32[4,8,32]{2,1,0} dot(f32[4,8,16]{2,1,0} %Arg_0.1, f32[4,16,32]{2,1,0} %Arg_1.2), lhs_batch_dims={0},
      lhs_contracting_dims={2}, rhs_batch_dims={0}, rhs_contracting_dims={1}
  %fusion.1 = bf16[56,40]{1,0} fusion(%Arg_2.3, %Arg_3.4), kind=kOutput, calls=%fused_computation
  %dot.3 = f32[6,7]{1,0} dot(%Arg_4.5, %Arg_5.6), lhs_contracting_dims={1,2}, rhs_contracting_dims={0,1}
  %cublas-gemm.1 = (f32[24,40]{1,0}, s8[4194304]{0}) custom-call(f32[24,72]{1,0} %Arg_6.7, f32[72,40]{1,0} %Arg_7.8),
      custom_call_target="__cublas$gemm", backend_config=@GEMM_CFG@
  %get-tuple-element.1 = f32[24,40]{1,0} get-tuple-element(%cublas-gemm.1), index=0
  %custom-call.2 = f32[24,72]{1,0} custom-call(%Arg_6.7), custom_call_target="Sharding", sharding={replicated}
  ROOT %tuple.1 = (f32[4,8,32]{2,1,0}, bf16[56,40]{1,0}, f32[6,7]{1,0}, f32[24,40]{1,0}) tuple(%dot.1, %fusion.1,
      %dot.3, %get-tuple-element.1)
}
""",
    GEMM_CFG=GEMM_CFG,
)


def test_dot_flops():
    m = parse_module(DOTS)
    got = by_name(dots(m))
    assert set(got) == {"dot.1", "dot.2", "dot.3", "cublas-gemm.1"}
    # batched: out [4,8,32], contracting 16
    assert got["dot.1"].flops == 2 * (4 * 8 * 32) * 16
    # inside the fusion's called computation, operands resolved by name to the fusion parameters
    assert got["dot.2"].flops == 2 * (56 * 40) * 88
    # two contracting dims: out [6,7], contracting 10*12
    assert got["dot.3"].flops == 2 * (6 * 7) * (10 * 12)
    # cuBLAS GEMM: output is the first tuple element (the s8 workspace is not), K from the backend config
    assert got["cublas-gemm.1"].flops == 2 * (24 * 40) * 72
    assert all(d.times == 1 for d in got.values())
    assert collectives(m) == []


# ----- source lines -------------------------------------------------------------------------------------

SOURCES = hlo(
    """\
HloModule jit_src, is_scheduled=true, entry_computation_layout={(f32[8,16]{1,0})->f32[8,16]{1,0}}, num_partitions=8

FileNames
1 "/home/u/model.py"
2 "/home/u/layers.py"

FunctionNames
1 "<module>"
2 "forward"
3 "mlp"

FileLocations
1 {file_name_id=1 function_name_id=1 line=90 end_line=90 column=2 end_column=30}
2 {file_name_id=1 function_name_id=2 line=41 end_line=41 column=8 end_column=30}
3 {file_name_id=2 function_name_id=3 line=17 end_line=17 column=12 end_column=40}

StackFrames
1 {file_location_id=1 parent_frame_id=1}
2 {file_location_id=2 parent_frame_id=1}
3 {file_location_id=3 parent_frame_id=2}


%sum (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %add = f32[] add(%a, %b)
}

ENTRY %main.7_spmd (param.0: f32[8,16]) -> f32[8,16] {
  %param.0 = f32[8,16]{1,0} parameter(0), metadata={op_name="x"}
  %ar.1 = f32[8,16]{1,0} all-reduce(%param.0), channel_id=1, replica_groups={{0,1,2,3},{4,5,6,7}},
      use_global_device_ids=true, to_apply=%sum, metadata={op_name="jit(forward)/psum" stack_frame_id=3}
  %ar.2 = f32[8,16]{1,0} all-reduce(%ar.1), channel_id=2, replica_groups={{0,4},{1,5},{2,6},{3,7}},
      use_global_device_ids=true, to_apply=%sum, metadata={op_name="jit(forward)/psum" stack_frame_id=2}
  %ar.3 = f32[8,16]{1,0} all-reduce(%ar.2), channel_id=3, replica_groups={{0,4},{1,5},{2,6},{3,7}},
      use_global_device_ids=true, to_apply=%sum,
      metadata={op_name="jit(forward)/psum" source_file="/home/u/train.py" source_line=123}
  ROOT %ar.4 = f32[8,16]{1,0} all-reduce(%ar.3), channel_id=4, replica_groups={{0,4},{1,5},{2,6},{3,7}},
      use_global_device_ids=true, to_apply=%sum
}
"""
)


def test_source_lines_from_stack_frames_and_source_file():
    m = parse_module(SOURCES)
    assert m.frames == {
        1: ("/home/u/model.py", 90, "<module>"),
        2: ("/home/u/model.py", 41, "forward"),
        3: ("/home/u/layers.py", 17, "mlp"),
    }
    assert set(m.computations) == {"sum", "main.7_spmd"}  # the tables are not computations
    got = by_name(collectives(m))
    assert got["ar.1"].source == "/home/u/layers.py:17 (mlp)"
    assert got["ar.2"].source == "/home/u/model.py:41 (forward)"
    assert got["ar.3"].source == "/home/u/train.py:123"
    assert got["ar.4"].source == "" and got["ar.4"].op_name == ""
    assert got["ar.1"].op_name == "jit(forward)/psum"


# ----- a real compiled program ------------------------------------------------------------------------


def test_real_shard_map_program(jax_devices):
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    X, Y = 2, 4
    mesh = jax.make_mesh((X, Y), ("X", "Y"), devices=jax_devices)
    M, K, N, C = 56, 88, 40, 24  # rows, contraction, columns, columns kept before the reduce-scatter
    perm = [(i, (i + 1) % Y) for i in range(Y)]

    def body(a, w):  # a: [M/X, K] per device, w: [K, N] replicated
        g = jax.lax.all_gather(a, "X", axis=0, tiled=True)  # [M, K]
        h = jnp.dot(g, w)  # [M, N]
        s = jax.lax.psum(h, "Y")  # [M, N]
        r = jax.lax.psum_scatter(s[:, :C], "Y", scatter_dimension=0, tiled=True)  # [M/Y, C]
        t = jax.lax.all_to_all(r, "X", 0, 1, tiled=True)  # [M/Y/X, C*X]

        def step(i, x):
            return jax.lax.ppermute(x, "Y", perm) * 1.5  # marker: ppermute

        return jax.lax.fori_loop(0, 3, step, t)

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("X", None), P()), out_specs=P(("X", "Y")), check_vma=False))

    def arg(shape, spec):
        return jax.ShapeDtypeStruct(shape, np.float32, sharding=NamedSharding(mesh, spec))

    text = f.lower(arg((M, K), P("X", None)), arg((K, N), P())).compile().as_text()
    m = parse_module(text)
    got = collectives(m)
    by_kind = {}
    for c in got:
        by_kind.setdefault(c.kind, []).append(c)
    assert sorted(by_kind) == ["all-gather", "all-reduce", "all-to-all", "permute", "reduce-scatter"]
    assert all(len(v) == 1 for v in by_kind.values()), got
    ag, ar, rs, a2a, cp = (
        by_kind[k][0] for k in ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "permute")
    )

    def axes(c):
        return axes_of_groups([list(g) for g in c.groups], MESH)

    assert (axes(ag), axes(ar), axes(rs), axes(a2a)) == (("X",), ("Y",), ("Y",), ("X",))
    assert axes_of_pairs(list(cp.pairs), MESH) == ("Y",)
    assert set(cp.pairs) == {(x * Y + i, x * Y + (i + 1) % Y) for x in range(X) for i in range(Y)}
    assert (ag.group_size, ar.group_size, rs.group_size, a2a.group_size) == (X, Y, Y, X)

    assert ag.bytes == M * K * F32  # gathered output
    assert ar.bytes == M * N * F32  # summed array
    assert rs.bytes == M * C * F32  # unreduced input
    assert a2a.bytes == (M // Y) * C * F32 * X  # the [M/Y, C] buffer times the group size
    assert cp.bytes == (M // Y // X) * (C * X) * F32  # the buffer sent each step
    assert all(c.dtype == "f32" for c in got)

    assert cp.times == 3  # the fori_loop stays a while loop with a known trip count
    assert all(c.times == 1 for c in got if c is not cp)
    (loop,) = [i for c in m.computations.values() for i in c if i.opcode == "while"]
    assert '"known_trip_count":{"n":"3"}' in loop.attr("backend_config")

    (d,) = dots(m)
    assert d.flops == 2 * M * K * N and d.times == 1

    # the permute's source line is the ppermute call above (through the stack-frame tables)
    line = next(i for i, s in enumerate(Path(__file__).read_text().splitlines(), 1) if s.endswith("# marker: ppermute"))
    assert cp.source.startswith(f"{__file__}:{line} (") and cp.source.endswith("step)")
    assert "ppermute" in cp.op_name


def test_mesh_replica_groups_with_device_ids():
    """XLA prints some groups over a reshaped mesh of permuted device ids (jax 0.10 decode's embedding AllReduce):
    ``mesh['axis_0'=4,'axis_1'=1,'axis_2'=2], device_ids=([2,4]T(1,0)) {'axis_0'}`` is the model axis of
    data=2 x model=4, not every device."""
    text = "mesh['axis_0'=4,'axis_1'=1,'axis_2'=2], device_ids=([2,4]T(1,0)) {'axis_0'}"
    groups = parse_replica_groups(text)
    assert groups == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert axes_of_groups(groups, {"data": 2, "model": 4}) == ("model",)
    over_data = parse_replica_groups("mesh['axis_0'=4,'axis_1'=1,'axis_2'=2], device_ids=([2,4]T(1,0)) {'axis_2'}")
    assert axes_of_groups(over_data, {"data": 2, "model": 4}) == ("data",)


# A splash attention call as libtpu prints it (trimmed): its kernel metadata on lines of its own, the op's metadata
# after them; q [b=4, n=2, t=256, h=128], k and v [4, k=1, 256, 128]; its blocks 128 x 64.
SPLASH_HLO = "\n".join(
    [
        "HloModule splash, is_scheduled=true",
        "",
        "ENTRY %main (q: bf16[4,2,256,128], k: bf16[4,1,256,128], v: bf16[4,1,256,128], m: s8[1,2,4]) -> "
        "f32[4,2,256,128] {",
        "  %q = bf16[4,2,256,128]{3,2,1,0} parameter(0)",
        "  %k = bf16[4,1,256,128]{3,2,1,0} parameter(1)",
        "  %v = bf16[4,1,256,128]{3,2,1,0} parameter(2)",
        "  %m = s8[1,2,4]{2,1,0} parameter(3)",
        "  %splash_mha_fwd_residuals.1 = (f32[4,2,256,128]{3,2,1,0}) custom-call(%m, %m, %q, %k, %v), "
        'custom_call_target="tpu_custom_call", frontend_attributes={kernel_metadata={',
        '"xprof_metadata":"{\\"block_q\\": 128, \\"block_kv\\": 64, \\"use_fused_bwd_kernel\\": false}"',
        '}}, metadata={op_name="jit(step)/splash_mha_fwd_residuals/pallas_call"}, '
        'backend_config={"custom_call_config":{"body":"TUzv"}}',
        "  ROOT %out = f32[4,2,256,128]{3,2,1,0} get-tuple-element(%splash_mha_fwd_residuals.1), index=0",
        "}",
    ]
)


def test_a_splash_call_on_several_lines_is_one_instruction_counted_from_its_blocks():
    """Causal, 256 tokens in query blocks of 128 and key blocks of 64: query block 0 sees key blocks 0-1, block 1
    sees 0-3, so 6 of the 8 pairs; each 2 matmuls of 128 x 64 x 128 (2 FLOPs a multiply-add), per head and
    sequence: 4 x 2 x 6 x 4 x 128 x 64 x 128 = 201,326,592 FLOPs."""
    module = parse_module(SPLASH_HLO)
    names = [i.name for i in module.computations[module.entry]]
    assert names == ["q", "k", "v", "m", "splash_mha_fwd_residuals.1", "out"]
    call = module.computations[module.entry][4]
    assert "splash_mha_fwd_residuals/pallas_call" in call.attr("metadata")
    (dot,) = dots(module)
    assert (dot.name, dot.flops) == ("splash_mha_fwd_residuals.1", 4 * 2 * 6 * 4 * 128 * 64 * 128)


def test_the_ledger_prices_a_kernel_call_by_the_flops_the_audit_counts():
    """The ledger's op for the splash call carries its 201,326,592 FLOPs (not a memory-bound copy's 0), in bf16:
    at a v5e's roofline in bf16 (197 TFLOP/s, 820 GB/s), the slower of its compute and its bytes."""
    from lab.core.hardware import get_chip
    from lab.report.ledger import predict_ops

    chip = get_chip("tpu-v5e")
    (op,) = [o for o in predict_ops(SPLASH_HLO, chip, {}) if o.name.startswith("splash")]
    assert op.flops == 4 * 2 * 6 * 4 * 128 * 64 * 128
    assert op.predicted_s == pytest.approx(max(op.flops / chip.peak_flops["bf16"], op.bytes / chip.hbm_bandwidth))
