"""The embedded demo model pair: a small Llama-architecture target and its draft, trained by the
project on offline open-licence text (see docs/demo-model.md). Both live as Hugging Face model
directories inside the package, so the server runs without downloading anything."""

from __future__ import annotations

from pathlib import Path

_MODELS_DIR = Path(__file__).resolve().parent / "models"


def demo_model_dir() -> Path:
    """The demo target model directory (config.json, model.safetensors, tokenizer files)."""
    return _MODELS_DIR / "target"


def demo_draft_dir() -> Path:
    """The demo draft model directory: same tokenizer as the target, about a fifth of its size."""
    return _MODELS_DIR / "draft"
