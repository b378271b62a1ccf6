import pytest

from lab.core.errors import UserError
from lab.core.hardware import get_chip
from lab.predict.collectives import collective_time
from lab.predict.program.sharded_matmul import plan_sharded_matmul

V5E = get_chip("v5e")
MESH = {"X": 2, "Y": 4}
SIZES = {"I": 7 * 64, "J": 11 * 64, "K": 13 * 64}  # prime-ish multiples of every mesh size


def plan(expr, sizes=SIZES, mesh=MESH, **kw):
    return plan_sharded_matmul(expr, sizes, mesh, V5E, "bf16", **kw)


def kinds(p):
    return [(c.kind, c.axes, c.operand) for c in p.collectives]


def test_case1_no_communication():
    p = plan("A[I_X, J] * B[J, K_Y]")
    assert p.cases == (1,)
    assert p.collectives == ()
    assert p.output == "C[I_X, K_Y]"
    assert p.local.flops == 2 * (SIZES["I"] // 2) * SIZES["J"] * (SIZES["K"] // 4)


def test_case2_allgathers_the_sharded_operand():
    p = plan("A[I, J_X] * B[J, K]")
    assert p.cases == (2,)
    assert kinds(p) == [("all-gather", ("X",), "lhs")]
    assert p.collectives[0].bytes == SIZES["I"] * SIZES["J"] * 2  # the gathered A[I, J] in bf16
    assert p.output == "C[I, K]"
    # Also sharded over Y on I: the gather moves only A[I_Y, J] (the book's V / Y).
    q = plan("A[I_Y, J_X] * B[J, K]")
    assert q.collectives[0].bytes == SIZES["I"] // 4 * SIZES["J"] * 2
    assert q.output == "C[I_Y, K]"


def test_case2_rhs_and_different_axes():
    p = plan("A[I, J] * B[J_Y, K]")
    assert kinds(p) == [("all-gather", ("Y",), "rhs")]
    # Contracting dim sharded along different axes: each side gathers what it does not share.
    q = plan("A[I, J_X] * B[J_Y, K]")
    assert sorted(kinds(q)) == [("all-gather", ("X",), "lhs"), ("all-gather", ("Y",), "rhs")]
    # A shared leading axis stays sharded and is reduced afterwards (cases 2 and 3 together).
    r = plan("A[I, J_XY] * B[J_X, K]")
    assert r.cases == (2, 3)
    assert kinds(r) == [("all-gather", ("Y",), "lhs"), ("all-reduce", ("X",), "out")]


def test_case3_allreduce_reducescatter_or_unreduced():
    p = plan("A[I, J_X] * B[J_X, K]")
    assert p.cases == (3,)
    assert kinds(p) == [("all-reduce", ("X",), "out")]
    assert p.collectives[0].bytes == SIZES["I"] * SIZES["K"] * 2
    assert p.output == "C[I, K]"
    rs = plan("A[I, J_X] * B[J_X, K] -> C[I, K_X]")
    assert kinds(rs) == [("reduce-scatter", ("X",), "out")]
    assert rs.output == "C[I, K_X]"
    assert rs.comm_s == pytest.approx(p.comm_s / 2)  # AllReduce = ReduceScatter + AllGather
    keep = plan("A[I, J_X] * B[J_X, K] -> C[I, K]{U_X}")
    assert keep.collectives == () and keep.output == "C[I, K]{U_X}"


def test_case4_gathers_the_cheaper_operand():
    # A is the smaller operand here (I*J < J*K), so A is gathered over X.
    p = plan("A[I_X, J] * B[J, K_X]")
    assert p.cases == (4,)
    assert kinds(p) == [("all-gather", ("X",), "lhs")]
    assert p.output == "C[I, K_X]"
    big_a = plan("A[I_X, J] * B[J, K_X]", sizes={"I": 4096, "J": 64, "K": 64})
    assert kinds(big_a) == [("all-gather", ("X",), "rhs")]
    assert big_a.output == "C[I_X, K]"


def test_output_resharding():
    a2a = plan("A[I_X, J] * B[J, K] -> C[I, K_X]")
    assert kinds(a2a) == [("all-to-all", ("X",), "out")]
    gather = plan("A[I_X, J] * B[J, K_Y] -> C[I_X, K]")
    assert kinds(gather) == [("all-gather", ("Y",), "out")]
    slice_ = plan("A[I, J] * B[J, K] -> C[I_X, K_Y]")
    assert slice_.collectives == () and slice_.output == "C[I_X, K_Y]" and len(slice_.notes) == 2
    order = plan("A[I_XY, J] * B[J, K] -> C[I_YX, K]")
    assert kinds(order) == [("permute", ("Y", "X"), "out")]


def test_batch_dims():
    p = plan("A[H_X, I, J] * B[H_X, J, K_Y] -> C[H_X, I, K_Y]", sizes=SIZES | {"H": 16})
    assert p.collectives == () and p.cases == (1,)
    q = plan("A[H_X, I, J] * B[H, J, K] -> C[H_X, I, K]", sizes=SIZES | {"H": 16})
    assert kinds(q) == [("all-gather", ("X",), "lhs")]


def test_megatron_mlp_pair():
    # training.md TP: In[B, D] W_in[D, F_Y] needs nothing; W_out[F_Y, D] gives Out{U_Y}: one AllReduce of [B, D].
    sizes = {"B": 1024, "D": 4096, "F": 16384}
    up = plan("In[B, D] * Win[D, F_Y]", sizes)
    down = plan("H[B, F_Y] * Wout[F_Y, D] -> Out[B, D]", sizes)
    assert up.collectives == ()
    assert kinds(down) == [("all-reduce", ("Y",), "out")]
    assert down.collectives[0].bytes == 1024 * 4096 * 2


def test_book_two_chip_threshold_d_8755():
    # roofline.md: a D-sharded matmul on 2 v5e chips exchanging partial sums is compute-bound iff D > 8755.
    def margin(d):
        p = plan("A[B, D_X] * W[D_X, F]", sizes={"B": 8192, "D": d, "F": 8192}, mesh={"X": 2})
        assert p.local.bound == "compute"
        return p.compute_s - p.comm_s

    assert margin(8192) < 0 < margin(9216)
    assert margin(8754) < 0 < margin(8758)


def test_times_add_up():
    p = plan("A[I, J_X] * B[J, K_Y]", wraparound=False)
    assert p.comm_s == pytest.approx(sum(c.cost.time_s for c in p.collectives))
    assert p.time_s == pytest.approx(p.compute_s + p.comm_s)
    assert p.overlapped_time_s == max(p.compute_s, p.comm_s)
    v = SIZES["I"] * SIZES["J"] * 2
    assert p.collectives[0].cost == collective_time("all-gather", v, 2, V5E, wraparound=False)


@pytest.mark.parametrize(
    ("expr", "sizes", "mesh", "match"),
    [
        ("A[I, J] * B[K, L]", SIZES | {"L": 8}, MESH, "share no dim to contract"),
        ("A[I_X, J] * B[J, K]", {"I": 7, "J": 8, "K": 8}, MESH, r"dim I=7 does not divide over X"),
        ("A[I_Q, J] * B[J, K]", SIZES, MESH, "mesh axis 'Q' is not in the mesh"),
        ("A[I, J] * B[J, K]", {"I": 8, "J": 8}, MESH, "no size for dim 'K'"),
        ("A[I, J] *_K B[J, K]", SIZES, MESH, r"\*_K names the contraction, but the operands share J"),
        ("A[I, J] * B[J, K] -> C[I, Z]", SIZES | {"Z": 8}, MESH, "output dim 'Z' is in neither operand"),
        ("A[I, J] * B[J, K] -> C[I]", SIZES, MESH, "dim 'K' appears in one operand only"),
        ("A[I, J] * B[J, K] -> C[I, K]{U_X}", SIZES, MESH, "already reduced over it"),
    ],
)
def test_bad_input(expr, sizes, mesh, match):
    with pytest.raises(UserError, match=match):
        plan(expr, sizes=sizes, mesh=mesh)
