"""Training under a policy, beside ``apply`` (which it uses):

- ``train``: fp32 master weights, a GradScaler only when fp16 is present
  (``prepare_training``, ``train_step``) and the fidelity check of a policy.
- ``short_run``: the short-run training check (does a plan train like fp32?).
- ``loss_scaler``: a ``GradScaler`` that counts the optimizer steps it took and skipped.

Import the modules themselves (``autoprec.training.train``); this package re-exports nothing.
"""
