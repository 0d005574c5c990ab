"""LoRA adapters served per request on a loaded base model (issue #38).

`files.read_adapter` reads mlx-lm and PEFT adapter directories; `bank.AdapterBank` holds
a model's adapters and applies each to its own rows of a forward, never merged into the
base weights.
"""

from compat_serve.adapters.bank import AdapterBank
from compat_serve.adapters.files import AdapterError, AdapterFiles, AdapterWeights, read_adapter

__all__ = ["AdapterBank", "AdapterError", "AdapterFiles", "AdapterWeights", "read_adapter"]
