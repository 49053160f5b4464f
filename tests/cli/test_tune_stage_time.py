"""tune's `time per stage` line: wall and CPU seconds of each stage, the short runs'."""

from __future__ import annotations

from autoprec.cli.tune_cmd import stage_time_line
from autoprec.tuning.result import RunCosts, TrainCheckRuns


def test_the_line_gives_wall_and_cpu_seconds_per_stage_and_the_short_runs():
    costs = RunCosts(stage_seconds={"probe": 40.0, "confirm": 12.5},
                     stage_cpu_seconds={"probe": 70.2, "confirm": 11.0})
    runs = TrainCheckRuns(verdicts=[{}], seconds=9.0, cpu_seconds=8.5)
    assert stage_time_line(costs, runs) == (
        "time per stage (wall / CPU): probe 40.0 / 70.2 s, confirm 12.5 / 11.0 s (of which "
        "short training runs 9.0 / 8.5 s)")
    # a result without CPU figures, and no short runs
    costs = RunCosts(stage_seconds={"probe": 40.0, "confirm": 12.5})
    assert stage_time_line(costs, TrainCheckRuns()) == (
        "time per stage: probe 40.0 s, confirm 12.5 s")
