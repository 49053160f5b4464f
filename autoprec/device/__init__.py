"""The device facts below every stage: what a target or device name means (``targets``: the
one place names are parsed) and what this machine runs (``capability``: one ``(ok, reason)``
answer per precision and fp8 backend, also the skip reason of GPU tests).

Facts, not decisions: ``autoprec.pricing.target.resolve_target`` decides, once, what a
run is for. Import the modules themselves (``autoprec.device.capability``); this package
re-exports nothing, so importing one stays cheap.
"""
