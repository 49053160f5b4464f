"""Plans leave autoprec: a deployed plan as a compressed-tensors HF checkpoint
(``checkpoint``), and a training plan as Transformer Engine and torchao spell it
(``recipes``).

Nothing here is imported by ``import autoprec``; compressed-tensors and transformers are
imported where used (``pip install 'autoprec[export]'``).
"""

from __future__ import annotations

from autoprec.export.checkpoint import (
    CheckpointReport,
    ExportRefused,
    check_exportable,
    save_pretrained,
)
from autoprec.export.load import islands_of, keep_islands

__all__ = ["CheckpointReport", "ExportRefused", "check_exportable", "islands_of",
           "keep_islands", "save_pretrained"]
