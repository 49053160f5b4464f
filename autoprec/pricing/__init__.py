"""The one price of a target, below evaluation, study and tuning: ``target`` decides once
what a run is for (``Target``: device, batch, compile, form) and prices a plan through
``Target.plan_cost``; ``speed_source`` says where the speed comes from (a datasheet
profile, or this machine calibrated and timed). Import the modules themselves.
"""
