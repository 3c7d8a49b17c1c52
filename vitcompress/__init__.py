"""vitcompress: compress any Vision Transformer by joint Token Pruning & Squeezing (TPS)."""

from vitcompress import zoo  # noqa: F401 - registers pvt_*, cvt_* and segmenter_* into timm
from vitcompress.api import compress, load, map_model, save
from vitcompress.version import __version__

__all__ = ["__version__", "compress", "load", "map_model", "save"]
