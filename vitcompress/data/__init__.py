"""Data for evaluation and fine-tuning: ImageNet-layout folders and Fashion-MNIST."""

from vitcompress.data.config import DataConfig, resolve_data_config
from vitcompress.data.datasets import build_dataset, model_dataset, num_classes
from vitcompress.data.transforms import AugmentConfig, DataError

__all__ = [
    "AugmentConfig",
    "DataConfig",
    "DataError",
    "build_dataset",
    "model_dataset",
    "num_classes",
    "resolve_data_config",
]
