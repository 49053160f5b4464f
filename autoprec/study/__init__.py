"""The Optuna adapter: the search run as a study in shared storage.

``sampler`` (the planner as an Optuna sampler; it ends the study when the search is over),
``objective`` (``PlanScorer``: the model run with a trial's plan applied, its error and
estimated time), ``driver`` (``study.optimize``, claims, the completed trials), ``storage``
(SQLite, PostgreSQL, journal files: opened, described, checked), ``workers`` (N processes
on one study) and ``export`` (the study's metadata, a policy from a finished study).
"""
