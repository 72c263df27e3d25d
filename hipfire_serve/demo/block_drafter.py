"""A trainable block drafter (DFlash layout) for the demo target, and its checkpoint files.

The math is that of `executor.drafters.block_model.BlockDraftModel.draft_block`: context
features = hidden_norm(fc(the chosen target layers' outputs side by side)); a block [last
verified token, mask x (B-1)] is embedded with the target's embedding; in every layer the
block's queries attend, without a causal mask, to K/V projected from the context features (no
input norm) followed by the block's own K/V, with q/k head norms and neox RoPE at absolute
positions; the final norm goes through the target's lm_head. Training runs many blocks of one
sequence in one pass (`block_inputs`, `block_mask`): a block anchored at position a (row 0 is
the token at a) sees the context features of positions < a and its own rows, which is what one
block drafted alone after a verified context of a + 1 tokens sees. Parameter names are the
checkpoint's names; the embedding is the target's frozen tensor, held outside the state dict.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn

from hipfire_serve.demo.model import MLP, DemoCausalLM, RMSNorm, rope_cos_sin

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"


@dataclass(frozen=True)
class BlockDrafterShape:
    """Sizes and drafting fields of a block drafter for one target."""

    vocab_size: int
    hidden_size: int  # the target's: the drafter shares its embedding and lm_head
    num_target_layers: int
    target_layer_ids: tuple[int, ...]  # target layer i = the output of its decoder layer i
    block_size: int = 16  # rows of a block: the last verified token + block_size - 1 masks
    mask_token_id: int = 1
    intermediate_size: int = 896
    num_layers: int = 2
    num_heads: int = 6
    num_kv_heads: int = 2
    head_dim: int = 64
    max_position_embeddings: int = 2048 + 16  # the target's context plus one block
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6

    def hf_config(self) -> dict:
        """config.json in the DFlash layout (Qwen3-style decoder fields + drafting fields)."""
        return {
            "architectures": ["DFlashDraftModel"],
            "model_type": "qwen3",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "attention_bias": False,
            "max_position_embeddings": self.max_position_embeddings,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "num_target_layers": self.num_target_layers,
            "block_size": self.block_size,
            "dflash_config": {
                "mask_token_id": self.mask_token_id,
                "target_layer_ids": list(self.target_layer_ids),
            },
            "torch_dtype": "bfloat16",
        }

    @classmethod
    def from_hf_config(cls, raw: dict) -> BlockDrafterShape:
        dflash = raw["dflash_config"]
        return cls(
            vocab_size=raw["vocab_size"],
            hidden_size=raw["hidden_size"],
            num_target_layers=raw["num_target_layers"],
            target_layer_ids=tuple(dflash["target_layer_ids"]),
            block_size=raw["block_size"],
            mask_token_id=dflash["mask_token_id"],
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


def rope_tables(
    positions: torch.Tensor, head_dim: int, theta: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """positions [..] int64 -> cos, sin [.., head_dim / 2] float32 (frequencies in float64,
    as the executor's table builds them)."""
    inv_freq = 1.0 / theta ** (
        torch.arange(0, head_dim, 2, dtype=torch.float64, device=positions.device) / head_dim
    )
    angles = positions.double()[..., None] * inv_freq  # [.., D/2]
    return angles.cos().float(), angles.sin().float()


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Neox rotation: x [N, R, heads, D], cos/sin [N, R, D/2]; dims i and i + D/2 pair up."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half].float(), x[..., half:].float()
    cos, sin = cos[:, :, None, :], sin[:, :, None, :]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


class BlockAttention(nn.Module):
    def __init__(self, shape: BlockDrafterShape):
        super().__init__()
        self.shape = shape
        hidden, dim = shape.hidden_size, shape.head_dim
        self.q_proj = nn.Linear(hidden, shape.num_heads * dim, bias=False)
        self.k_proj = nn.Linear(hidden, shape.num_kv_heads * dim, bias=False)
        self.v_proj = nn.Linear(hidden, shape.num_kv_heads * dim, bias=False)
        self.o_proj = nn.Linear(shape.num_heads * dim, hidden, bias=False)
        self.q_norm = RMSNorm(dim, shape.rms_norm_eps)
        self.k_norm = RMSNorm(dim, shape.rms_norm_eps)

    def forward(
        self,
        x: torch.Tensor,  # [N, R, hidden] the blocks' normed rows
        features: torch.Tensor,  # [N, C, hidden] context features
        q_rope: tuple[torch.Tensor, torch.Tensor],  # [N, R, D/2] each
        kv_rope: tuple[torch.Tensor, torch.Tensor],  # [N, C + R, D/2] each
        mask: torch.Tensor,  # [N, R, C + R] bool, True: may attend
    ) -> torch.Tensor:
        s = self.shape
        num, rows, _ = x.shape
        both = torch.cat([features, x], dim=1)  # [N, C + R, hidden]: K/V sources
        q = self.q_proj(x).view(num, rows, s.num_heads, s.head_dim)
        k = self.k_proj(both).view(num, both.shape[1], s.num_kv_heads, s.head_dim)
        v = self.v_proj(both).view(num, both.shape[1], s.num_kv_heads, s.head_dim)
        q = rotate(self.q_norm(q), *q_rope).transpose(1, 2)  # [N, Hq, R, D]
        k = rotate(self.k_norm(k), *kv_rope).transpose(1, 2)  # [N, Hkv, C + R, D]
        group = s.num_heads // s.num_kv_heads
        k = k.repeat_interleave(group, dim=1)
        v = v.transpose(1, 2).repeat_interleave(group, dim=1)
        # The norms' fp32 weights promote q and k under autocast; attention runs in v's dtype.
        q, k = q.to(v.dtype), k.to(v.dtype)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None])  # [N, Hq, R, D]
        return self.o_proj(out.transpose(1, 2).reshape(num, rows, -1))


class BlockLayer(nn.Module):
    def __init__(self, shape: BlockDrafterShape):
        super().__init__()
        self.self_attn = BlockAttention(shape)
        self.mlp = MLP(shape.hidden_size, shape.intermediate_size)
        self.input_layernorm = RMSNorm(shape.hidden_size, shape.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(shape.hidden_size, shape.rms_norm_eps)

    def forward(self, h, features, q_rope, kv_rope, mask):
        h = h + self.self_attn(self.input_layernorm(h), features, q_rope, kv_rope, mask)
        return h + self.mlp(self.post_attention_layernorm(h))


class DemoBlockDrafter(nn.Module):
    """The trainable drafter; `embed` [vocab, hidden] is the target's tied embedding (frozen,
    input embedding and lm_head at once), kept as a buffer outside the state dict."""

    def __init__(self, shape: BlockDrafterShape, embed: torch.Tensor):
        super().__init__()
        assert embed.shape == (shape.vocab_size, shape.hidden_size), embed.shape
        self.shape = shape
        hidden = shape.hidden_size
        self.fc = nn.Linear(len(shape.target_layer_ids) * hidden, hidden, bias=False)
        self.hidden_norm = RMSNorm(hidden, shape.rms_norm_eps)
        self.layers = nn.ModuleList(BlockLayer(shape) for _ in range(shape.num_layers))
        self.norm = RMSNorm(hidden, shape.rms_norm_eps)
        self.register_buffer("embed", embed.detach().clone(), persistent=False)
        self._init_weights()

    def _init_weights(self) -> None:
        # N(0, 0.02), residual-output projections scaled down with depth (as the demo models).
        out_std = 0.02 / math.sqrt(2 * self.shape.num_layers)
        for name, p in self.named_parameters():
            if p.dim() == 2:
                std = out_std if name.endswith(("o_proj.weight", "down_proj.weight")) else 0.02
                nn.init.normal_(p, mean=0.0, std=std)

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def project_context(self, target_hidden: torch.Tensor) -> torch.Tensor:
        """[.., len(target_layer_ids) * hidden] -> context features [.., hidden]."""
        return self.hidden_norm(self.fc(target_hidden))

    def block_hidden(
        self,
        features: torch.Tensor,  # [N, C, hidden]
        context_positions: torch.Tensor,  # [N, C] int64
        block_ids: torch.Tensor,  # [N, R] int64
        block_positions: torch.Tensor,  # [N, R] int64
        mask: torch.Tensor,  # [N, R, C + R] bool
    ) -> torch.Tensor:
        """Final-normed hidden states [N, R, hidden] of every block row."""
        s = self.shape
        h = F.embedding(block_ids, self.embed).to(features.dtype)  # [N, R, hidden]
        q_rope = rope_tables(block_positions, s.head_dim, s.rope_theta)
        kv_rope = rope_tables(
            torch.cat([context_positions, block_positions], dim=1), s.head_dim, s.rope_theta
        )
        for layer in self.layers:
            h = layer(h, features, q_rope, kv_rope, mask)
        return self.norm(h)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden, self.embed.to(hidden.dtype))

    def forward(
        self,
        target_hidden: torch.Tensor,  # [N, T, len(target_layer_ids) * hidden], positions 0..T-1
        input_ids: torch.Tensor,  # [N, T] int64
        anchors: torch.Tensor,  # [N, K] int64 block starts, each <= T - 1
    ) -> torch.Tensor:
        """Hidden states [N, K, B, hidden] of K blocks per sequence (row 0 of each is the
        anchor's token; rows 1.. are the drafts)."""
        num, seq_len = input_ids.shape
        block_size = self.shape.block_size
        features = self.project_context(target_hidden)  # [N, T, hidden]
        ctx_pos = torch.arange(seq_len, device=input_ids.device).expand(num, seq_len)
        ids, positions = block_inputs(input_ids, anchors, block_size, self.shape.mask_token_id)
        mask = block_mask(anchors, seq_len, block_size)
        hidden = self.block_hidden(features, ctx_pos, ids, positions, mask)
        return hidden.view(num, anchors.shape[1], block_size, -1)


def target_states(
    target: DemoCausalLM, input_ids: torch.Tensor, layer_ids: tuple[int, ...]
) -> tuple[torch.Tensor, torch.Tensor]:
    """The drafter's input and the target's own output in one target forward: input_ids
    [N, T] -> (the outputs of target layers `layer_ids` side by side [N, T, L * hidden], the
    last layer's after the final norm as HF's hidden_states reports it; the final-normed
    hidden states [N, T, hidden], whose lm_head logits at t predict the token at t + 1)."""
    cfg = target.cfg
    cos, sin = rope_cos_sin(input_ids.shape[1], cfg.head_dim, cfg.rope_theta, input_ids.device)
    x = target.model.embed_tokens(input_ids)  # [N, T, hidden]
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    outputs = []
    for layer in target.model.layers:
        x = layer(x, cos, sin)
        outputs.append(x)
    final = target.model.norm(x)
    outputs[-1] = final
    return torch.cat([outputs[i] for i in layer_ids], dim=-1), final


def block_inputs(
    input_ids: torch.Tensor, anchors: torch.Tensor, block_size: int, mask_token_id: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """input_ids [N, T], anchors [N, K] -> block token ids and positions, each [N, K * B]:
    block j is [input_ids[anchors[j]], mask, ...] at positions anchors[j] .. anchors[j] + B - 1."""
    num = anchors.shape[0]
    offsets = torch.arange(block_size, device=anchors.device)
    positions = anchors[:, :, None] + offsets  # [N, K, B]
    ids = torch.full_like(positions, mask_token_id)
    ids[:, :, 0] = input_ids.gather(1, anchors)
    return ids.view(num, -1), positions.view(num, -1)


def block_mask(anchors: torch.Tensor, num_ctx: int, block_size: int) -> torch.Tensor:
    """anchors [N, K] -> [N, K * B, T + K * B] bool: a row of block j sees the context
    positions < anchors[j] and every row of block j, nothing else."""
    num, num_blocks = anchors.shape
    rows = num_blocks * block_size
    row_anchor = anchors.repeat_interleave(block_size, dim=1)  # [N, R]
    ctx = torch.arange(num_ctx, device=anchors.device)
    sees_ctx = ctx[None, None, :] < row_anchor[:, :, None]  # [N, R, T]
    block_of = torch.arange(rows, device=anchors.device) // block_size  # [R]
    sees_block = (block_of[:, None] == block_of[None, :]).expand(num, rows, rows)
    return torch.cat([sees_ctx, sees_block], dim=2)


def save_block_drafter(model: DemoBlockDrafter, out_dir: Path | str) -> Path:
    """Writes config.json and a bf16 model.safetensors (no embedding, no lm_head)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / CONFIG_FILE).write_text(json.dumps(model.shape.hf_config(), indent=2) + "\n")
    tensors = {
        k: v.detach().to(torch.bfloat16).contiguous().cpu() for k, v in model.state_dict().items()
    }
    save_file(tensors, str(out_dir / WEIGHTS_FILE), metadata={"format": "pt"})
    return out_dir


def load_trainable_block_drafter(model_dir: Path | str, embed: torch.Tensor) -> DemoBlockDrafter:
    """The saved drafter as a trainable module (float32 weights) over `embed`."""
    model_dir = Path(model_dir)
    shape = BlockDrafterShape.from_hf_config(json.loads((model_dir / CONFIG_FILE).read_text()))
    model = DemoBlockDrafter(shape, embed.float())
    state = load_file(str(model_dir / WEIGHTS_FILE))
    model.load_state_dict({k: v.float() for k, v in state.items()})
    return model
