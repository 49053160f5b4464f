"""The search stage: Optuna over per-layer precision assignments.

space (which layer may take which precision, and why not) -> walk (best-first over
assignments, fastest first by the cost model, pruned by the probes; strategy: the
sensitivity ladder for Pareto fronts) -> objective (error on calibration data, time from
the cost model) -> driver (Optuna trials) -> select (confirm on eval data) -> a Policy.
"""
