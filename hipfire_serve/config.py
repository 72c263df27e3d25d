"""Engine configuration: one dataclass whose field docs become the CLI's `--help`.

The offline `LLM(...)` API takes these fields as keyword arguments; `hipfire-serve serve` takes
them as `--kebab-case` flags (plus the server's own fields in `hipfire_serve/server/config.py`).
Each field carries `metadata={"help": ...}`; choices are listed in `metadata["choices"]`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field


def _f(default, help_: str, **extra):
    return field(default=default, metadata={"help": help_, **extra})


@dataclass(frozen=True, kw_only=True)
class EngineConfig:
    model: str = _f("demo", "model directory (Hugging Face format) or 'demo' for the embedded one")
    draft: str = _f(
        "auto",
        "drafter: a model directory, 'ngram', 'synthetic' (benchmarks only), 'none', or 'auto' "
        "(the demo block drafter with the demo target, else none)",
    )
    draft_rerank: bool = _f(
        False,
        "re-rank a block drafter's top-k candidates for greedy requests with an online learner "
        "trained on verified tokens (only with a block drafter; outputs are unchanged)",
    )
    spec_mode: str = _f("adaptive", "speculation policy", choices=("adaptive", "spec", "ar"))
    spec_depth: int = _f(8, "rows verified per speculating request (drafts + 1), at most")
    max_concurrency: int = _f(64, "live slot capacity (requests decoding at once)")
    max_queue: int = _f(1024, "waiting requests beyond which new ones get 503")
    max_model_len: int = _f(0, "context length limit; 0 takes the model's")
    kv_cache_memory: str = _f(
        "auto", "KV cache size: bytes with unit (e.g. 8GiB), or 'auto' (a share of free memory)"
    )
    kv_cache_dtype: str = _f(
        "auto",
        "KV cache element type: 'auto' (the model's dtype) or 'fp8' = 'fp8_e4m3' "
        "(float8_e4m3fn: a budget holds twice the tokens of bf16; K and V scaled per KV head "
        "by the checkpoint's k_scale / v_scale, else 1.0; NVIDIA compute capability 8.9+, AMD, "
        "CPU)",
        choices=("auto", "fp8", "fp8_e4m3"),
    )
    block_size: int = _f(16, "tokens per KV cache block")
    max_prefill_tokens: int = _f(
        2048,
        "prompt tokens prefilled per round (chunked prefill; a prompt's rest of up to 1/8 of "
        "it is taken along rather than left to a round of its own)",
    )
    dtype: str = _f("auto", "weights dtype", choices=("auto", "bfloat16", "float16", "float32"))
    device: str = _f("auto", "torch device: 'auto' (cuda if present, else cpu), 'cuda:0', 'cpu'")
    graphs: str = _f(
        "lazy", "CUDA/HIP graphs for decode rounds", choices=("lazy", "startup", "off")
    )
    drafter_follows_prefill: str = _f(
        "off",
        "a draft model computes prefill chunks' KV in the chunks' rounds, so a request's first "
        "speculating round needs no catch-up on its prompt: off, on (every prompt), or auto "
        "(prompts whose following the policy's speculation on the live batch, every request "
        "decoding with its drafter caught up, would pay back)",
        choices=("off", "on", "auto"),
    )
    enable_prefix_caching: bool = _f(
        True,
        "automatic prefix caching: a prompt's full KV blocks already computed (system prompts, "
        "earlier turns) are reused instead of recomputed; per tenant unless "
        "--shared-prefix-cache",
    )
    shared_prefix_cache: bool = _f(
        False,
        "one prefix cache for all tenants (by default a tenant only reuses blocks its own "
        "requests made, so no tenant can time another's prompts); a request's cache_salt "
        "separates either way",
    )
    overlap_rounds: bool = _f(
        True,
        "launch an AR decode round before the previous one finishes (its tokens stay on the "
        "device), so the host's work between rounds overlaps the device's",
    )
    cost_profile: str = _f(
        "auto",
        "scheduler cost profile JSON; 'auto': the cached one for this set-up, else measured at "
        "start-up on a GPU; 'build': measure at start-up and cache",
    )
    acceptance_profile: str = _f(
        "", "acceptance profile JSON (only for --draft synthetic) and its cohort as FILE:COHORT"
    )
    allow_synthetic_draft: bool = _f(False, "permit --draft synthetic (benchmarks only)")
    synthetic_cost_drafter: str = _f(
        "none",
        "with --draft synthetic: a real drafter run every round for its cost only, its proposals "
        "discarded ('none', 'ngram', a draft model directory, 'random:NAME' or "
        "'random-block:NAME', a random-weight block drafter beside the target)",
    )
    seed: int = _f(0, "base seed for sampling without a per-request seed")

    def replace(self, **changes) -> EngineConfig:
        return dataclasses.replace(self, **changes)

    def validate(self) -> None:
        """Raises ValueError with a one-line reason for a bad value or combination."""
        for f in config_fields(type(self)):
            choices = f.metadata.get("choices")
            if choices and getattr(self, f.name) not in choices:
                raise ValueError(
                    f"--{f.name.replace('_', '-')} must be one of {', '.join(choices)}, "
                    f"got {getattr(self, f.name)!r}"
                )
        if self.spec_depth < 1 or self.spec_depth > 32:
            raise ValueError(f"--spec-depth must be in [1, 32], got {self.spec_depth}")
        if self.max_concurrency < 1:
            raise ValueError(f"--max-concurrency must be >= 1, got {self.max_concurrency}")
        if self.max_queue < 0:
            raise ValueError(f"--max-queue must be >= 0, got {self.max_queue}")
        if self.block_size not in (8, 16, 32, 64):
            raise ValueError(f"--block-size must be 8, 16, 32 or 64, got {self.block_size}")
        if self.max_prefill_tokens < self.block_size:
            raise ValueError("--max-prefill-tokens must be at least --block-size")
        if self.draft == "synthetic" and not self.allow_synthetic_draft:
            raise ValueError(
                "--draft synthetic fakes acceptance for benchmarks; add --allow-synthetic-draft"
            )
        if self.draft == "synthetic" and not self.acceptance_profile:
            raise ValueError("--draft synthetic needs --acceptance-profile FILE:COHORT")
        if self.synthetic_cost_drafter in ("synthetic", "auto"):
            raise ValueError("--synthetic-cost-drafter must be none, ngram or a draft model")
        if self.spec_mode == "spec" and self.draft == "none":
            raise ValueError("--spec-mode spec needs a drafter (--draft is 'none')")


def config_fields(cls) -> list[dataclasses.Field]:
    return [f for f in dataclasses.fields(cls) if f.init]
