"""Offline batch generation in the style of vLLM's `LLM` class, through the same scheduler and
executor as the server."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from hipfire_serve.config import EngineConfig
from hipfire_serve.engine import Engine
from hipfire_serve.types import CompletionOutput, RequestOutput, SamplingParams


class LLM:
    """`LLM(model=..., device=..., draft=..., spec_mode=..., ...)`: every `EngineConfig` field is
    a keyword argument (the server's flags in snake_case)."""

    def __init__(self, model: str = "demo", **kwargs):
        known = {f.name for f in dataclasses.fields(EngineConfig)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise TypeError(f"LLM() got unknown option(s): {', '.join(unknown)}")
        if "kv_cache_memory" not in kwargs and kwargs.get("device", "auto") == "cpu":
            kwargs["kv_cache_memory"] = "256MiB"
        self.engine = Engine(EngineConfig(model=model, **kwargs))
        self.tokenizer = self.engine.tokenizer
        self._counter = 0

    def generate(
        self,
        prompts: str | Sequence[str] | Sequence[int] | Sequence[Sequence[int]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Runs all prompts to completion; returns one RequestOutput per prompt, in order.
        A prompt is a string or a list of token ids."""
        if isinstance(prompts, str) or (
            isinstance(prompts, Sequence) and prompts and isinstance(prompts[0], int)
        ):
            prompts = [prompts]  # type: ignore[list-item]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        params_list = (
            list(sampling_params)
            if isinstance(sampling_params, Sequence)
            else [sampling_params] * len(prompts)
        )
        if len(params_list) != len(prompts):
            raise ValueError(f"{len(params_list)} sampling params for {len(prompts)} prompts")
        ids = []
        for prompt, params in zip(prompts, params_list):
            request_id = f"offline-{self._counter}"
            self._counter += 1
            self.engine.add_request(
                request_id, prompt if isinstance(prompt, str) else list(prompt), params
            )
            ids.append(request_id)
        finals: dict[str, RequestOutput] = {}
        for request_id, prompt in zip(ids, prompts):
            finals[request_id] = RequestOutput(
                request_id=request_id,
                prompt=prompt if isinstance(prompt, str) else None,
                prompt_token_ids=[],
                outputs=[],
                finished=False,
            )
        choices: dict[str, dict[int, CompletionOutput]] = {i: {} for i in ids}
        while self.engine.has_unfinished():
            for out in self.engine.step():
                final = finals[out.request_id]
                final.prompt_token_ids = out.prompt_token_ids
                for c in out.outputs:
                    acc = choices[out.request_id].setdefault(
                        c.index, CompletionOutput(index=c.index)
                    )
                    acc.text += c.text
                    acc.token_ids += c.token_ids
                    if c.logprobs is not None:
                        acc.logprobs = (acc.logprobs or []) + c.logprobs
                    acc.finish_reason = c.finish_reason
                    acc.stop_reason = c.stop_reason
                    acc.num_draft_tokens = c.num_draft_tokens
                    acc.num_accepted_tokens = c.num_accepted_tokens
                final.finished = out.finished
        for request_id in ids:
            finals[request_id].outputs = [
                choices[request_id][i] for i in sorted(choices[request_id])
            ]
        return [finals[i] for i in ids]
