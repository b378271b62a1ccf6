"""Studies built on the estimators: hardware generations, serving, memory technology, validation."""
