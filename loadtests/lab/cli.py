"""`hipfire-bench`: one entry point for the lab's benchmarks, each a subcommand with its own
flags (`hipfire-bench <command> --help`)."""

from __future__ import annotations

import importlib
import sys

# subcommand -> (module, one-line help). Modules load lazily: a CPU-only benchmark never
# imports the GPU ones' dependencies.
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "gpu": ("loadtests.lab.gpu.main", "end-to-end engine benchmark: policies vs the roofline"),
    "rederive": ("loadtests.lab.gpu.rederive", "re-derive or pool `gpu` records"),
    "replay": ("loadtests.lab.policy_replay", "engine decisions vs the simulator's (CPU)"),
    "executor": ("loadtests.lab.executor_bench", "round time vs roofline, engine-loop GPU idle"),
    "server": ("loadtests.lab.server_bench", "engine rounds/s with the HTTP server vs without"),
    "kernels": ("loadtests.lab.kernels.attention", "verify attention and the small kernels"),
    "kernels-compile": ("loadtests.lab.kernels.compile", "compile the kernel sweep's variants"),
    "linear": ("loadtests.lab.kernels.linear", "skinny linear layer vs cuBLAS, config sweep"),
    "pdl": ("loadtests.lab.kernels.pdl", "programmatic dependent launch on graphed decode"),
}


def _usage() -> str:
    lines = ["usage: hipfire-bench <command> [options]", "", "commands:"]
    lines += [f"  {name:<16} {help_}" for name, (_, help_) in SUBCOMMANDS.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0
    name, rest = argv[0], argv[1:]
    if name not in SUBCOMMANDS:
        print(f"hipfire-bench: unknown command {name!r} (try --help)", file=sys.stderr)
        return 2
    module = importlib.import_module(SUBCOMMANDS[name][0])
    return int(module.main(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
