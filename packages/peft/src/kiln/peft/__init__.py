"""kiln-peft: LoRA as a graph pass, HF PEFT's API and adapter files, merge.

``get_peft_model(model, LoraConfig(...))`` adds LoRA adapters to a kiln Model's projections (named as
in HF: ``q_proj`` ... ``down_proj``, or ``"all-linear"``) by rewriting its IR with the ``lora`` graph
pass; ``PeftModel.from_pretrained`` / ``save_pretrained`` read and write PEFT's adapter folders.
"""

from importlib.metadata import version

from kiln.peft._annotations import annotated_ia3_config, annotated_lora_config
from kiln.peft._config import LoraConfig
from kiln.peft._errors import AdapterError
from kiln.peft._ia3 import IA3Config, ia3
from kiln.peft._lora import lora
from kiln.peft._model import PeftModel, get_peft_model

__version__ = version("kiln-peft")

__all__ = [
    "AdapterError",
    "IA3Config",
    "LoraConfig",
    "PeftModel",
    "__version__",
    "annotated_ia3_config",
    "annotated_lora_config",
    "get_peft_model",
    "ia3",
    "lora",
]
