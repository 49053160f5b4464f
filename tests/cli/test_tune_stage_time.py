"""tune's `time per stage` line: wall and CPU seconds of each stage, the short runs'."""

from __future__ import annotations

from types import SimpleNamespace

from autoprec.cli.tune_cmd import stage_time_line


def test_the_line_gives_wall_and_cpu_seconds_per_stage_and_the_short_runs():
    res = SimpleNamespace(stage_seconds={"probe": 40.0, "confirm": 12.5},
                          stage_cpu_seconds={"probe": 70.2, "confirm": 11.0},
                          train_seconds=9.0, train_cpu_seconds=8.5, train_checks=[{}])
    assert stage_time_line(res) == ("time per stage (wall / CPU): probe 40.0 / 70.2 s, "
                                    "confirm 12.5 / 11.0 s (of which short training runs "
                                    "9.0 / 8.5 s)")
    res.stage_cpu_seconds, res.train_checks = {}, []  # a result without CPU figures
    assert stage_time_line(res) == "time per stage: probe 40.0 s, confirm 12.5 s"
