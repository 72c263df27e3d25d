"""What one `hipfire-bench peer-vllm` call runs (`PeerConfig`), and the small CPU set-up the
tests run (`QUICK`). The config crosses to the engine children as JSON."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

# "hipfire-nocache" is this engine with prefix caching off whatever `prefix_caching` says: the
# baseline of a multi-turn call
ENGINES = ("hipfire", "vllm", "hipfire-nocache")
WORKLOADS = ("wave", "chat", "multiturn")


@dataclass(frozen=True)
class PeerConfig:
    """One call: the model, the engines and workloads, the concurrency grid and the budget."""

    model: str = "random:qwen3-8b"  # 'random:NAME' (a real shape, random weights) or a directory
    engines: tuple[str, ...] = ("hipfire", "vllm")
    workloads: tuple[str, ...] = ("wave", "chat")
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
    # multiturn: C conversations live, each `mt_turns` turns over one shared system prompt;
    # turn t's prompt is the system prompt, the earlier turns (user + assistant) and its user
    # message; a conversation's next turn is sent when its reply is done
    mt_system_len: int = 2048
    mt_turns: int = 4
    mt_user_len: tuple[int, float, int, int] = (128, 0.5, 16, 512)
    mt_output_len: tuple[int, float, int, int] = (128, 0.5, 16, 384)
    mt_waves: int = 2  # conversations per C: max(mt_waves * C, mt_min_conversations)
    mt_min_conversations: int = 8
    prefix_caching: bool = False  # both engines' automatic prefix caching
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
        if "multiturn" in self.workloads:
            need = max(need, self.mt_system_len + self.mt_turns * self.mt_turn_max)
        return (need // 16 + 1) * 16

    @property
    def mt_turn_max(self) -> int:
        """The most tokens one turn adds to a conversation (user message and reply)."""
        return self.mt_user_len[3] + self.mt_output_len[3]

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
        if self.mt_turns < 1 or self.mt_system_len < 0 or self.mt_waves < 1:
            raise ValueError("--mt-turns and --mt-waves must be >= 1, --mt-system-len >= 0")


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
    mt_system_len=48,
    mt_turns=3,
    mt_user_len=(8, 0.5, 2, 16),
    mt_output_len=(4, 0.5, 2, 8),
    mt_waves=1,
    mt_min_conversations=3,
    device="cpu",
    hipfire_graphs="off",
    time_budget_s=120.0,
)
