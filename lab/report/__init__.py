"""The join of the three truths: the ledger per op, and the reports and plots of a run."""
