"""Model configuration parsed from a Hugging Face `config.json` (transformers 4.x and 5.x forms)."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path

# architecture name -> (qkv bias by default, per-head q/k RMSNorm)
SUPPORTED_ARCHS: dict[str, tuple[bool, bool]] = {
    "LlamaForCausalLM": (False, False),
    "MistralForCausalLM": (False, False),
    "Qwen2ForCausalLM": (True, False),
    "Qwen3ForCausalLM": (False, True),
}

# Hybrid targets: Gated DeltaNet layers beside gated full attention (Qwen3.5 dense), text only.
HYBRID_ARCHS = ("Qwen3_5ForCausalLM", "Qwen3_5ForConditionalGeneration")
MOE_HYBRID_ARCHS = ("Qwen3_5MoeForCausalLM", "Qwen3_5MoeForConditionalGeneration")
LAYER_KINDS = ("full_attention", "linear_attention")

ROPE_TYPES = ("default", "linear", "llama3", "yarn")


class ModelLoadError(ValueError):
    """A model directory that cannot be served; the message is one line naming what is wrong."""


@dataclass(frozen=True)
class RopeConfig:
    theta: float = 10000.0
    rope_type: str = "default"
    factor: float = 1.0
    # llama3
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192
    # yarn
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 0.0
    attention_factor: float | None = None
    rotary_dim: int = 0  # 0: the whole head_dim


@dataclass(frozen=True)
class LinearAttnConfig:
    """The Gated DeltaNet layers' shape (HF `linear_*` fields)."""

    num_key_heads: int
    num_value_heads: int  # a multiple of num_key_heads: each k head serves consecutive v heads
    key_head_dim: int
    value_head_dim: int
    conv_kernel: int

    @property
    def key_dim(self) -> int:
        return self.num_key_heads * self.key_head_dim

    @property
    def value_dim(self) -> int:
        return self.num_value_heads * self.value_head_dim

    @property
    def conv_dim(self) -> int:
        """Channels of the short convolution: q, k and v side by side."""
        return 2 * self.key_dim + self.value_dim


@dataclass(frozen=True)
class ModelConfig:
    arch: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position: int
    tie_word_embeddings: bool
    qkv_bias: bool
    qk_norm: bool
    rope: RopeConfig = field(default_factory=RopeConfig)
    torch_dtype: str = "float32"
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    # Hybrid targets: each layer's kind (LAYER_KINDS; empty: every layer is full attention),
    # the linear layers' shape, and a sigmoid gate on the full layers' attention output.
    layer_types: tuple[str, ...] = ()
    linear_attn: LinearAttnConfig | None = None
    attn_output_gate: bool = False

    @property
    def is_hybrid(self) -> bool:
        return self.linear_attn is not None

    @property
    def linear_layer_ids(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == "linear_attention")

    @property
    def kv_layer_ids(self) -> tuple[int, ...]:
        """The layers that keep paged KV: the full-attention ones (every layer when not hybrid).
        The KV cache holds one tensor pair per entry, in this order."""
        if not self.layer_types:
            return tuple(range(self.num_layers))
        return tuple(i for i, t in enumerate(self.layer_types) if t == "full_attention")

    @property
    def q_size(self) -> int:
        return self.num_q_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        return 2 * len(self.kv_layer_ids) * self.kv_size * dtype_bytes


def _ids(value) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


def rope_config(raw: dict, max_position: int, head_dim: int) -> RopeConfig:
    # transformers 5 keeps theta and scaling in `rope_parameters`; 4.x has `rope_theta` plus an
    # optional `rope_scaling` dict (its type under "rope_type" or the older "type").
    params = dict(raw.get("rope_parameters") or {})
    scaling = dict(raw.get("rope_scaling") or {})
    merged = {**scaling, **params}
    theta = float(merged.get("rope_theta", raw.get("rope_theta", 10000.0)))
    rope_type = merged.get("rope_type", merged.get("type", "default")) or "default"
    if rope_type not in ROPE_TYPES:
        raise ModelLoadError(
            f"unsupported rope scaling type {rope_type!r} (supported: {', '.join(ROPE_TYPES)})"
        )
    partial = float(raw.get("partial_rotary_factor", merged.get("partial_rotary_factor", 1.0)))
    rotary_dim = int(head_dim * partial) if partial < 1.0 else 0
    original = int(merged.get("original_max_position_embeddings", max_position))
    return RopeConfig(
        theta=theta,
        rope_type=rope_type,
        factor=float(merged.get("factor", 1.0)),
        low_freq_factor=float(merged.get("low_freq_factor", 1.0)),
        high_freq_factor=float(merged.get("high_freq_factor", 4.0)),
        original_max_position=original,
        beta_fast=float(merged.get("beta_fast", 32.0)),
        beta_slow=float(merged.get("beta_slow", 1.0)),
        mscale=float(merged.get("mscale", 1.0)),
        mscale_all_dim=float(merged.get("mscale_all_dim", 0.0)),
        attention_factor=(
            float(merged["attention_factor"]) if merged.get("attention_factor") else None
        ),
        rotary_dim=rotary_dim,
    )


def load_model_config(model_dir: Path | str) -> ModelConfig:
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise ModelLoadError(f"model directory not found: {model_dir}")
    path = model_dir / "config.json"
    if not path.is_file():
        raise ModelLoadError(f"missing config.json in {model_dir}")
    raw = json.loads(path.read_text())
    archs = raw.get("architectures") or []
    gen_path = model_dir / "generation_config.json"
    gen = json.loads(gen_path.read_text()) if gen_path.is_file() else {}
    hybrid = next((a for a in archs if a in HYBRID_ARCHS + MOE_HYBRID_ARCHS), None)
    if hybrid is not None:
        return hybrid_config(raw, model_dir, hybrid, _ids(gen.get("eos_token_id")))
    arch = next((a for a in archs if a in SUPPORTED_ARCHS), None)
    if arch is None:
        raise ModelLoadError(
            f"unsupported architecture {archs or raw.get('model_type')!r} in {path.name} "
            f"(supported: {', '.join((*SUPPORTED_ARCHS, *HYBRID_ARCHS))})"
        )
    if raw.get("use_sliding_window") or (
        arch == "MistralForCausalLM" and raw.get("sliding_window")
    ):
        raise ModelLoadError("sliding-window attention is not supported; set sliding_window null")
    default_bias, qk_norm = SUPPORTED_ARCHS[arch]
    return decoder_config(
        raw,
        model_dir,
        arch=arch,
        default_bias=default_bias,
        qk_norm=qk_norm,
        eos_token_ids=_ids(gen.get("eos_token_id")) or _ids(raw.get("eos_token_id")),
    )


def decoder_config(
    raw: dict,
    model_dir: Path,
    *,
    arch: str,
    default_bias: bool,
    qk_norm: bool,
    eos_token_ids: tuple[int, ...] = (),
) -> ModelConfig:
    """The decoder's shape from an HF config.json's fields (a target's, or a drafter's own
    layers); a missing field raises a one-line ModelLoadError naming it."""
    try:
        hidden = int(raw["hidden_size"])
        num_q_heads = int(raw["num_attention_heads"])
        head_dim = int(raw.get("head_dim") or hidden // num_q_heads)
        max_position = int(raw.get("max_position_embeddings", 4096))
        return ModelConfig(
            arch=arch,
            vocab_size=int(raw["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(raw["intermediate_size"]),
            num_layers=int(raw["num_hidden_layers"]),
            num_q_heads=num_q_heads,
            num_kv_heads=int(raw.get("num_key_value_heads") or num_q_heads),
            head_dim=head_dim,
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            max_position=max_position,
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            qkv_bias=bool(raw.get("attention_bias", default_bias)) or default_bias,
            qk_norm=qk_norm,
            rope=rope_config(raw, max_position, head_dim),
            torch_dtype=str(raw.get("torch_dtype") or raw.get("dtype") or "float32"),
            eos_token_ids=eos_token_ids,
            bos_token_id=raw.get("bos_token_id"),
        )
    except KeyError as e:
        raise ModelLoadError(
            f"config.json in {model_dir} lacks required field {e.args[0]!r}"
        ) from e


def hybrid_config(
    raw: dict, model_dir: Path, arch: str, eos_token_ids: tuple[int, ...] = ()
) -> ModelConfig:
    """A Qwen3.5 dense config (`Qwen3_5ForCausalLM`, or the released
    `Qwen3_5ForConditionalGeneration` layout with its fields under `text_config`: only the text
    model is served, the vision tower is ignored). Missing `linear_*` fields, `head_dim` and
    `partial_rotary_factor` take transformers' defaults; `layer_types` comes from
    `full_attention_interval` (every 4th layer full) when absent. The multimodal RoPE sections
    are ignored: text positions are equal on all three axes, which makes it plain RoPE."""
    text = dict(raw.get("text_config") or raw)
    if arch in MOE_HYBRID_ARCHS or "num_experts" in text:
        raise ModelLoadError(
            f"{arch}: mixture-of-experts targets are not supported "
            f"(num_experts={text.get('num_experts')}); serve a dense qwen3_5 model"
        )
    for name, wanted in (("attn_output_gate", True), ("attention_bias", False)):
        if bool(text.get(name, wanted)) != wanted:
            raise ModelLoadError(f"{arch}: {name}={text[name]} is not supported (only {wanted})")
    if text.get("hidden_act", "silu") != "silu":
        raise ModelLoadError(f"{arch}: hidden_act={text['hidden_act']!r} (only 'silu')")
    params = dict(text.get("rope_parameters") or {})
    if "partial_rotary_factor" not in params and "partial_rotary_factor" not in text:
        text["partial_rotary_factor"] = 0.25
    text.setdefault("head_dim", 256)
    if "tie_word_embeddings" in raw:  # the outer config's, in the multimodal layout
        text["tie_word_embeddings"] = raw["tie_word_embeddings"]
    cfg = decoder_config(
        text,
        model_dir,
        arch=arch,
        default_bias=False,
        qk_norm=True,
        eos_token_ids=eos_token_ids or _ids(text.get("eos_token_id") or raw.get("eos_token_id")),
    )
    interval = int(text.get("full_attention_interval", 4))
    layer_types = tuple(
        text.get("layer_types")
        or (
            "linear_attention" if (i + 1) % interval else "full_attention"
            for i in range(cfg.num_layers)
        )
    )
    bad = next((t for t in layer_types if t not in LAYER_KINDS), None)
    if len(layer_types) != cfg.num_layers or bad is not None:
        raise ModelLoadError(
            f"{arch}: layer_types must name {cfg.num_layers} layers, each one of "
            f"{', '.join(LAYER_KINDS)} (got {len(layer_types)}, {bad!r})"
        )
    linear = LinearAttnConfig(
        num_key_heads=int(text.get("linear_num_key_heads", 16)),
        num_value_heads=int(text.get("linear_num_value_heads", 32)),
        key_head_dim=int(text.get("linear_key_head_dim", 128)),
        value_head_dim=int(text.get("linear_value_head_dim", 128)),
        conv_kernel=int(text.get("linear_conv_kernel_dim", 4)),
    )
    if linear.num_value_heads % linear.num_key_heads or linear.conv_kernel < 2:
        raise ModelLoadError(
            f"{arch}: linear_num_value_heads={linear.num_value_heads} must be a multiple of "
            f"linear_num_key_heads={linear.num_key_heads}, linear_conv_kernel_dim >= 2"
        )
    return dataclasses.replace(
        cfg, layer_types=layer_types, linear_attn=linear, attn_output_gate=True
    )
