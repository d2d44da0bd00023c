"""Reading HF checkpoints: the safetensors files (:mod:`.files`), the quantized weight formats (:mod:`.formats`,
:mod:`.msmodelslim`, :mod:`.mxfp4`; :mod:`.detect` picks one) and the read plan of a model (:mod:`.reads`)."""

from .detect import detect_format
from .files import CheckpointError, CheckpointFiles
from .formats import WeightFormat

__all__ = ["CheckpointError", "CheckpointFiles", "WeightFormat", "detect_format"]
