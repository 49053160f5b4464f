"""``tune``'s orchestration: from a model to a written policy, in stages.

``config`` (``TuneConfig``: every option, checked once) -> ``prepare`` (the model, data,
references, trace, probes, the cost model, the space) -> ``run`` (the study, tracked) ->
``write`` (the chosen plan confirmed beside its baselines by ``confirm`` and the one
decision, ``evaluation.decision.decide``, then written with its front and artifacts) ->
``report`` (tune --report's tables and plots). ``tune.tune`` calls them in order.
"""
