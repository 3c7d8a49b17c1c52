"""Data for evaluation and fine-tuning: ImageNet-layout folders, Fashion-MNIST, and a
segmentation set generated from Fashion-MNIST (``fashion-mnist-seg``)."""

from vitcompress.data.config import DataConfig, resolve_data_config
from vitcompress.data.datasets import build_dataset, class_names, model_dataset, num_classes
from vitcompress.data.segmentation import TASKS, check_task, dataset_task
from vitcompress.data.transforms import AugmentConfig, DataError

__all__ = [
    "AugmentConfig",
    "DataConfig",
    "DataError",
    "TASKS",
    "build_dataset",
    "check_task",
    "dataset_task",
    "model_dataset",
    "class_names",
    "num_classes",
    "resolve_data_config",
]
