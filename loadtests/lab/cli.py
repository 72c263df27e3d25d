"""`hipfire-bench`: one entry point for the lab's benchmarks, each a subcommand with its own
flags (`hipfire-bench <command> --help`)."""

from __future__ import annotations

import sys

from hipfire_serve.cli import run_subcommand

# subcommand -> (module, function, one-line help). Modules load lazily: a CPU-only benchmark
# never imports the GPU ones' dependencies.
SUBCOMMANDS: dict[str, tuple[str, str, str]] = {
    "gpu": (
        "loadtests.lab.gpu.main",
        "main",
        "end-to-end engine benchmark: policies vs the roofline",
    ),
    "rederive": ("loadtests.lab.gpu.rederive", "main", "re-derive or pool `gpu` records"),
    "replay": ("loadtests.lab.policy_replay", "main", "engine decisions vs the simulator's (CPU)"),
    "prefix-cache": ("loadtests.lab.prefix_cache_bench", "main", "TTFT, prefix cache on vs off"),
    "rerank": (
        "loadtests.lab.rerank_eval",
        "main",
        "block-drafter re-ranker: own-start walk, off vs on (CPU)",
    ),
    "demo-drafters": (
        "loadtests.lab.demo_drafters",
        "main",
        "drafters on the demo target: tokens/s and acceptance length vs AR and the chain",
    ),
    "coupling": (
        "loadtests.lab.coupled_acceptance",
        "main",
        "sampled-draft acceptance: rejection sampling vs coupled draws (CPU)",
    ),
    "executor": (
        "loadtests.lab.executor_bench",
        "main",
        "round time vs roofline, engine-loop GPU idle",
    ),
    "server": (
        "loadtests.lab.server_bench",
        "main",
        "engine rounds/s with the HTTP server vs without",
    ),
    "host-cost": (
        "loadtests.lab.host_cost",
        "main",
        "host cost per output token on a CPU: engine in-process and HTTP, round phases",
    ),
    "kernels": (
        "loadtests.lab.kernels.attention",
        "main",
        "verify attention and the small kernels",
    ),
    "kernels-compile": (
        "loadtests.lab.kernels.compile",
        "main",
        "compile the kernel sweep's variants",
    ),
    "linear": (
        "loadtests.lab.kernels.linear",
        "main",
        "skinny linear layer vs cuBLAS, config sweep",
    ),
    "peer-vllm": ("loadtests.lab.peer.main", "main", "side by side with vLLM: same shape, prompts"),
    "quant": (
        "loadtests.lab.quant_bench",
        "main",
        "decoding in bf16, FP8 and W4A16 against each format's roofline (AR or adaptive)",
    ),
    "quant-agreement": (
        "loadtests.lab.quant_agreement",
        "main",
        "greedy agreement of FP8 and W4A16 weights with bf16 (the demo target, CPU)",
    ),
    "quant-linear": (
        "loadtests.lab.kernels.quant_linear",
        "main",
        "FP8 and int4 skinny kernels vs bf16 cuBLAS, tile sweep",
    ),
    "pdl": ("loadtests.lab.kernels.pdl", "main", "programmatic dependent launch on graphed decode"),
    "phase-profile": ("loadtests.lab.phase_profile", "main", "decode step device time by phase"),
}


def main(argv: list[str] | None = None) -> int:
    return run_subcommand("hipfire-bench", SUBCOMMANDS, argv)


if __name__ == "__main__":
    sys.exit(main())
