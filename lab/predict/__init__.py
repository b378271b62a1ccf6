"""Predicted truth, JAX-free: what a program should cost, from the chip's datasheet and cited efficiencies.

One floor of shared cost pieces, and a sub-package for each question the lab answers:

=====================  ==========================================================================================
``roofline``           compute vs memory time of one op on one chip
``collectives``        an AllGather / ReduceScatter / AllReduce / AllToAll / permute over a torus or a switch
``placement``          which link a parallel group uses (the one rule every estimate below asks)
``efficiency``         the fraction of a datasheet peak each kind of op reaches (matmul, attention, HBM, links)
``constants``          every efficiency number with its grade, source and alternative
``intervals``          the 80% interval of an estimate, from the residuals of the development set
``axis_costs``         context-parallel rings and expert-parallel AllToAlls, shared by training and programs
``training/``          a training job: its config and checks, memory, collectives, step time, MFU, limits, remat
``inference/``         serving: prefill, decode, KV cache, the smallest topology, throughput, the named ops
``planner/``           the layout search: every parallel layout of a training job priced, the fastest that fit
``program/``           the estimate of a Plan's program as named ops, for the audit and the ledger
=====================  ==========================================================================================

A Plan (:mod:`lab.core.plan`) enters through ``program.estimate`` (``train_config``, ``infer_config``): the
estimators' configs are derived from it there, once. Nothing here imports JAX.
"""
