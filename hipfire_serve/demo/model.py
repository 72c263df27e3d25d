"""A compact Llama-architecture decoder used to *train* the demo pair.

Parameter names match `transformers`' `LlamaForCausalLM` one for one, so the state dict is the
checkpoint (minus `lm_head.weight` when embeddings are tied); RoPE uses the same half-split
rotation. Serving never uses this module: the server loads the saved checkpoint through the
executor's loader. Training wants a plain full-sequence forward with flash attention, which is
all this is.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class DemoModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int = 64
    max_position_embeddings: int = 2048
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6

    def hf_config(self, eos_token_ids: list[int], pad_token_id: int) -> dict:
        """config.json of a tied-embedding LlamaForCausalLM in bf16 (4.x and 5.x keys)."""
        return {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "max_position_embeddings": self.max_position_embeddings,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_parameters": {"rope_type": "default", "rope_theta": self.rope_theta},
            "attention_bias": False,
            "attention_dropout": 0.0,
            "mlp_bias": False,
            "tie_word_embeddings": True,
            "initializer_range": 0.02,
            "use_cache": True,
            "bos_token_id": None,
            "eos_token_id": eos_token_ids,
            "pad_token_id": pad_token_id,
            "torch_dtype": "bfloat16",
            "dtype": "bfloat16",
        }

    @classmethod
    def from_hf_config(cls, raw: dict) -> DemoModelConfig:
        return cls(
            vocab_size=raw["vocab_size"],
            hidden_size=raw["hidden_size"],
            intermediate_size=raw["intermediate_size"],
            num_layers=raw["num_hidden_layers"],
            num_heads=raw["num_attention_heads"],
            num_kv_heads=raw["num_key_value_heads"],
            head_dim=raw["head_dim"],
            max_position_embeddings=raw["max_position_embeddings"],
            rope_theta=raw["rope_theta"],
            rms_norm_eps=raw["rms_norm_eps"],
        )

    def as_dict(self) -> dict:
        return asdict(self)


# The shipped pair, sized so both bf16 checkpoints plus tokenizer files stay under 30 MB:
# target ~11.7 M parameters, draft ~2.4 M (tied embeddings are 3.1 M and 1.6 M of those).
TARGET_SHAPE = dict(
    hidden_size=384, intermediate_size=896, num_layers=6, num_heads=6, num_kv_heads=2
)
DRAFT_SHAPE = dict(
    hidden_size=192, intermediate_size=512, num_layers=2, num_heads=3, num_kv_heads=1
)


def rope_cos_sin(
    seq_len: int, head_dim: int, theta: float, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=device).float() / head_dim))
    pos = torch.arange(seq_len, device=device).float()
    freqs = torch.outer(pos, inv_freq)  # [T, head_dim/2]
    emb = torch.cat((freqs, freqs), dim=-1)  # [T, head_dim]
    return emb.cos(), emb.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: [B, H, T, D]; HF Llama rotation: pairs (i, i + D/2).
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat((-x2, x1), dim=-1)
    return (x * cos + rotated * sin).to(x.dtype)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # fp32 statistics like HF Llama, then cast back before the weight.
        var = x.float().pow(2).mean(-1, keepdim=True)
        return self.weight * (x.float() * torch.rsqrt(var + self.eps)).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, cfg: DemoModelConfig):
        super().__init__()
        self.cfg = cfg
        q_size, kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden_size, q_size, bias=False)
        self.k_proj = nn.Linear(cfg.hidden_size, kv_size, bias=False)
        self.v_proj = nn.Linear(cfg.hidden_size, kv_size, bias=False)
        self.o_proj = nn.Linear(q_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        bsz, seq_len, _ = x.shape
        cfg = self.cfg
        q = self.q_proj(x).view(bsz, seq_len, cfg.num_heads, cfg.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(bsz, seq_len, cfg.num_kv_heads, cfg.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(bsz, seq_len, cfg.num_kv_heads, cfg.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)  # [B, H, T, D], [B, Hkv, T, D]
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.o_proj(out.transpose(1, 2).reshape(bsz, seq_len, -1))


class MLP(nn.Module):
    """SwiGLU, with Hugging Face's parameter names (the demo target's and its block drafter's)."""

    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: DemoModelConfig):
        super().__init__()
        self.self_attn = Attention(cfg)
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class Backbone(nn.Module):
    def __init__(self, cfg: DemoModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class DemoCausalLM(nn.Module):
    def __init__(self, cfg: DemoModelConfig):
        super().__init__()
        self.cfg = cfg
        self.model = Backbone(cfg)
        self._init_weights()

    def _init_weights(self) -> None:
        # GPT-2 style: N(0, 0.02), residual-output projections scaled down with depth so the
        # residual stream's variance does not grow with the number of layers.
        out_std = 0.02 / math.sqrt(2 * self.cfg.num_layers)
        for name, p in self.named_parameters():
            if p.dim() == 2:
                std = out_std if name.endswith(("o_proj.weight", "down_proj.weight")) else 0.02
                nn.init.normal_(p, mean=0.0, std=std)

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids [B, T] -> logits [B, T, V] (tied output embedding)."""
        seq_len = input_ids.shape[1]
        cos, sin = rope_cos_sin(
            seq_len, self.cfg.head_dim, self.cfg.rope_theta, input_ids.device
        )  # [T, D]
        x = self.model.embed_tokens(input_ids)  # [B, T, hidden]
        cos, sin = cos.to(x.dtype), sin.to(x.dtype)
        for layer in self.model.layers:
            x = layer(x, cos, sin)
        x = self.model.norm(x)
        return F.linear(x, self.model.embed_tokens.weight)  # [B, T, V]

    def hf_state_dict(self, dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
        """Checkpoint tensors under LlamaForCausalLM names (tied: no lm_head.weight)."""
        return {k: v.detach().to(dtype).contiguous().cpu() for k, v in self.state_dict().items()}
