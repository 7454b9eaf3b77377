"""kiln-hf: the HuggingFace bridge: checkpoints in and out (``from_pretrained``), safetensors, RoPE,
tokenizers and data (text, instruction and chat records, chat templates), and training runs
(``kiln train``, ``kiln data``, ``kiln demo``)."""

from importlib.metadata import version

from kiln.hf._chat import BUILTIN_TEMPLATES, ChatTemplate
from kiln.hf._data import IGNORE_INDEX, PackedDataset
from kiln.hf._errors import CheckpointError, DataError, HFConfigError
from kiln.hf._pretrained import PretrainedModel, config_bundle, from_pretrained, shift_labels
from kiln.hf._rope import ROPE_TYPES, rope_inv_freq, rope_parameters, rope_table
from kiln.hf._safetensors import Checkpoint, TensorInfo, open_checkpoint, parse_size, save_checkpoint
from kiln.hf._samples import RecordError, SampleDataset, read_records
from kiln.hf._tokenizer import EOS_TOKEN, load_tokenizer, save_tokenizer, train_bpe_tokenizer
from kiln.hf._train import (
    TrainConfig,
    TrainConfigError,
    TrainingError,
    load_train_config,
    save_pretrained,
    train,
)

__version__ = version("kiln-hf")

__all__ = [
    "BUILTIN_TEMPLATES",
    "EOS_TOKEN",
    "IGNORE_INDEX",
    "ROPE_TYPES",
    "ChatTemplate",
    "Checkpoint",
    "CheckpointError",
    "DataError",
    "HFConfigError",
    "PackedDataset",
    "PretrainedModel",
    "RecordError",
    "SampleDataset",
    "TensorInfo",
    "TrainConfig",
    "TrainConfigError",
    "TrainingError",
    "__version__",
    "config_bundle",
    "from_pretrained",
    "load_tokenizer",
    "load_train_config",
    "open_checkpoint",
    "parse_size",
    "read_records",
    "rope_inv_freq",
    "rope_parameters",
    "rope_table",
    "save_checkpoint",
    "save_pretrained",
    "save_tokenizer",
    "shift_labels",
    "train",
    "train_bpe_tokenizer",
]
