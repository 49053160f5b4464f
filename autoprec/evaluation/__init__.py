"""How a policy is judged on a target: what ``tune``, ``check`` and ``eval`` share.

One ``Target`` (``autoprec.pricing.target``: name, mode, form, fp8 backend, batch size,
speed source, capability) is resolved once and handed to every step. A policy is scored, audited and
priced on it (``assess``), shown beside what a user writes instead (``baselines``, the
``rows`` of the table), timed where the target is this machine (``timing``, with the
profile from ``speed_source``), and the plan to write is chosen by one function
(``decision.decide``: a ``Decision`` with structured reasons). ``check`` (the gate) and
``eval_report`` (the report) conclude from the same steps; ``json_fields`` is the one
meaning of their JSON fields. ``scoring_context.ScoringContext`` is what tune's search
scores and audits a policy on (the model, its data and references, the targets): tune's
last step scores its rows through the same one. Nothing here imports the search: ``check``
and ``eval`` run without it.
"""
