"""One weight format's engine in its own process: `python -m loadtests.lab.quant_child SPEC OUT`.

The target is the random-weight model of the spec's shape (seed 0: the same weights in every
child), served as built (bf16) or encoded into a released layout and read back by the loader
(`quant_layouts.quantized_model`). The child records the bytes a decode step reads of those
weights and the linear layers' path, the greedy tokens of the agreement prompts, then the wave
points of `peer/drive.py` through `hipfire_serve.LLM` (the spec's spec_mode and draft, greedy,
EOS ignored, no prefix caching)."""

from __future__ import annotations

import gc
import json
import sys
from pathlib import Path

import torch

from loadtests.lab.peer.config import PeerConfig
from loadtests.lab.peer.drive import child_main
from loadtests.lab.peer.workloads import wave_prompts
from loadtests.lab.quant_layouts import Layout, quantized_model

# what each format's child builds: None keeps the dense random weights
LAYOUT_KINDS = {"bf16": None, "fp8": "fp8", "w4a16": "gptq"}
AGREEMENT_SEED_OFFSET = 77  # prompts of their own, apart from the wave's
ENCODED: list[str] = []  # targets `install_layout`'s builder made in this process


def install_layout(layout: Layout) -> None:
    """The engine builds a `random:NAME` target through `engine_setup.random_model`; this
    process's engine gets that name rebound to a builder that encodes the random weights into
    `layout` (the product has no way in for a model made in memory). Draft models (seed != 0)
    stay dense."""
    from hipfire_serve import engine_setup

    build = getattr(engine_setup, "random_model", None)
    if build is None:
        raise RuntimeError("hipfire_serve.engine_setup no longer builds targets by random_model")

    def encoded(name: str, **kwargs):
        model = build(name, **kwargs)
        if kwargs.get("seed", 0) != 0:
            return model
        quantized = quantized_model(model, layout, kwargs.get("ops_backend", "auto"))
        del model  # its dense linear weights: the KV budget is sized from what is free next
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        ENCODED.append(name)
        return quantized

    engine_setup.random_model = encoded


def step_weight_bytes(model) -> dict:
    """Bytes a decode step reads of the weights as the model holds them: every layer's tensors
    and packed linear weights (scales, zeros included), the final norm and the LM head once,
    and of an untied input embedding only each row's line (`per_row`)."""
    w = model.weights
    static = w.final_norm.nbytes + w.lm_head.nbytes
    for lw in w.layers:
        static += sum(t.nbytes for t in vars(lw).values() if hasattr(t, "nbytes"))
    per_row = 0 if w.lm_head is w.embed else w.embed.shape[1] * w.embed.element_size()
    return {"static": int(static), "per_row": int(per_row)}


def linear_path(model) -> str:
    """How the model's linear layers compute, in words (what the record shows per format)."""
    from executor.quant.fp8 import Fp8Linear
    from executor.quant.int4 import Int4Linear

    qkv = model.weights.layers[0].qkv
    kernels = model.ops.kernels
    if isinstance(qkv, Fp8Linear):
        return (
            "FP8 (the 128x128 block scales requantized per output channel at load): 1-16 rows "
            "W8A16 through Triton kernels/fp8_linear.py, more rows W8A8 through "
            "torch._scaled_mm with row-wise scales, activations scaled per token"
        )
    if isinstance(qkv, Int4Linear):
        if kernels:
            return "int4 W4A16: Triton kernels/int4_linear.py (skinny 1-16 rows, tiled past)"
        return "int4 W4A16: torch reference (weight dequantized, then one fp32 matmul, per call)"
    if model.device.type == "cuda":
        return "dense: skinny linear kernel for 1-16 rows where tuned, torch GEMM otherwise"
    return "dense: torch GEMM"


def build(spec: dict, result: dict):
    from hipfire_serve import SamplingParams
    from loadtests.lab.peer.hipfire_child import build as build_hipfire

    kind = LAYOUT_KINDS[spec["format"]]
    layout = None
    if kind is not None:
        layout = Layout(kind, spec["group_size"], tuple(spec["fp8_block"]))
        install_layout(layout)
    backend, vocab = build_hipfire(spec, result)
    if layout is not None and not ENCODED:
        raise RuntimeError("the engine built its target without install_layout's builder")
    target = backend.engine.target
    fp8_dequantized = kind == "fp8" and not target.quantized
    result["format"] = {
        "name": spec["format"],
        "layout": layout.config() if layout else None,
        "linear_path": linear_path(target)
        + ("; FP8 weights dequantized at load (the CPU path)" if fp8_dequantized else ""),
        "weight_bytes": step_weight_bytes(target),
        "dtype": str(target.dtype).removeprefix("torch."),
    }
    cfg = PeerConfig.from_json(spec["config"])
    agree = spec["agreement"]
    prompts = wave_prompts(cfg, agree["prompts"], vocab, seed_offset=AGREEMENT_SEED_OFFSET)
    params = SamplingParams(max_tokens=agree["tokens"], ignore_eos=True, temperature=0.0)
    outs = backend.llm.generate(prompts, params)
    result["greedy_tokens"] = [list(o.outputs[0].token_ids) for o in outs]
    return backend, vocab


if __name__ == "__main__":
    name = json.loads(Path(sys.argv[1]).read_text())["format"]
    sys.exit(child_main(name, build))
