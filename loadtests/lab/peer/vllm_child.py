"""vLLM in its own process: `python -m loadtests.lab.peer.vllm_child SPEC OUT`. vLLM's offline
`LLM` at its defaults (its attention backend, torch.compile, CUDA graphs, chunked prefill) but
for what both engines are given alike: the shape (random weights: `load_format='dummy'` from
the config.json the parent wrote), dtype, context length, `max_num_seqs` = the largest C,
prefix caching as the spec says, the seed. The wave goes through `LLM.generate`; the chat and
multi-turn workloads through its engine's add_request/step loop with outputs streamed as
deltas."""

from __future__ import annotations

import sys

from loadtests.lab.peer.config import PeerConfig
from loadtests.lab.peer.drive import child_main


def _prompt(ids: list[int]):
    try:
        from vllm.inputs import TokensPrompt
    except ImportError:  # a plain dict is the same prompt to every release
        return {"prompt_token_ids": ids}
    return TokensPrompt(prompt_token_ids=ids)


class VllmBackend:
    def __init__(self, llm):
        from vllm import SamplingParams

        try:
            from vllm.sampling_params import RequestOutputKind

            self._delta = RequestOutputKind.DELTA
        except ImportError:  # cumulative outputs: the new tokens are the growth
            self._delta = None
        self.llm = llm
        self.engine = llm.llm_engine
        self._params = SamplingParams
        self._seen: dict[str, int] = {}  # tokens seen per request (cumulative outputs)
        self._alias: dict[str, str] = {}  # the engine's id of a request -> ours

    def _sampling(self, max_tokens: int, stream: bool = False):
        kw = dict(max_tokens=max_tokens, ignore_eos=True, temperature=0.0, detokenize=False)
        if stream and self._delta is not None:
            kw["output_kind"] = self._delta
        return self._params(**kw)

    def generate(self, prompts: list[list[int]], max_tokens: int) -> list[int]:
        outs = self.llm.generate(
            [_prompt(p) for p in prompts], self._sampling(max_tokens), use_tqdm=False
        )
        return [len(o.outputs[0].token_ids) for o in outs]

    def add(self, req_id: str, prompt: list[int], max_tokens: int) -> None:
        # releases that make ids unique internally return the id their outputs may carry
        internal = self.engine.add_request(
            req_id, _prompt(prompt), self._sampling(max_tokens, stream=True)
        )
        if isinstance(internal, str) and internal != req_id:
            self._alias[internal] = req_id
        self._seen[req_id] = 0

    def step(self) -> list[tuple[str, int, bool]]:
        moved = []
        for out in self.engine.step():
            rid = self._resolve(out.request_id)
            num = len(out.outputs[0].token_ids) if out.outputs else 0
            if self._delta is None:
                num, self._seen[rid] = num - self._seen[rid], num
            moved.append((rid, num, out.finished))
            if out.finished:
                self._seen.pop(rid, None)
        return moved

    def _resolve(self, out_id: str) -> str:
        if out_id in self._seen:
            return out_id
        if out_id in self._alias:
            return self._alias[out_id]
        # an internal id is ours with "-<suffix>" appended
        rid = out_id
        while rid not in self._seen and "-" in rid:
            rid = rid.rsplit("-", 1)[0]
        return rid if rid in self._seen else out_id


def _get(obj, path: str):
    for name in path.split("."):
        obj = getattr(obj, name, None)
    return obj if obj is None or isinstance(obj, int | float | bool | str) else str(obj)


def build(spec: dict, result: dict) -> tuple[VllmBackend, int]:
    import vllm
    from vllm import LLM

    cfg = PeerConfig.from_json(spec["config"])
    kwargs = dict(
        model=spec["vllm_model"],
        skip_tokenizer_init=True,
        dtype=spec["dtype"],
        max_model_len=cfg.max_model_len,
        max_num_seqs=max(cfg.concurrency),
        enable_prefix_caching=bool(spec.get("prefix_caching")),
        seed=cfg.seed,
    )
    if spec["random_weights"]:
        kwargs["load_format"] = "dummy"
    if cfg.vllm_gpu_memory_utilization:
        kwargs["gpu_memory_utilization"] = cfg.vllm_gpu_memory_utilization
    llm = LLM(**kwargs)
    backend = VllmBackend(llm)
    import torch

    vc = getattr(llm.llm_engine, "vllm_config", None)
    result.update(
        version=vllm.__version__,
        torch=torch.__version__,
        device_name=torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
        settings={
            **{k: v for k, v in kwargs.items() if k != "model"},
            "max_num_batched_tokens": _get(vc, "scheduler_config.max_num_batched_tokens"),
            "chunked_prefill": _get(vc, "scheduler_config.enable_chunked_prefill"),
            "async_scheduling": _get(vc, "scheduler_config.async_scheduling"),
            "cudagraph_mode": _get(vc, "compilation_config.cudagraph_mode"),
            "compilation_mode": _get(vc, "compilation_config.mode"),
            "kv_cache_dtype": _get(vc, "cache_config.cache_dtype"),
            "stream_output_kind": "cumulative" if backend._delta is None else "delta",
        },
    )
    return backend, int(spec["vocab_size"])


if __name__ == "__main__":
    sys.exit(child_main("vllm", build))
