"""The engine's parts, built from its configuration: the device, the target and draft models
(checkpoints or random weights of a real shape), the drafter, the KV cache's size and the round
executor."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from executor.drafters.base import Drafter
from executor.drafters.block_config import is_block_drafter_dir
from executor.drafters.block_model import BlockDraftModel, load_block_drafter
from executor.drafters.random_block import random_block_drafter
from executor.kv_cache import KVCache, auto_kv_budget, parse_bytes, resolve_kv_cache_dtype
from executor.loader import load_model, resolve_dtype
from executor.model import Model
from executor.random_model import PRESETS, random_model
from executor.round_executor import RoundExecutor
from hipfire_serve.config import EngineConfig
from hipfire_serve.tokenizer import Tokenizer
from scheduler.kv_blocks import num_blocks_for

log = logging.getLogger("hipfire_serve.engine")

RANDOM_PREFIX = "random:"
RANDOM_BLOCK_PREFIX = "random-block:"  # a random-weight block drafter beside the target


@dataclass(frozen=True)
class EngineParts:
    device: torch.device
    target_dir: Path
    draft_spec: str  # a directory, 'ngram', 'synthetic' or 'none'
    tokenizer: Tokenizer | None  # None: random weights, token-id prompts only
    target: Model
    model_name: str
    max_model_len: int
    num_kv_blocks: int
    drafter: Drafter | None
    executor: RoundExecutor


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {name}: no CUDA/HIP device is available")
    return device


def resolve_model_dirs(config: EngineConfig) -> tuple[Path, str]:
    """Returns (target dir, drafter spec: a directory, 'ngram', 'synthetic' or 'none')."""
    if config.model == "demo":
        from hipfire_serve.demo import demo_block_drafter_dir, demo_model_dir

        target = demo_model_dir()
        draft = str(demo_block_drafter_dir()) if config.draft == "auto" else config.draft
    else:
        target = Path(config.model)
        draft = "none" if config.draft == "auto" else config.draft
    return target, draft


def _random_model(config: EngineConfig, spec: str, device: torch.device, seed: int = 0) -> Model:
    name = spec[len(RANDOM_PREFIX) :]
    if name not in PRESETS:
        raise ValueError(f"unknown random model {name!r} (choose {', '.join(PRESETS)})")
    dtype = resolve_dtype(config.dtype, PRESETS[name], device)
    max_pos = min(PRESETS[name].max_position, config.max_model_len or 8192) + 64
    return random_model(name, device=device, dtype=dtype, seed=seed, max_position=max_pos)


def _draft_model(
    config: EngineConfig, draft_spec: str, target: Model, device
) -> Model | BlockDraftModel | None:
    """The model the drafter runs, if any (a synthetic drafter may run one for its cost): a
    draft model, or a block drafter when the directory holds one ('random-block:NAME': one of
    random weights beside the target)."""
    model_spec = config.synthetic_cost_drafter if draft_spec == "synthetic" else draft_spec
    if model_spec.startswith(RANDOM_PREFIX):
        return _random_model(config, model_spec, device, seed=1)
    if model_spec in ("none", "ngram", "synthetic"):
        return None
    block = model_spec.startswith(RANDOM_BLOCK_PREFIX)
    if block or is_block_drafter_dir(model_spec):
        if block:
            drafter = random_block_drafter(target, model_spec[len(RANDOM_BLOCK_PREFIX) :], seed=1)
        else:
            drafter = load_block_drafter(model_spec, target)
        if config.spec_depth > drafter.config.block_size:
            raise ValueError(
                f"--spec-depth {config.spec_depth} exceeds the block drafter's block of "
                f"{drafter.config.block_size} rows: lower --spec-depth"
            )
        return drafter
    draft_model = load_model(model_spec, dtype=str(target.dtype).split(".")[-1], device=device)
    if draft_model.config.vocab_size != target.config.vocab_size:
        raise ValueError(
            f"draft model vocabulary ({draft_model.config.vocab_size}) differs from the "
            f"target's ({target.config.vocab_size})"
        )
    return draft_model


def _make_drafter(
    config: EngineConfig,
    spec: str,
    draft_model: Model | BlockDraftModel | None,
    num_blocks: int,
    max_len: int,
) -> Drafter | None:
    if spec == "none":
        return None
    if spec == "ngram":
        from executor.drafters.ngram import NgramDrafter

        return NgramDrafter()
    if spec == "synthetic":
        from executor.drafters.synthetic import SyntheticDrafter

        inner = _make_drafter(
            config, config.synthetic_cost_drafter, draft_model, num_blocks, max_len
        )
        path, _, cohort = config.acceptance_profile.rpartition(":")
        return SyntheticDrafter(path, cohort, seed=config.seed, inner=inner)
    if isinstance(draft_model, BlockDraftModel):
        from executor.drafters.block_drafter import BlockDrafter
        from executor.drafters.rerank import OnlineReranker

        return BlockDrafter(
            draft_model,
            num_blocks=num_blocks,
            block_size=config.block_size,
            max_slots=config.max_concurrency,
            max_model_len=max_len,
            seed=config.seed,
            graphs="off" if config.graphs == "off" else "lazy",
            reranker=OnlineReranker() if config.draft_rerank else None,
        )
    from executor.drafters.draft_model import DraftModelDrafter

    return DraftModelDrafter(
        draft_model,
        num_blocks=num_blocks,
        block_size=config.block_size,
        max_slots=config.max_concurrency,
        max_model_len=max_len,
    )


def build_engine_parts(config: EngineConfig) -> EngineParts:
    """Loads the models and sizes the KV cache by `config` (validated); raises ValueError with
    the flag to change when the set-up cannot serve one full-length request."""
    device = resolve_device(config.device)
    # refused before any weight loads; 'auto' is the target's dtype, known once it is loaded
    kv_fp8 = None
    if config.kv_cache_dtype != "auto":
        kv_fp8 = resolve_kv_cache_dtype(config.kv_cache_dtype, None, device)
    target_dir, draft_spec = resolve_model_dirs(config)
    if config.model.startswith(RANDOM_PREFIX):
        # random weights of a real shape: benchmarks only, token-id prompts, no text
        tokenizer = None
        target = _random_model(config, config.model, device)
        model_name = config.model
    else:
        tokenizer = Tokenizer.from_dir(target_dir)
        target = load_model(target_dir, dtype=config.dtype, device=device)
        model_name = target_dir.name if config.model != "demo" else "hipfire-demo"
    limit = config.max_model_len or target.config.max_position
    max_model_len = min(limit, target.config.max_position)
    draft_model = _draft_model(config, draft_spec, target, device)
    if config.draft_rerank and not isinstance(draft_model, BlockDraftModel):
        raise ValueError(
            f"--draft-rerank needs a block drafter, and --draft {draft_spec} is not one: "
            "drop --draft-rerank or serve a block drafter's directory"
        )
    budget = (
        auto_kv_budget(device)
        if config.kv_cache_memory == "auto"
        else parse_bytes(config.kv_cache_memory)
    )
    if getattr(target, "is_hybrid", False):
        # a hybrid target's per-slot recurrent state comes out of the same budget
        from executor.recurrent_state import RecurrentStates

        state = RecurrentStates.bytes_per_slot(target.config, target.dtype.itemsize)
        budget -= state * config.max_concurrency
        if budget <= 0:
            raise ValueError(
                f"--kv-cache-memory does not hold the recurrent state of {config.max_concurrency} "
                f"slots ({state * config.max_concurrency} bytes): raise it or lower "
                "--max-concurrency"
            )
    # every model keeping KV under the shared block ids: the target, a draft model or the
    # block drafter's layers; their caches all take --kv-cache-dtype
    kv_models = [target]
    if isinstance(draft_model, BlockDraftModel):
        kv_models.append(draft_model.decoder)
    elif draft_model is not None:
        kv_models.append(draft_model)
    kv_dtype = kv_fp8 or target.dtype
    for model in kv_models:
        model.kv_cache_dtype = kv_dtype
    if kv_dtype != target.dtype:
        names = ("target", "drafter")
        log.info(
            "KV cache in %s: %s",
            str(kv_dtype).removeprefix("torch."),
            "; ".join(f"{n} {m.kv_scales.describe()}" for n, m in zip(names, kv_models)),
        )
    configs = [model.config for model in kv_models]
    num_blocks = KVCache.blocks_for_budget(configs, budget, config.block_size, kv_dtype)
    # rows past the context limit: a request's last round verifies up to spec_depth of them
    # (a block drafter's block reaches as far)
    reach = config.spec_depth
    if isinstance(draft_model, BlockDraftModel):
        reach = max(reach, draft_model.config.block_size)
    min_blocks = num_blocks_for(max_model_len + reach, config.block_size)
    if num_blocks < min_blocks:
        raise ValueError(
            f"KV cache budget holds {num_blocks} blocks but one full-length request needs "
            f"{min_blocks}: raise --kv-cache-memory or lower --max-model-len"
        )
    max_len = max_model_len + reach
    drafter = _make_drafter(config, draft_spec, draft_model, num_blocks, max_len)
    slots = config.max_concurrency
    executor = RoundExecutor(
        target,
        num_blocks=num_blocks,
        block_size=config.block_size,
        max_slots=slots,
        max_model_len=max_len,
        drafter=drafter,
        base_seed=config.seed,
        graphs=config.graphs,
        max_graph_rows=slots * config.spec_depth,
        drafter_follows_prefill=config.drafter_follows_prefill != "off",
    )
    return EngineParts(
        device=device,
        target_dir=target_dir,
        draft_spec=draft_spec,
        tokenizer=tokenizer,
        target=target,
        model_name=model_name,
        max_model_len=max_model_len,
        num_kv_blocks=num_blocks,
        drafter=drafter,
        executor=executor,
    )
