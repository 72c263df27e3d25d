"""This engine in its own process: `python -m loadtests.lab.peer.hipfire_child SPEC OUT`. Plain
decoding (no drafter, every round AR) unless the spec names a spec_mode and a draft; greedy, EOS
ignored; prefix caching and the KV cache's dtype as the spec says."""

from __future__ import annotations

import sys

from loadtests.lab.peer.config import PeerConfig
from loadtests.lab.peer.drive import child_main


class HipfireBackend:
    def __init__(self, llm):
        from hipfire_serve import SamplingParams

        self.llm = llm
        self.engine = llm.engine
        self._params = SamplingParams

    def _sampling(self, max_tokens: int):
        return self._params(max_tokens=max_tokens, ignore_eos=True, temperature=0.0)

    def generate(self, prompts: list[list[int]], max_tokens: int) -> list[int]:
        outs = self.llm.generate(prompts, self._sampling(max_tokens))
        return [len(o.outputs[0].token_ids) for o in outs]

    def add(self, req_id: str, prompt: list[int], max_tokens: int) -> None:
        self.engine.add_request(req_id, prompt, self._sampling(max_tokens))

    def cache_counts(self) -> tuple[int, int]:
        """(context tokens looked up in the prefix cache, tokens found there) so far."""
        c = self.engine.scheduler.prefix_cache.counters
        return sum(c.queries.values()), sum(c.hits.values())

    def round_routes(self) -> str:
        return "".join(r.route for r in self.engine.stats().rounds)

    def step(self) -> list[tuple[str, int, bool]]:
        # the engine's outputs carry each step's new tokens only
        return [(o.request_id, len(o.outputs[0].token_ids), o.finished) for o in self.engine.step()]


def build(spec: dict, result: dict) -> tuple[HipfireBackend, int]:
    import torch

    from hipfire_serve import LLM

    cfg = PeerConfig.from_json(spec["config"])
    llm = LLM(
        model=spec["model_path"],
        draft=spec.get("draft", "none"),
        spec_mode=spec.get("spec_mode", "ar"),
        max_concurrency=max(cfg.concurrency),
        max_model_len=cfg.max_model_len,
        enable_prefix_caching=bool(spec.get("prefix_caching")),
        kv_cache_dtype=spec.get("kv_cache_dtype", "auto"),
        graphs=cfg.hipfire_graphs,
        device=cfg.device,
        dtype=spec["dtype"],
        seed=cfg.seed,
    )
    engine = llm.engine
    device = engine.device
    econf = engine.config
    result.update(
        version=_version(),
        torch=torch.__version__,
        device_name=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        settings={
            "max_concurrency": econf.max_concurrency,
            "max_prefill_tokens": econf.max_prefill_tokens,
            "max_model_len": engine.max_model_len,
            "kv_cache_memory": econf.kv_cache_memory,
            "graphs": econf.graphs,
            "overlap_rounds": econf.overlap_rounds,
            "enable_prefix_caching": econf.enable_prefix_caching,
            "spec_mode": econf.spec_mode,
            "kv_cache_dtype": econf.kv_cache_dtype,
            "dtype": str(engine.target.weights.embed.dtype).removeprefix("torch."),
            "weight_bytes": engine.target.num_params * engine.target.weights.embed.element_size(),
        },
    )
    return HipfireBackend(llm), engine.target.config.vocab_size


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("hipfire-serve")
    except PackageNotFoundError:
        return "source"


if __name__ == "__main__":
    sys.exit(child_main("hipfire", build))
