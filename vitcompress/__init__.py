"""vitcompress: compress any Vision Transformer by joint Token Pruning & Squeezing (TPS)."""

__version__ = "0.1.0"
