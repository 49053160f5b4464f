"""The search algorithm alone: which plan is the fastest within an error budget.

``space`` (the default region and one precision per GEMM layer, and why not the others) ->
``planner`` (every plan's time from the cost model, its error predicted by the probes:
enumeration or a Lagrangian descent with block moves, then a walk fastest-first) ->
``select`` (the fastest candidate within budget, or the closest) -> ``compaction`` (the
same plan with the fewest rules). ``decode`` is the one way between a trial's params, its
plan key and its rules; ``plan_score`` the record of one scored plan. No Optuna and no
files here: the study (``autoprec.study``) runs the planner as an Optuna sampler and
``autoprec.tuning`` wires the stages into ``tune``.
"""
