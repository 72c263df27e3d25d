"""The engine's requests as clients see them: each request's choices (n of them), their output
streams (incremental detokenization, stop strings), and what one step hands out of them."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from hipfire_serve.tokenizer import OutputStream, StreamStep, Tokenizer
from hipfire_serve.types import CompletionOutput, RequestOutput, SamplingParams
from scheduler.request import RoundDeltas


class TokenOnlyStream:
    """Output stream of a model without a tokenizer (random weights): ids only, no text."""

    def push(self, new_ids):
        return StreamStep("", None, len(new_ids))

    def finish(self):
        return StreamStep("", None, 0)


@dataclass
class Choice:
    request_id: str
    index: int
    stream: OutputStream | TokenOnlyStream
    token_ids: list[int] = field(default_factory=list)
    num_drafted: int = 0
    num_accepted: int = 0
    finished: bool = False


@dataclass
class ClientRequest:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    choice_ids: list[int]  # the scheduler's req_id of each choice


class StepOutputs:
    """What one step hands out: per request, one output per choice that emitted in the step."""

    def __init__(self):
        self.by_request: dict[str, dict[int, CompletionOutput]] = {}

    def emit(self, choice: Choice, text, token_ids, logprobs, reason, stop_reason) -> None:
        """Adds to the choice's output of this step."""
        per_request = self.by_request.setdefault(choice.request_id, {})
        out = per_request.get(choice.index)
        if out is None:
            per_request[choice.index] = CompletionOutput(
                index=choice.index,
                text=text,
                token_ids=list(token_ids),
                logprobs=list(logprobs) if logprobs is not None else None,
                finish_reason=reason,
                stop_reason=stop_reason,
                num_draft_tokens=choice.num_drafted,
                num_accepted_tokens=choice.num_accepted,
            )
            return
        out.text += text
        out.token_ids += token_ids
        if logprobs is not None:
            out.logprobs = (out.logprobs or []) + list(logprobs)
        out.finish_reason, out.stop_reason = reason, stop_reason
        out.num_draft_tokens, out.num_accepted_tokens = choice.num_drafted, choice.num_accepted


class RequestTable:
    """The requests not yet handed out finished, by request id, and their choices by req_id."""

    def __init__(self, tokenizer: Tokenizer | None):
        self.tokenizer = tokenizer
        self.requests: dict[str, ClientRequest] = {}
        self.choices: dict[int, Choice] = {}

    def __contains__(self, request_id: str) -> bool:
        return request_id in self.requests

    def __bool__(self) -> bool:
        return bool(self.requests)

    def __iter__(self):
        return iter(self.requests)

    def add(
        self,
        request_id: str,
        prompt: str | None,
        prompt_ids: list[int],
        params: SamplingParams,
        choice_ids: list[int],
    ) -> None:
        for index, req_id in enumerate(choice_ids):
            self.choices[req_id] = Choice(
                request_id=request_id, index=index, stream=self._make_stream(prompt_ids, params)
            )
        self.requests[request_id] = ClientRequest(
            request_id, prompt, prompt_ids, params, choice_ids
        )

    def _make_stream(self, prompt_ids: list[int], params: SamplingParams):
        if self.tokenizer is None:
            return TokenOnlyStream()
        return OutputStream(
            self.tokenizer,
            prompt_ids,
            stop_strings=params.stop_strings,
            include_stop_str_in_output=params.include_stop_str_in_output,
            skip_special_tokens=params.skip_special_tokens,
        )

    def remove(self, request_id: str) -> list[int]:
        """Forgets the request; returns the req_ids of its choices not yet finished."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return []
        return [c for c in req.choice_ids if not self.choices.pop(c).finished]

    def collect(
        self, out: StepOutputs, deltas: RoundDeltas | None, stop: Callable[[int, int, str], None]
    ) -> None:
        """A round's deltas into per-request outputs: text, stop strings, counters. A stop
        string ends the request in the scheduler at once through `stop(req_id, num output
        tokens, stop string)` (its tokens in flight are dropped)."""
        if deltas is None or not len(deltas):
            return
        req_ids = deltas.req_ids.tolist()
        starts = deltas.token_starts.tolist()
        token_ids = deltas.token_ids.tolist()
        num_drafted = deltas.num_drafted.tolist()
        num_accepted = deltas.num_accepted.tolist()
        finish = deltas.finish
        logprobs = deltas.logprobs
        choices = self.choices
        for i, req_id in enumerate(req_ids):
            choice = choices.get(req_id)
            if choice is None or choice.finished:
                continue  # aborted meanwhile, or ended by a stop string of an earlier round
            new = token_ids[starts[i] : starts[i + 1]]
            reason, stop_reason = finish.get(i, (None, None))
            lps = logprobs.get(i)
            step = choice.stream.push(new) if new else None
            text = step.text if step is not None else ""
            stopped = step is not None and step.stop is not None
            if stopped:
                keep = step.num_kept_ids
                new = new[:keep]
                lps = lps[:keep] if lps is not None else None
                reason, stop_reason = "stop", step.stop
                stop(req_id, len(choice.token_ids) + keep, step.stop)
            choice.token_ids += new
            choice.num_drafted += num_drafted[i]
            choice.num_accepted += num_accepted[i]
            if reason is not None:
                choice.finished = True
                if not stopped:
                    text += choice.stream.finish().text
            out.emit(choice, text, new, lps, reason, stop_reason)

    def fail(self, out: StepOutputs, req_ids: list[int]) -> None:
        """Ends these choices with finish reason "error" (those not finished already)."""
        for req_id in req_ids:
            choice = self.choices.get(req_id)
            if choice is None or choice.finished:
                continue
            choice.finished = True
            text = choice.stream.finish().text
            out.emit(choice, text, [], None, "error", None)

    def build(self, out: StepOutputs) -> list[RequestOutput]:
        """The step's outputs, one per request that emitted."""
        result = []
        for request_id, outs in out.by_request.items():
            req = self.requests.get(request_id)
            if req is None:
                continue
            result.append(
                RequestOutput(
                    request_id=request_id,
                    prompt=req.prompt,
                    prompt_token_ids=req.prompt_token_ids,
                    outputs=list(outs.values()),
                    finished=all(self.choices[c].finished for c in req.choice_ids),
                )
            )
        return result

    def forget_finished(self, outputs: list[RequestOutput]) -> list[RequestOutput]:
        """Forgets the requests these outputs finish; returns the outputs."""
        for output in outputs:
            if output.finished:
                for c in self.requests.pop(output.request_id).choice_ids:
                    del self.choices[c]
        return outputs
