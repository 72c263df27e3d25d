"""One streamed request as the load generator saw it, and the latencies derived from it.

All times are seconds on one monotonic clock, relative to the start of the run, so that the
records of one run can be laid on a single timeline (full-live windows, tokens/s over time).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class RequestRecord:
    req_id: int
    tenant: str
    submit_s: float  # when the HTTP request was sent
    end_s: float  # when the stream closed (or failed)
    chunk_times_s: tuple[float, ...] = ()  # arrival of each stream chunk that carried tokens
    chunk_tokens: tuple[int, ...] = ()  # tokens in each of those chunks (same length)
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0  # the server's usage count when it sent one, else sum(chunk_tokens)
    token_count_source: str = "chunks"  # token_ids | logprobs | usage | chunks (see client.py)
    finish_reason: str | None = None
    error: str = ""  # empty when the request succeeded
    prompt_id: str = ""
    extra: dict = field(default_factory=dict, compare=False)  # the workload's tags (client.py)
    output_text: str = field(default="", compare=False, repr=False)  # the reply's content

    @property
    def ok(self) -> bool:
        return not self.error and len(self.chunk_times_s) > 0

    @property
    def first_token_s(self) -> float | None:
        return self.chunk_times_s[0] if self.chunk_times_s else None

    @property
    def last_token_s(self) -> float | None:
        return self.chunk_times_s[-1] if self.chunk_times_s else None

    @property
    def ttft_s(self) -> float | None:
        """Time to first token: submission to the first chunk that carries a token."""
        return None if not self.chunk_times_s else self.chunk_times_s[0] - self.submit_s

    @property
    def e2e_s(self) -> float:
        """End-to-end latency: submission to the end of the stream."""
        return self.end_s - self.submit_s

    @property
    def itls_s(self) -> tuple[float, ...]:
        """Gaps between successive token-carrying chunks (what a reader of the stream waits).

        A speculative server may put several tokens in one chunk; the gap is still one wait,
        which is why the per-token figure is TPOT, not the mean ITL."""
        t = self.chunk_times_s
        return tuple(t[i + 1] - t[i] for i in range(len(t) - 1))

    @property
    def tpot_s(self) -> float | None:
        """Time per output token after the first: (last token - first token) / (n - 1)."""
        if self.num_output_tokens < 2 or not self.chunk_times_s:
            return None
        return (self.chunk_times_s[-1] - self.chunk_times_s[0]) / (self.num_output_tokens - 1)
