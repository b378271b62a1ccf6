import re

import pytest

from lab.core.errors import UserError
from lab.core.hardware import get_chip
from lab.predict.collectives import KINDS, canonical_kind, collective_time

V5E, V5P, H100 = get_chip("v5e"), get_chip("v5p"), get_chip("h100")
BF16_2048x8192 = 2048 * 8192 * 2


def test_book_allgather_on_v5e_ring_and_line():
    # sharding.md pop quiz: AllGather of bf16[2048, 8192] over a v5e axis of 4:
    # about 373 us with wraparound (V / W_bidi) and about 559 us without ((N-1)(V/N)/W_link).
    ring = collective_time("all-gather", BF16_2048x8192, 4, V5E)
    line = collective_time("all-gather", BF16_2048x8192, 4, V5E, wraparound=False)
    assert ring.time_s == pytest.approx(373e-6, rel=0.01)
    assert line.time_s == pytest.approx(559e-6, rel=0.01)
    assert not ring.latency_bound and not line.latency_bound


def test_book_latency_threshold_on_v5e():
    # sharding.md: a buffer under 4.5e10 * 1e-6 = 45 kB per shard is latency-bound on v5e.
    assert V5E.latency_bound_bytes == pytest.approx(45e3)
    n = 8
    small = collective_time("all-gather", n * 44e3, n, V5E)
    large = collective_time("all-gather", n * 46e3, n, V5E)
    assert small.latency_bound and not large.latency_bound
    assert small.time_s == pytest.approx((n // 2) * 1e-6)  # floor(N/2) hops of T_min


def test_book_allgather_in_an_h100_node():
    # gpus.md: B (N-1)/(N W) with W = 450 GB/s: bf16[1024, 16384] across 8 H100s is about 65 us.
    c = collective_time("all-gather", 1024 * 16384 * 2, 8, H100)
    assert c.time_s == pytest.approx(65e-6, rel=0.02)
    assert c.link == "nvlink"


def test_book_allgather_across_many_h100_nodes():
    # gpus.md: across nodes the node egress (400 GB/s) bounds it; for 32 nodes V (M-1)/(M W_node) ~ V / 413 GB/s.
    v = 1e9
    c = collective_time("all-gather", v, 256, H100, scope="cross-node")
    assert c.time_s == pytest.approx(v / 413e9, rel=0.01)
    assert c.link == "nvlink+network"


def test_gpu_alltoall_in_node_is_an_eighth():
    # gpus.md: in-node AllToAll B (N-1)/(W N^2) ~ B / (8W), half the TPU ring's B / (4W).
    v = 1e9
    c = collective_time("all-to-all", v, 8, H100)
    assert c.bandwidth_s == pytest.approx(v * 7 / (64 * 4.5e11))


@pytest.mark.parametrize("n", [2, 4, 8, 16])
def test_ring_allgather_is_independent_of_axis_size(n):
    c = collective_time("all-gather", BF16_2048x8192, n, V5E)
    assert c.bandwidth_s == pytest.approx(BF16_2048x8192 / (2 * 4.5e10))


@pytest.mark.parametrize("n", [4, 8, 16])
def test_book_summary_ratios_on_a_ring(n):
    # sharding.md: ReduceScatter = AllGather; AllReduce = 2 AllGather; AllToAll = AllGather / 4.
    ag = collective_time("all-gather", BF16_2048x8192, n, V5E).bandwidth_s
    assert collective_time("reduce-scatter", BF16_2048x8192, n, V5E).bandwidth_s == pytest.approx(ag)
    assert collective_time("all-reduce", BF16_2048x8192, n, V5E).bandwidth_s == pytest.approx(2 * ag)
    assert collective_time("all-to-all", BF16_2048x8192, n, V5E).bandwidth_s == pytest.approx(ag / 4)


def test_two_axes_double_the_bandwidth_and_add_the_latency():
    # sharding.md: AllGather_XY = max(T_min * sum(|X_i|/2), V / (W_ici * n_axes)).
    one = collective_time("all-gather", BF16_2048x8192, 4, V5E)
    two = collective_time("all-gather", BF16_2048x8192, (4, 4), V5E)
    assert two.bandwidth_s == pytest.approx(one.bandwidth_s / 2)
    assert two.hops == 4
    tiny = collective_time("all-gather", 1024, (4, 4), V5E)
    assert tiny.latency_bound and tiny.time_s == pytest.approx(4e-6)


def test_multi_axis_alltoall_follows_the_largest_axis():
    # sharding.md: AllToAll on an A x B torus = V * max(A, B) / (4 N W_bidi).
    v = 1e9
    c = collective_time("all-to-all", v, (4, 8), V5P)
    assert c.bandwidth_s == pytest.approx(v * 8 / (4 * 32 * 2 * 9e10))


def test_two_chip_partial_sum_exchange():
    # roofline.md: two chips exchanging partial sums of [B, F] bf16 cost 2BF / 4.5e10 (one link, one way).
    b, f = 4096, 8192
    c = collective_time("all-reduce", 2 * b * f, 2, V5E)
    assert c.time_s == pytest.approx(2 * b * f / 4.5e10)


def test_dcn_across_slices():
    # training.md: DCN at 6.25e9 B/s per v5p chip; an AllGather across 2 slices moves half of V per chip.
    c = collective_time("all-gather", 1e9, 2, V5P, scope="cross-node")
    assert c.link == "dcn"
    assert c.bandwidth_s == pytest.approx(0.5e9 / 6.25e9)


def test_permute_is_one_link():
    c = collective_time("permute", 1e8, 8, V5E)
    assert c.time_s == pytest.approx(1e8 / 4.5e10) and c.hops == 1
    line = collective_time("permute", 1e8, 8, V5E, wraparound=False)
    assert line.time_s > c.time_s


def test_group_of_one_costs_nothing():
    for kind in KINDS:
        assert collective_time(kind, 1e6, 1, H100).time_s == 0
        assert collective_time(kind, 1e6, (1, 1), V5E).time_s == 0


@pytest.mark.parametrize(
    ("alias", "kind"),
    [
        ("AllGather", "all-gather"),
        ("psum", "all-reduce"),
        ("reduce_scatter", "reduce-scatter"),
        ("ppermute", "permute"),
        ("all-to-all", "all-to-all"),
        ("collective-permute", "permute"),
    ],
)
def test_kind_aliases(alias, kind):
    assert canonical_kind(alias) == kind


@pytest.mark.parametrize(
    ("args", "kwargs", "match"),
    [
        (("gossip", 1e6, 4, V5E), {}, "unknown collective 'gossip'"),
        (("all-gather", 0, 4, V5E), {}, "--bytes must be a positive number"),
        (("all-gather", -5, 4, V5E), {}, "--bytes must be a positive number"),
        (("all-gather", 1e6, 0, V5E), {}, "axis size 0 must be a positive integer"),
        (("all-gather", 1e6, 16, H100), {}, "does not fit in one 8-chip NVLink node; use --scope cross-node"),
        (("all-gather", 1e6, 12, H100), {"scope": "cross-node"}, "not a whole number of 8-GPU nodes"),
        (("all-gather", 1e6, 4, V5E), {"scope": "rack"}, "unknown scope 'rack'"),
    ],
)
def test_bad_input(args, kwargs, match):
    with pytest.raises(UserError, match=match):
        collective_time(*args, **kwargs)


def test_cross_node_collectives_reach_less_of_the_nic_the_smaller_they_are():
    """C14's per-GPU NIC fractions (32 B200 over EFA): 12.5% at 16 MiB, 44% at 256 MiB, 70% at 1 GiB, 74% at 16 GiB,
    interpolated in log size; sends between two GPUs (permutes) keep the raw NIC rate."""
    from lab.predict import efficiency as eff

    assert eff.nic_fraction(16 * 2**20) == 0.125 and eff.nic_fraction(2**30) == 0.70
    assert eff.nic_fraction(4 * 2**20) == 0.125 and eff.nic_fraction(2**40) == 0.74  # held at the ends
    assert eff.nic_fraction(512 * 2**20) == pytest.approx((0.44 + 0.70) / 2)  # halfway in log size
    h100 = get_chip("h100")
    assert eff.collective_fraction(h100, "all-gather", 16, "cross-node", 2**30) == 0.70
    assert eff.collective_fraction(h100, "permute", 2, "cross-node", 2**20) == eff.NIC_FRACTION
    assert eff.collective_fraction(get_chip("tpu-v5p"), "all-gather", 16, "cross-node", 2**20) == eff.ICI_FRACTION


def test_a_collective_hidden_behind_gpu_compute_slows_the_compute():
    from lab.predict import efficiency as eff

    h100, v5p = get_chip("h100"), get_chip("tpu-v5p")
    assert eff.overlap_cost(h100, 2.0, 10.0) == pytest.approx(0.189 * 2.0)  # hidden: 18.9% of the overlapped compute
    assert eff.overlap_cost(h100, 10.0, 2.0) == pytest.approx(8.0 + 0.189 * 2.0)  # exposed beyond the compute
    assert eff.overlap_cost(v5p, 2.0, 10.0) == 0.0  # TPUs: DMA engines, no assumed interference


def _calibrated_cpu():
    import dataclasses

    factors = {"collective_factor": {"all-gather": 1.7}, "collective_factor_by_group": {"all-reduce": {"4": 2.5}}}
    return dataclasses.replace(get_chip("cpu"), calibration=factors)


@pytest.mark.parametrize("chip", ["h100", "a100", "tpu-v5e", "tpu-v4", "cpu", "calibrated-cpu"])
def test_comm_time_prices_what_the_collective_model_gives(chip):
    """efficiency.comm_time prices without building CollectiveCost objects: to the bit what collective_on's cost at
    the fabric's efficiency (achievable_time) is, in every case the estimators reach."""
    from lab.predict import efficiency as eff

    c = _calibrated_cpu() if chip == "calibrated-cpu" else get_chip(chip)
    cases = []
    for kind in KINDS:
        for nbytes in (512.0, 3 * 2**20, 2.0**31):
            for group in (2, 4, 8, 16, 64, 256):
                cases.append((kind, nbytes, group, {}))
                cases.append((kind, nbytes, group, {"scope": "cross-node", "members_per_node": 1}))
            cases.append((kind, nbytes, 16, {"axes": (4, 4)}))
            cases.append((kind, nbytes, 32, {"scope": "cross-node"}))
    priced = 0
    for kind, nbytes, group, kw in cases:
        try:
            slow = eff.collective_on(c, kind, nbytes, group, **kw)
        except UserError as exc:  # a group that does not fit the fabric: the same error either way
            with pytest.raises(UserError, match=re.escape(str(exc))):
                eff.comm_time(c, kind, nbytes, group, **kw)
            continue
        assert eff.comm_time(c, kind, nbytes, group, **kw) == eff.achievable_time(
            c, slow, group, kw.get("scope", "node")
        )
        priced += 1
    assert priced >= len(cases) // 2


@pytest.mark.parametrize(
    "kind, nbytes, group, kw, match",
    [
        ("gather", 1e6, 4, {}, "unknown collective 'gather'"),
        ("all-gather", float("inf"), 4, {}, "--bytes must be a positive number"),
        ("all-gather", 1e6, 4, {"scope": "rack"}, "unknown scope 'rack'"),
        ("all-gather", 1e6, 4, {"axes": (2, 0)}, "axis size 0 must be a positive integer"),
    ],
)
def test_comm_time_names_a_bad_value_as_the_collective_model_does(kind, nbytes, group, kw, match):
    from lab.predict import efficiency as eff

    with pytest.raises(UserError, match=re.escape(match)):
        eff.comm_time(get_chip("h100"), kind, nbytes, group, **kw)


def test_comm_time_takes_a_spelling_of_a_kind():
    from lab.predict import efficiency as eff

    h100 = get_chip("h100")
    assert eff.comm_time(h100, "AllReduce", 2.0**24, 8) == eff.comm_time(h100, "all-reduce", 2.0**24, 8) > 0


def test_an_all_gather_on_a_mesh_runs_over_every_link_to_the_group():
    # MI300X: one 64 GB/s link to each peer; a group of D sends over D - 1 of them: V (D-1) / (D (D-1) W) = V / (D W)
    mi = get_chip("mi300x")
    v = 1e9
    for d in (2, 4, 8):
        c = collective_time("all-gather", v, d, mi)
        assert c.bandwidth_s == pytest.approx(v / (d * 6.4e10)) and c.link == "xgmi"
    assert collective_time("permute", v, 8, mi).bandwidth_s == pytest.approx(v / 6.4e10)  # one send, one link
