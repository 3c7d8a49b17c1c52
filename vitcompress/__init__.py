"""vitcompress: compress any Vision Transformer by joint Token Pruning & Squeezing (TPS)."""

__version__ = "0.1.0"

from vitcompress import zoo  # noqa: E402,F401 - registers pvt_* and cvt_* into timm
from vitcompress.api import compress, load, map_model, save  # noqa: E402

__all__ = ["__version__", "compress", "load", "map_model", "save"]
