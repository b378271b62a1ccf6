"""Formatting of the figures the outputs print (lab.core.units)."""


def test_a_share_too_small_for_one_decimal_is_said_as_such():
    from lab.core.units import fmt_share

    assert [fmt_share(x) for x in (0.536, 0.001, 0.0004, 0.0)] == ["53.6%", "0.1%", "<0.1%", "0.0%"]
