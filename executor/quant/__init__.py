"""Quantized Hugging Face checkpoints: which `quantization_config` variants load (`scheme`), the
linear-layer weights that keep their packed form (`int4`, `fp8`) and how the loader takes them
from a state dict (`linear_loader`). docs/quantization.md lists what loads and what is refused."""
