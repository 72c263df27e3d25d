"""The two command lines, `hipfire-serve` (the product) and `hipfire-bench` (the lab): every
subcommand names a function that exists, and usage errors are one line with exit code 2."""

from __future__ import annotations

import importlib

import pytest

from hipfire_serve import cli as serve_cli
from loadtests.lab import cli as bench_cli

COMMANDS = [(serve_cli, name) for name in serve_cli.SUBCOMMANDS]
COMMANDS += [(bench_cli, name) for name in bench_cli.SUBCOMMANDS]


@pytest.mark.parametrize(("cli", "name"), COMMANDS, ids=lambda x: getattr(x, "__name__", x))
def test_every_subcommand_names_a_function(cli, name):
    module_name, func_name, help_ = cli.SUBCOMMANDS[name]
    assert callable(getattr(importlib.import_module(module_name), func_name))
    assert help_


def test_the_product_command_line_runs_no_lab_command():
    modules = {module for module, _, _ in serve_cli.SUBCOMMANDS.values()}
    assert not any(m.startswith("loadtests") for m in modules), modules


@pytest.mark.parametrize("cli", [serve_cli, bench_cli], ids=["hipfire-serve", "hipfire-bench"])
def test_usage_and_unknown_commands(cli, capsys):
    assert cli.main(["--help"]) == 0
    listed = capsys.readouterr().out
    assert all(name in listed for name in cli.SUBCOMMANDS)
    assert cli.main(["no-such-command"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "no-such-command" in err
