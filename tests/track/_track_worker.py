"""One tuning-like process for the parallel-tracking test (run as a script, not collected).

    python _track_worker.py URI EXPERIMENT LABEL N_TRIALS WORKDIR

Makes a tracker (URI "-" = the SQLite default in WORKDIR), starts a parent run, logs
N_TRIALS child runs from 3 threads (tag ``worker=LABEL``), finishes, and prints the
parent run id as the last line of stdout.
"""

from __future__ import annotations

import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from autoprec.track import make_tracker


def main(uri: str, experiment: str, label: str, n_trials: int, workdir: Path) -> None:
    tracker = make_tracker(None if uri == "-" else uri, experiment, workdir=workdir)
    run_id = tracker.start(f"tune-{label}", {"worker": label, "trials": n_trials}, {})

    def log(number: int) -> None:
        tracker.log_trial(
            number,
            {"fc1": "bf16", "fc2": "fp16" if number % 2 else "fp32"},
            {"error": 0.001 * (number + 1)},
            {"worker": label},
        )

    with ThreadPoolExecutor(3) as pool:
        list(pool.map(log, range(n_trials)))
    tracker.finish()
    if not tracker.enabled:
        raise SystemExit("tracker disabled itself")
    print(run_id)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), Path(sys.argv[5]))
