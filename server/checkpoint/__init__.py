"""Reading HF checkpoints: the safetensors files (:mod:`.files`) and the quantized weight formats (:mod:`.formats`)."""

from .files import CheckpointError, CheckpointFiles
from .formats import WeightFormat, detect_format

__all__ = ["CheckpointError", "CheckpointFiles", "WeightFormat", "detect_format"]
