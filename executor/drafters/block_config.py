"""Configuration of a block drafter checkpoint (DFlash layout) and its checks against the target.

A block drafter's config.json is a Qwen3-style decoder config (hidden_size, num_hidden_layers,
heads, head_dim, intermediate_size, rms_norm_eps, rope fields, vocab_size) whose architecture is
`DFlashDraftModel`, plus the drafting fields `target_layer_ids` (0-based target layers whose
outputs feed the drafter: HF `hidden_states[i + 1]`, per z-lab/dflash and SGLang's
`dflash_utils`), `block_size` (tokens per drafted block, the first being the last verified token)
and `mask_token_id` (the token that fills the B-1 positions to draft). These three are read from
the `dflash_config` sub-dict first and from the top level otherwise, as z-lab/dflash's
`dflash/model.py` reads them; `num_target_layers`, where present, names the target depth the
drafter was trained for. The DFlash2 variant (`DFlash2DraftModel`: dynamic convolutions and a
candidate selector, z-lab/dflash's test fixtures) and sliding-window drafters are refused.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from executor.model_config import ModelConfig, ModelLoadError, decoder_config

BLOCK_DRAFTER_ARCHS = ("DFlashDraftModel",)
UNSUPPORTED_BLOCK_ARCHS = ("DFlash2DraftModel",)
DRAFTING_FIELDS = ("target_layer_ids", "block_size", "mask_token_id")
# DFlash2's embedding and logit transforms; a checkpoint that sets them otherwise drafts from
# different logits than this forward computes.
NEUTRAL_OUTPUT_FIELDS = {
    "input_embedding_scale": 1.0,
    "output_multiplier": 1.0,
    "final_logit_softcapping": 0.0,
}


@dataclass(frozen=True)
class BlockDrafterConfig:
    decoder: ModelConfig  # the drafter's own layers (Qwen3 decoder layers: q/k head norms)
    target_layer_ids: tuple[int, ...]  # target layer i = the output of the target's decoder layer i
    block_size: int  # rows of one drafted block: the last verified token + block_size - 1 masks
    mask_token_id: int
    num_target_layers: int | None = None  # the target depth it was trained for, where recorded

    @property
    def num_drafts(self) -> int:
        return self.block_size - 1


def _read_config(model_dir: Path) -> dict:
    path = model_dir / "config.json"
    if not path.is_file():
        raise ModelLoadError(f"missing config.json in {model_dir}")
    return json.loads(path.read_text())


def _drafting_value(raw: dict, name: str):
    nested = raw.get("dflash_config") or {}
    return nested[name] if name in nested else raw.get(name)


def is_block_drafter_dir(path: Path | str) -> bool:
    """Whether `path` holds a block drafter checkpoint (by architecture or drafting fields)."""
    config_path = Path(path) / "config.json"
    if not config_path.is_file():
        return False
    try:
        raw = json.loads(config_path.read_text())
    except (OSError, ValueError):
        return False
    archs = raw.get("architectures") or []
    if any(a in BLOCK_DRAFTER_ARCHS + UNSUPPORTED_BLOCK_ARCHS for a in archs):
        return True
    return "dflash_config" in raw or _drafting_value(raw, "target_layer_ids") is not None


def _require(raw: dict, name: str, model_dir: Path):
    value = _drafting_value(raw, name) if name in DRAFTING_FIELDS else raw.get(name)
    if value is None:
        raise ModelLoadError(f"block drafter config.json in {model_dir} lacks field {name!r}")
    return value


def load_block_drafter_config(model_dir: Path | str) -> BlockDrafterConfig:
    model_dir = Path(model_dir)
    raw = _read_config(model_dir)
    archs = raw.get("architectures") or []
    if any(a in UNSUPPORTED_BLOCK_ARCHS for a in archs):
        raise ModelLoadError(
            f"block drafter architecture {archs!r} is not supported "
            f"(supported: {', '.join(BLOCK_DRAFTER_ARCHS)})"
        )
    if raw.get("use_sliding_window") or "sliding_attention" in (raw.get("layer_types") or ()):
        raise ModelLoadError(
            "block drafter field use_sliding_window: sliding-window layers are not supported"
        )
    if raw.get("is_causal"):
        raise ModelLoadError(
            "block drafter field is_causal=true: only non-causal blocks are supported"
        )
    for name, neutral in NEUTRAL_OUTPUT_FIELDS.items():
        value = _drafting_value(raw, name)
        if value is not None and float(value) != neutral:
            raise ModelLoadError(
                f"block drafter field {name}={value} is not supported (only {neutral})"
            )
    block_size = int(_require(raw, "block_size", model_dir))
    if block_size < 2:
        raise ModelLoadError(f"block drafter field block_size={block_size} must be at least 2")
    num_target_layers = raw.get("num_target_layers")
    return BlockDrafterConfig(
        decoder=decoder_config(
            raw,
            model_dir,
            arch=archs[0] if archs else BLOCK_DRAFTER_ARCHS[0],
            default_bias=False,
            qk_norm=True,
        ),
        target_layer_ids=tuple(int(i) for i in _require(raw, "target_layer_ids", model_dir)),
        block_size=block_size,
        mask_token_id=int(_require(raw, "mask_token_id", model_dir)),
        num_target_layers=None if num_target_layers is None else int(num_target_layers),
    )


def check_against_target(config: BlockDrafterConfig, target: ModelConfig) -> None:
    """Raises ModelLoadError (one line, the field and both values) where the drafter cannot
    serve `target`: it reads the target's hidden states and shares its embedding and lm_head."""

    def mismatch(name: str, drafter_value, target_value) -> ModelLoadError:
        return ModelLoadError(
            f"block drafter field {name}={drafter_value} does not match the target's "
            f"{name}={target_value}"
        )

    decoder = config.decoder
    if decoder.hidden_size != target.hidden_size:
        raise mismatch("hidden_size", decoder.hidden_size, target.hidden_size)
    if decoder.vocab_size != target.vocab_size:
        raise mismatch("vocab_size", decoder.vocab_size, target.vocab_size)
    if config.num_target_layers is not None and config.num_target_layers != target.num_layers:
        raise mismatch("num_target_layers", config.num_target_layers, target.num_layers)
    if not config.target_layer_ids:
        raise ModelLoadError("block drafter field target_layer_ids is empty")
    outside = [i for i in config.target_layer_ids if not 0 <= i < target.num_layers]
    if outside:
        raise ModelLoadError(
            f"block drafter field target_layer_ids={list(config.target_layer_ids)} holds "
            f"{outside[0]}, outside the target's num_hidden_layers={target.num_layers}"
        )
    if not 0 <= config.mask_token_id < target.vocab_size:
        raise ModelLoadError(
            f"block drafter field mask_token_id={config.mask_token_id} is outside the target's "
            f"vocab_size={target.vocab_size}"
        )
