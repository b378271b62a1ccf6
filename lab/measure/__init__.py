"""Measured truth: microbenchmarks and calibration, profiler traces and their parser."""
