"""`hipfire-serve` console script: dispatches to the subcommand's own `main(argv)`."""

from __future__ import annotations

import importlib
import sys

# subcommand -> (module, function, one-line help). Modules are imported lazily so that
# `hipfire-serve simulate` never imports torch.
SUBCOMMANDS: dict[str, tuple[str, str, str]] = {
    "serve": ("hipfire_serve.server.main", "main", "start the OpenAI-compatible server"),
    "simulate": ("scheduler.sim.cli", "main", "run the scheduler simulator on a cost profile"),
    "profile": (
        "hipfire_serve.cost_profile.cli",
        "main",
        "measure the round-time cost profile on a device",
    ),
    "hash-key": ("hipfire_serve.server.tenants", "hash_key_main", "print sha256 of an API key"),
}


def run_subcommand(
    prog: str, subcommands: dict[str, tuple[str, str, str]], argv: list[str] | None
) -> int:
    """Runs `subcommands[argv[0]]` (module, function, help) with the rest of `argv`; the
    module is imported only then. Usage on no command or --help; exit 2 on an unknown one."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        width = max(len(name) for name in subcommands) + 2
        lines = [f"usage: {prog} <command> [options]", "", "commands:"]
        lines += [f"  {name:<{width}}{help_}" for name, (_, _, help_) in subcommands.items()]
        print("\n".join(lines))
        return 0
    name, rest = argv[0], argv[1:]
    if name not in subcommands:
        print(f"{prog}: unknown command {name!r} (try --help)", file=sys.stderr)
        return 2
    module_name, func_name, _ = subcommands[name]
    func = getattr(importlib.import_module(module_name), func_name)
    return int(func(rest) or 0)


def main(argv: list[str] | None = None) -> int:
    return run_subcommand("hipfire-serve", SUBCOMMANDS, argv)


if __name__ == "__main__":
    sys.exit(main())
