"""A training job's estimate, from its config to its step time.

``config`` (the job and its parallel degrees, and the checks that refuse it) feeds ``memory`` (bytes per chip),
``comm`` (every collective a step issues, over which parallelism, behind what) and ``step`` (the one step formula);
``estimate`` puts them together (step time, MFU, days, cost). ``remat`` names the recomputation policies and
``limits`` the scaling book's communication thresholds.
"""
