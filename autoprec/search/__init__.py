"""The search stage: Optuna over per-layer precision assignments.

space (which layer may take which precision, and why not) -> strategy (informed seeds and
a sensitivity-ordered bisection) -> objective (error on calibration data, time from the
cost model) -> select (confirm on eval data) -> a Policy.
"""
