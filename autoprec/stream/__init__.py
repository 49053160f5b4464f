"""Models larger than memory, streamed block by block from a safetensors checkpoint.

``checkpoint``: the folder opened lazily (meta skeleton, one module's weights at a time);
``streamed``: the model whose blocks load as they run, plain or under a plan;
``data``: real text for a checkpoint's calibration (docstrings, tokenised). The workload
(``workload.checkpoint_spec``) makes a folder a ``ModelSpec``: what ``autoprec tune DIR``
loads.
"""

from autoprec.stream.checkpoint import Checkpoint, is_checkpoint_dir
from autoprec.stream.streamed import StreamedModel, find_blocks, open_streamed, stream_of

__all__ = ["Checkpoint", "StreamedModel", "find_blocks", "is_checkpoint_dir", "open_streamed",
           "stream_of"]
