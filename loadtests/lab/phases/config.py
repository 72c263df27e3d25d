"""What one `hipfire-bench phase-profile` call runs (`PhaseConfig`), the small CPU set-up the
tests run (`QUICK`), and the `PeerConfig` the engine children are built from (the same
builders, prompts and roofline as `peer-vllm`). The config crosses to the children as JSON."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from loadtests.lab.peer.config import PeerConfig

ENGINES = ("hipfire", "vllm")


@dataclass(frozen=True)
class PhaseConfig:
    """One call: the model, the engines, the concurrency grid, the step counts and the budget."""

    model: str = "random:qwen3-8b"  # 'random:NAME' (a real shape, random weights) or a directory
    engines: tuple[str, ...] = ("hipfire", "vllm")
    concurrency: tuple[int, ...] = (64, 128, 256)
    prompt_len: tuple[int, int] = (1024, 1024)  # wave prompts uniform in [min, max] tokens
    warmup_steps: int = 4  # decode steps after the prefill, before anything is timed
    steps: int = 24  # decode steps timed unprofiled, then as many under the profiler
    seed: int = 0
    device: str = "auto"
    dtype: str = "auto"  # 'auto': the shape's own
    hipfire_graphs: str = "lazy"  # the engine's default: a decode graph captured at first use
    vllm_gpu_memory_utilization: float = 0.0  # 0: vLLM's default
    time_budget_s: float = 480.0  # the whole call; points that would not fit are skipped

    def max_tokens(self, num_seqs: int) -> int:
        """Each request's output: the first token, the warm-up, both windows and a short tail,
        plus room for the tokens the first requests decode while the last ones still prefill
        (a round prefills 512 tokens at least), so no request finishes inside a window."""
        prefill_rounds = -(-num_seqs * self.prompt_len[1] // 512)
        return 1 + self.warmup_steps + 2 * self.steps + 4 + prefill_rounds

    def peer_config(self) -> PeerConfig:
        """The `PeerConfig` the children build their engines and prompts from. Its
        `decode_tokens` is 2 * warm-up + 3 * steps so that the roofline's mean context,
        prompt + (decode_tokens + 1) / 2, is the profiled window's: its steps read prompt +
        warm-up + steps + 1 .. prompt + warm-up + 2 * steps tokens of KV per request."""
        return PeerConfig(
            model=self.model,
            engines=("hipfire",),
            workloads=("wave",),
            concurrency=self.concurrency,
            wave_prompt_len=self.prompt_len,
            decode_tokens=2 * self.warmup_steps + 3 * self.steps,
            repeats=1,
            seed=self.seed,
            device=self.device,
            dtype=self.dtype,
            hipfire_graphs=self.hipfire_graphs,
            vllm_gpu_memory_utilization=self.vllm_gpu_memory_utilization,
            time_budget_s=self.time_budget_s,
        )

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> PhaseConfig:
        names = {f.name for f in dataclasses.fields(cls)}
        kept = {k: tuple(v) if isinstance(v, list) else v for k, v in data.items() if k in names}
        return cls(**kept)

    def validate(self) -> None:
        """Raises ValueError with a one-line reason for a bad value."""
        bad = [e for e in self.engines if e not in ENGINES]
        if bad:
            raise ValueError(f"unknown engines: {', '.join(bad)} (choose {', '.join(ENGINES)})")
        if not self.engines or not self.concurrency or min(self.concurrency) < 1:
            raise ValueError("need at least one engine and concurrency values >= 1")
        if self.steps < 1 or self.warmup_steps < 0:
            raise ValueError("--steps must be >= 1 and --warmup-steps >= 0")
        lo, hi = self.prompt_len
        if not 1 <= lo <= hi:
            raise ValueError(f"--prompt-len needs 1 <= min <= max, got {lo},{hi}")


QUICK = PhaseConfig(
    model="random:tiny",
    engines=("hipfire",),
    concurrency=(2, 3),
    prompt_len=(16, 24),
    warmup_steps=1,
    steps=3,
    device="cpu",
    hipfire_graphs="off",
    time_budget_s=120.0,
)
