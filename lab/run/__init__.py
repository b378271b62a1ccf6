"""Experiments end to end: the schema, the run pipeline, its environment, the demo."""
