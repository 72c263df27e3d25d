"""hipfire-serve: OpenAI-compatible serving with an adaptive speculative-decoding scheduler."""

from __future__ import annotations

from hipfire_serve.types import (
    CompletionOutput,
    RequestOutput,
    SamplingParams,
    StructuredOutputsParams,
)

__all__ = ["LLM", "CompletionOutput", "RequestOutput", "SamplingParams", "StructuredOutputsParams"]


def __getattr__(name: str):
    # LLM pulls in torch and the executor; load it only when asked for.
    if name == "LLM":
        from hipfire_serve.llm import LLM

        return LLM
    raise AttributeError(name)
