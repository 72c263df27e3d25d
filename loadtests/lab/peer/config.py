"""What one `hipfire-bench peer-vllm` call runs (`PeerConfig`), and the small CPU set-up the
tests run (`QUICK`). The config crosses to the engine children as JSON."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

ENGINES = ("hipfire", "vllm")
WORKLOADS = ("wave", "chat")


@dataclass(frozen=True)
class PeerConfig:
    """One call: the model, the engines and workloads, the concurrency grid and the budget."""

    model: str = "random:qwen3-8b"  # 'random:NAME' (a real shape, random weights) or a directory
    engines: tuple[str, ...] = ENGINES
    workloads: tuple[str, ...] = WORKLOADS
    concurrency: tuple[int, ...] = (1, 4, 16, 32, 64, 128, 256)
    # wave: C requests at once, prompts uniform in [min, max] tokens, 1 + decode_tokens outputs
    wave_prompt_len: tuple[int, int] = (512, 1536)
    decode_tokens: int = 128
    repeats: int = 2  # each wave timing is the best of this many
    # chat: lognormal prompt and output lengths (median, sigma), clipped to [lo, hi]
    chat_prompt_len: tuple[int, float, int, int] = (512, 0.9, 32, 3072)
    chat_output_len: tuple[int, float, int, int] = (192, 0.7, 16, 1024)
    chat_waves: int = 2  # requests per C: max(chat_waves * C, chat_min_requests)
    chat_min_requests: int = 8
    seed: int = 0
    device: str = "auto"
    dtype: str = "auto"  # 'auto': the shape's own
    hipfire_graphs: str = "lazy"  # the engine's default: a decode graph captured at first use
    vllm_gpu_memory_utilization: float = 0.0  # 0: vLLM's default
    time_budget_s: float = 510.0  # the whole call; points that would not fit are skipped

    @property
    def max_model_len(self) -> int:
        """The context both engines are configured for: past the longest request of either
        workload (an engine may stop a request that reaches its limit), in whole 16-token
        blocks."""
        need = max(
            self.wave_prompt_len[1] + 1 + self.decode_tokens,
            self.chat_prompt_len[3] + self.chat_output_len[3],
        )
        return (need // 16 + 1) * 16

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> PeerConfig:
        names = {f.name for f in dataclasses.fields(cls)}
        kept = {k: tuple(v) if isinstance(v, list) else v for k, v in data.items() if k in names}
        return cls(**kept)

    def validate(self) -> None:
        """Raises ValueError with a one-line reason for a bad value."""
        bad = [e for e in self.engines if e not in ENGINES]
        bad += [w for w in self.workloads if w not in WORKLOADS]
        if bad:
            raise ValueError(f"unknown engines or workloads: {', '.join(bad)}")
        if not self.engines or not self.workloads or not self.concurrency:
            raise ValueError("need at least one engine, workload and concurrency value")
        if min(self.concurrency) < 1 or self.decode_tokens < 1 or self.repeats < 1:
            raise ValueError("--concurrency, --decode-tokens and --repeats must be >= 1")
        lo, hi = self.wave_prompt_len
        if not 1 <= lo <= hi:
            raise ValueError(f"--wave-prompt-len needs 1 <= min <= max, got {lo},{hi}")


QUICK = PeerConfig(
    model="random:tiny",
    engines=("hipfire",),
    concurrency=(1, 3),
    wave_prompt_len=(16, 40),
    decode_tokens=12,
    repeats=1,
    chat_prompt_len=(24, 0.6, 8, 64),
    chat_output_len=(6, 0.5, 2, 12),
    chat_waves=2,
    chat_min_requests=3,
    device="cpu",
    hipfire_graphs="off",
    time_budget_s=120.0,
)
