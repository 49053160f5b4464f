"""autoprec: automatic per-layer precision tuning for PyTorch.

trace -> probe -> cost -> search (tune) -> policy / apply -> track.
"""

from __future__ import annotations

__version__ = "0.1.0"
