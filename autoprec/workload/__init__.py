"""The model and data a command works on, and their error against the fp32 reference.

- ``loading``: a user's model.py loaded into a ``ModelSpec`` (the contract in docs/overview.md).
- ``inputs``: the same ``ModelSpec`` from a model in hand and iterables of batches.
- ``reference``: the model as given is the reference: its own dtypes, per module.
- ``metrics``: the error of a model's outputs against the fp32 reference.
- ``scoring``: a model (with or without a policy applied) scored against that reference.
- ``hashing``: content hashes of data, weights and code (probe cache, study provenance).

Below every stage: the tracer, the probes and every later stage read it. Import the
modules themselves (``autoprec.workload.loading``); this package re-exports nothing.
"""
