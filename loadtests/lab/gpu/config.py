"""What one `hipfire-bench gpu` call runs: the refill workload, models, policies, grid and time
budget (`BenchConfig`), and the small set-up the CPU tests run (`QUICK`)."""

from __future__ import annotations

from dataclasses import dataclass

from scheduler.sim.cli import PROFILES
from scheduler.sim.runner import RefillBench

REAL_POLICIES = ("adaptive", "all-ar", "all-spec", "threshold", "goodput", "sticky", "survival")
SIM_POLICIES = (*REAL_POLICIES, "clairvoyant")
# Fraction of the time budget kept for the simulator, the report and the plots.
RESERVE_FRACTION = 0.08


@dataclass(frozen=True)
class BenchConfig(RefillBench):
    """Everything one benchmark call runs: the refill workload (`RefillBench`: prompt and
    output lengths, waves, spec depth, prefill budget), models, policies, grid and budget."""

    model: str = "random:qwen3-8b"
    # cost drafters: at most one draft model and one block drafter ('random-block:NAME' or a
    # block drafter directory), 'ngram'
    drafters: tuple[str, ...] = ("random:qwen3-0.6b", "ngram")
    cohorts: tuple[str, ...] = ("code", "prose", "mixed")  # for the first drafter
    other_cohorts: tuple[str, ...] = ("mixed",)  # for the drafters after the first
    concurrency: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128)
    other_concurrency: tuple[int, ...] = ()  # for the drafters after the first; () the same
    policies: tuple[str, ...] = ("adaptive", "all-ar", "all-spec")
    sim_policies: tuple[str, ...] = SIM_POLICIES
    repeats: int = 2
    profile_rows: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 96, 128, 192, 256, 384, 512, 768, 1024)
    profile_kv_lens: tuple[int, ...] = (16, 512, 1024, 2048)
    profile_repeats: int = 6
    idle_concurrency: int = 64
    idle_rounds: int = 30
    time_budget_s: float = 500.0
    sim_seeds: int = 3
    kv_cache_memory: str = "72GiB"  # 1024 rows at 2048 tokens of KV fit the profile
    device: str = "auto"
    dtype: str = "bfloat16"
    seed: int = 0
    acceptance: str = str(PROFILES / "acceptance.json")
    keep_rounds: bool = False  # every step's record in the JSON (tests check the arithmetic)
    # every run's scheduler starts at the configured acceptance prior; by default the runs of a
    # (repeat, policy, drafter, cohort) carry what the estimator learned from each C to the next
    cold_estimator: bool = False
    # the draft model computes prefill chunks' KV in their rounds (EngineConfig's option)
    drafter_follows_prefill: str = "off"  # off | on | auto
    workers: int = 0  # simulator processes; 0: one per CPU (at most 16)

    def points(self) -> list[tuple[str, str]]:
        """(drafter, cohort) pairs of the speculative policies."""
        return [
            (d, c)
            for i, d in enumerate(self.drafters)
            for c in (self.other_cohorts if i else self.cohorts)
        ]

    def concurrency_of(self, drafter: str) -> tuple[int, ...]:
        """The concurrencies a drafter's points run at (all-AR: `concurrency`)."""
        first = not self.drafters or drafter in (self.drafters[0], "-")
        return self.concurrency if first or not self.other_concurrency else self.other_concurrency

    def _models(self, block: bool) -> list[str]:
        return [
            d for d in self.drafters if d not in ("ngram", "none") and is_block_spec(d) == block
        ]

    @property
    def block_drafter(self) -> str:
        """The block drafter among the cost drafters ('none' without one)."""
        blocks = self._models(block=True)
        if len(blocks) > 1:
            raise ValueError(f"one block drafter per run, got {', '.join(blocks)}")
        return blocks[0] if blocks else "none"

    @property
    def chain_drafter(self) -> str:
        """The draft model among the cost drafters ('none' without one)."""
        models = self._models(block=False)
        if len(models) > 1:
            raise ValueError(f"one draft model per run, got {', '.join(models)}")
        return models[0] if models else "none"

    @property
    def model_drafter(self) -> str:
        """The engine's own cost drafter: the block drafter where there is one (the engine
        then captures the target's hidden states for it), else the draft model; the other is
        built beside it (`runs.chain_beside`)."""
        block, chain = self.block_drafter, self.chain_drafter
        return block if block != "none" else chain


def is_block_spec(drafter: str) -> bool:
    """Whether a cost drafter names a block drafter (random weights or a checkpoint)."""
    from executor.drafters.block_config import is_block_drafter_dir

    return drafter.startswith("random-block:") or is_block_drafter_dir(drafter)


QUICK = BenchConfig(
    model="random:tiny",
    drafters=("random:tiny", "ngram"),
    cohorts=("code",),
    other_cohorts=("code",),
    concurrency=(1, 2, 4),
    sim_policies=("adaptive", "all-ar", "all-spec", "clairvoyant"),
    prompt_len=24,
    max_tokens=12,
    min_requests=2,
    profile_rows=(1, 2, 4, 8, 16, 32),
    profile_kv_lens=(16, 48),
    profile_repeats=1,
    idle_rounds=0,
    time_budget_s=120.0,
    sim_seeds=1,
    kv_cache_memory="64MiB",
    device="cpu",
    dtype="float32",
    keep_rounds=True,
    workers=1,
)
