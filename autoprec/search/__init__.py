"""The search stage: the fastest plan within an error budget, with Optuna as its engine.

space (the default region and one precision per GEMM layer, and why not the others) ->
planner (every plan's time from the cost model, its error predicted by the probes:
enumeration or a Lagrangian descent with block moves, then a walk fastest-first) ->
sampler (the planner as an Optuna sampler reading the study's storage; it ends the study
when the search is over) -> plan_scorer (the model run with the plan applied) -> driver
(``study.optimize``) -> select -> compact (the same plan with the fewest rules) -> a
Policy. ``decode`` is the one way between a trial, its plan key and its rules; ``config``
the one ``TuneConfig`` from the CLI to the writer. ``tune`` wires the stages together.
"""
