"""The parallel degrees, one vocabulary for the Plan and the estimators.

A Plan's sharding rules give them (:meth:`lab.core.rules.ShardingRules.degrees`), the training estimator's layout
holds them (``lab.predict.training.config.Layout``), and :func:`lab.core.plan_degrees.plan_from_degrees` takes them
back: data, fully-sharded data, tensor, pipeline, context and expert parallelism, each the number of chips its group
spans. (A module of its own: the analytic commands read it without loading the sharding rules.)
"""

DEGREES = ("dp", "fsdp", "tp", "pp", "cp", "ep")
