"""A small deterministic stand-in for `Engine`, for HTTP-level edge cases that the real engine
cannot be pushed into on demand (a round that raises inside the engine's own bookkeeping,
rounds slowed down to a known pace).

It keeps the real interface: byte-level tokenizer, `add_request` validation and errors,
per-round deltas with cumulative draft counts, `abort`, `stats()` with slot and KV accounting.
Every live request gets one token per round: the letters of its seed's alphabet rotation.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from hipfire_serve.engine import ContextLengthError, EngineStats, QueueFullError, RoundStats
from hipfire_serve.types import CompletionOutput, RequestOutput, SamplingParams

NUM_SPECIAL = 3  # ids 0..2 are special; 0 is EOS


class ByteTokenizer:
    eos_token_ids = (0,)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [b + NUM_SPECIAL for b in text.encode()]

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        data = bytes(i - NUM_SPECIAL for i in ids if i >= NUM_SPECIAL)
        return data.decode(errors="replace")

    def apply_chat_template(self, messages, add_generation_prompt: bool = True) -> str:
        text = "".join(f"<{m['role']}>{m['content']}\n" for m in messages)
        return text + ("<assistant>" if add_generation_prompt else "")


@dataclass
class _Choice:
    index: int
    seed: int
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finished: bool = False


@dataclass
class _Req:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    choices: list[_Choice]
    running: bool = False


class EngineDouble:
    def __init__(
        self,
        *,
        max_concurrency: int = 4,
        max_queue: int = 16,
        max_model_len: int = 256,
        round_s: float = 0.0,
    ) -> None:
        self.tokenizer = ByteTokenizer()
        self.model_name = "double"
        self.max_model_len = max_model_len
        self.max_concurrency = max_concurrency
        self.max_queue = max_queue
        self.round_s = round_s
        self.fail_next_step = False  # raise out of step() once (engine bookkeeping broken)
        self._reqs: dict[str, _Req] = {}
        self._rounds: list[RoundStats] = []

    def add_request(
        self, request_id, prompt, params: SamplingParams, *, tenant="default", arrival_time=None
    ) -> None:
        params.validate()
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        if not ids:
            raise ValueError("prompt is empty")
        if len(ids) + params.max_tokens > self.max_model_len:
            raise ContextLengthError(len(ids), params.max_tokens, self.max_model_len)
        if sum(not r.running for r in self._reqs.values()) >= self.max_queue:
            raise QueueFullError(f"{self.max_queue} requests are waiting")
        seed = params.seed or 0
        choices = [_Choice(index=i, seed=seed + i) for i in range(params.n)]
        self._reqs[request_id] = _Req(request_id, ids, params, choices)

    def abort(self, request_id: str) -> None:
        self._reqs.pop(request_id, None)

    def has_unfinished(self) -> bool:
        return bool(self._reqs)

    def step(self) -> list[RequestOutput]:
        if self.fail_next_step:
            self.fail_next_step = False
            raise RuntimeError("engine bookkeeping broke")
        if self.round_s:
            time.sleep(self.round_s)
        running = [r for r in self._reqs.values() if r.running]
        for r in self._reqs.values():
            if not r.running and len(running) < self.max_concurrency:
                r.running = True
                running.append(r)
        outputs = []
        for r in running:
            deltas = [self._advance(r, c) for c in r.choices if not c.finished]
            finished = all(c.finished for c in r.choices)
            outputs.append(
                RequestOutput(
                    request_id=r.request_id,
                    prompt=None,
                    prompt_token_ids=r.prompt_ids,
                    outputs=deltas,
                    finished=finished,
                )
            )
            if finished:
                del self._reqs[r.request_id]
        self._rounds.append(
            RoundStats(
                route="A" * len(running),
                num_rows=len(running),
                num_padded_rows=len(running),
                num_kv_tokens=len(running),
                num_spec=0,
                num_ar=len(running),
                num_prefill=0,
                predicted_s=self.round_s,
                measured_s=self.round_s,
                phase_s={"forward": self.round_s},
                drafted_per_pos=[],
                accepted_per_pos=[],
                policy_switches=0,
                reason="double",
            )
        )
        return outputs

    def _advance(self, r: _Req, c: _Choice) -> CompletionOutput:
        token = NUM_SPECIAL + ord("a") + (c.seed + len(c.token_ids)) % 26
        c.token_ids.append(token)
        piece = self.tokenizer.decode([token])
        c.text += piece
        finish = None
        for stop in r.params.stop_strings:
            if c.text.endswith(stop):
                piece = piece[: len(piece) - len(stop)] if len(stop) <= len(piece) else ""
                finish = "stop"
        if finish is None and len(c.token_ids) >= r.params.max_tokens:
            finish = "length"
        c.finished = finish is not None
        return CompletionOutput(index=c.index, text=piece, token_ids=[token], finish_reason=finish)

    def stats(self) -> EngineStats:
        rounds, self._rounds = self._rounds, []
        running = sum(r.running for r in self._reqs.values())
        return EngineStats(
            num_running=running,
            num_waiting=len(self._reqs) - running,
            kv_usage=running / self.max_concurrency,
            slot_capacity=self.max_concurrency,
            live_slots=running,
            num_kv_blocks=self.max_concurrency,
            num_free_kv_blocks=self.max_concurrency - running,
            rounds=rounds,
        )
