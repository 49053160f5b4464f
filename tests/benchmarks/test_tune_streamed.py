"""benchmarks/tune_streamed.py at toy size: a tiny checkpoint tuned streamed in a child
process, its row printed and appended to the file asked for; a run stopped at its timeout
is recorded as stopped; the per-block rates are read from the progress bars."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import make_llama_checkpoint as mk
from benchmarks.tune_streamed import bar_rates
from tests.helpers import ROOT, cli_env

#: what tqdm writes for ``autoprec.stream.progress.block_progress`` (carriage returns)
BARS = ("\rreference: blocks:   0%|          | 0/3 [00:00<?, ?block/s]"
        "\rreference: blocks:  67%|######    | 2/3 [00:05<00:02,  2.50s/block, forward 1]"
        "\rreference: blocks: 100%|##########| 3/3 [00:09<00:00,  2.31s/block, forward 1]"
        "\n\rprobe: blocks: 100%|##########| 3/3 [1:00:01<00:00, 1.01s/block, forward 3]"
        "\rprobe: blocks:  33%|###       | 1/3 [00:00<?, ?block/s, forward 4]")


def test_bar_rates_reads_seconds_per_block() -> None:
    stage, rates = bar_rates(BARS)
    assert stage == "probe"
    assert rates == {"reference": 4.5, "probe": 1800.5}


def _run(args: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "benchmarks.tune_streamed", *args], cwd=ROOT,
                          env=cli_env(), capture_output=True, text=True, timeout=900)


def test_a_folder_that_is_not_a_checkpoint_is_refused(tmp_path: Path) -> None:
    run = _run([str(tmp_path)])
    assert run.returncode == 2
    assert run.stderr.strip().splitlines()[-1] == (f"tune_streamed: {tmp_path}: not a "
                                                   "checkpoint folder (no config.json)")


@pytest.mark.slow
def test_tiny_checkpoint_end_to_end(tmp_path: Path) -> None:
    folder = mk.write("tiny", tmp_path / "tiny-llama")
    out = tmp_path / "tune_streamed.md"
    run = _run([str(folder), "--out", str(out), "--max-error", "0.05", "--batch-size", "8"])
    assert run.returncode == 0, run.stderr[-3000:]
    row = next(ln for ln in run.stdout.splitlines() if ln.startswith("| tiny-llama |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[1:4] == ["0.1 M", "2", "h100"]
    assert 0.1 < float(cells[4]) < 4  # peak RSS GB: torch and transformers, not 0
    assert "(0.05)" in cells[8] and "reference" in cells[10] and "probe" in cells[11]
    text = out.read_text()
    assert text.startswith("# tune_streamed") and row in text and "load average" in text
    stopped = _run([str(folder), "--out", str(out), "--timeout", "1"])
    assert stopped.returncode == 0, stopped.stderr[-3000:]
    assert "(stopped)" in stopped.stdout and "stopped in stage" in stopped.stdout
    assert out.read_text().startswith(text)  # appended, the first run's row kept
