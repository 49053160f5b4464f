"""Tracking of tuning runs (MLflow), behind a small interface.

``make_tracker`` picks and checks the backend before any expensive work; ``tune`` then
drives the tracker (parent run, one child run per trial, artifacts) and
``log_tune_artifacts`` attaches the policy, tables and plots. MLflow itself is imported
only when a tracker is made with tracking enabled.
"""

from __future__ import annotations

from autoprec.track.base import FINISH_STATUSES, NullTracker, Tracker, TrackingWarning
from autoprec.track.mlflow_tracker import MlflowTracker, default_tracking_uri, make_tracker
from autoprec.track.report import PlotPlans, log_tune_artifacts, write_tune_report

__all__ = [
    "FINISH_STATUSES",
    "MlflowTracker",
    "NullTracker",
    "PlotPlans",
    "Tracker",
    "TrackingWarning",
    "default_tracking_uri",
    "log_tune_artifacts",
    "make_tracker",
    "write_tune_report",
]
