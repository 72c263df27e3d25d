"""Where a request's emitted run stops: EOS and stop ids once min_tokens are out, max_tokens,
and stop strings (a stop checker). Tokens past the stop are never emitted."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import msgspec

from scheduler.request import Request

# (req_id, the run's tokens) -> (tokens kept, the stop string) at a stop string, else None
StopChecker = Callable[[int, Sequence[int]], "tuple[int, str] | None"]


class RunStop(msgspec.Struct, frozen=True):
    num_kept: int  # tokens of the run kept
    finish_reason: str | None  # "stop" | "length"; None: the request goes on
    stop_reason: int | str | None  # the stop token id or stop string


def stop_in_run(req: Request, tokens: list[int], stop_checker: StopChecker | None) -> RunStop:
    """The request's emitted run cut at its first stop."""
    spec = req.spec
    keep = len(tokens)
    finish: str | None = None
    stop_reason: int | str | None = None
    num_out = req.num_output
    for i, tok in enumerate(tokens):
        num_out += 1
        if num_out > spec.min_tokens:
            if tok in spec.stop_token_ids:
                keep, finish, stop_reason = i + 1, "stop", tok
                break
            if tok in spec.eos_token_ids:
                keep, finish = i + 1, "stop"
                break
        if num_out >= spec.max_tokens:
            keep, finish = i + 1, "length"
            break
    if stop_checker is not None and keep:
        hit = stop_checker(req.req_id, tuple(tokens[:keep]))
        if hit is not None:
            keep, stop_reason = min(hit[0], keep), hit[1]
            finish = "stop"
    return RunStop(keep, finish, stop_reason)
