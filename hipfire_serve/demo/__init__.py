"""The embedded demo models: a small Llama-architecture target, a chain draft model and a block
drafter for it, trained by the project on offline open-licence text (see docs/demo-model.md).
All live as Hugging Face model directories inside the package, so the server runs without
downloading anything."""

from __future__ import annotations

from pathlib import Path

_MODELS_DIR = Path(__file__).resolve().parent / "models"


def demo_model_dir() -> Path:
    """The demo target model directory (config.json, model.safetensors, tokenizer files)."""
    return _MODELS_DIR / "target"


def demo_draft_dir() -> Path:
    """The demo draft model directory: same tokenizer as the target, about a fifth of its size."""
    return _MODELS_DIR / "draft"


def demo_block_drafter_dir() -> Path:
    """The demo block drafter (DFlash layout: it reads the target's hidden states and drafts a
    whole block in one forward); the demo target's default drafter."""
    return _MODELS_DIR / "block"
