"""The host calibration's sweep settings, each a pair (full, quick): read by :mod:`lab.measure.calibrate`, which
measures, and :mod:`lab.measure.calibrate_describe`, which says what was measured."""

MATMUL_SIZES = ((256, 512, 1024, 2048), (256, 512))
MEMORY_MIB = ((32, 64, 128, 256), (32, 64, 128))
COLLECTIVE_BYTES = (tuple(4096 * 4**i for i in range(7)), (16384, 262144, 2097152, 8388608))
REPEATS = (15, 3)
POINT_BUDGET_S = (1.5, 0.4)  # stop repeating one measurement after this long (once it has 3 repeats)
LATENCY_STEPS = ((1, 17), (1, 9))  # collectives per program in the two programs of a latency measurement

__all__ = ["COLLECTIVE_BYTES", "LATENCY_STEPS", "MATMUL_SIZES", "MEMORY_MIB", "POINT_BUDGET_S", "REPEATS"]
