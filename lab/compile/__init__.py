"""Compiled truth: the optimized HLO parsed, and the audit of it against the estimator."""
