"""The layout planner: ``layouts`` enumerates and ranks every parallel layout of a training job (with each
estimate's interval), ``search`` prices each point from the training estimator's own parts, computed once."""
