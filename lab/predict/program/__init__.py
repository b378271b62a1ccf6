"""The estimate of a Plan's program as named ops, for the audit and the ledger.

``estimate`` prices whatever a Plan runs (and derives the training and inference configs from a Plan: the one
place they are made from it); ``ops`` is what an estimate is made of (named ops, expected collectives);
``axis_programs`` the kernels over named mesh axes; ``sharded_matmul`` the scaling book's four cases for one matmul.
"""
