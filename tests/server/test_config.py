"""CLI flags generated from the config dataclasses; TOML < environment < flags."""

from __future__ import annotations

import subprocess
import sys

import pytest

from hipfire_serve.config import EngineConfig, config_fields
from hipfire_serve.server.config import ServerConfig, build_parser, resolve
from hipfire_serve.server.tenants import hash_key, hash_key_main


def test_every_field_is_a_flag_with_its_help():
    help_text = build_parser().format_help()
    for cls in (EngineConfig, ServerConfig):
        for f in config_fields(cls):
            flag = "--" + f.name.replace("_", "-")
            assert flag in help_text, flag
            first_words = " ".join(f.metadata["help"].split()[:2])
            assert first_words in " ".join(help_text.split()), f.name
    for required in (
        "--model",
        "--draft",
        "--spec-mode",
        "--spec-depth",
        "--max-concurrency",
        "--max-queue",
        "--max-model-len",
        "--kv-cache-memory",
        "--dtype",
        "--device",
        "--host",
        "--port",
        "--tenants",
        "--served-model-name",
        "--log-level",
        "--metrics-compat",
    ):
        assert required in help_text


def test_defaults():
    engine, server = resolve([], environ={})
    assert engine == EngineConfig()
    assert server == ServerConfig()
    assert server.host == "127.0.0.1"
    assert engine.model == "demo"


def test_precedence_toml_then_env_then_flags(tmp_path):
    toml = tmp_path / "serve.toml"
    toml.write_text(
        'max-concurrency = 5\nport = 9001\nspec_depth = 3\n[server]\nlog_level = "debug"\n'
    )
    env = {"HIPFIRE_PORT": "9002", "HIPFIRE_SPEC_DEPTH": "6"}
    engine, server = resolve(["--config", str(toml), "--spec-depth", "7"], environ=env)
    assert engine.max_concurrency == 5  # TOML only
    assert server.log_level == "debug"  # TOML table
    assert server.port == 9002  # env beats TOML
    assert engine.spec_depth == 7  # flag beats env
    engine, _ = resolve([], environ={"HIPFIRE_CONFIG": str(toml)})
    assert engine.max_concurrency == 5


def test_bool_and_float_coercion_from_env():
    engine, server = resolve(
        [], environ={"HIPFIRE_ALLOW_SYNTHETIC_DRAFT": "yes", "HIPFIRE_REQUEST_TIMEOUT": "2.5"}
    )
    assert engine.allow_synthetic_draft is True
    assert server.request_timeout == 2.5


@pytest.mark.parametrize(
    ("argv", "environ", "reason"),
    [
        (["--spec-mode", "spec", "--draft", "none"], {}, "needs a drafter"),
        (["--port", "70000"], {}, "--port"),
        (["--request-timeout", "-1"], {}, "--request-timeout"),
        (["--tenants", "/nonexistent/tenants.toml"], {}, "no such file"),
        ([], {"HIPFIRE_MAX_CONCURRENCY": "many"}, "HIPFIRE_MAX_CONCURRENCY"),
        ([], {"HIPFIRE_SPEC_MODE": "sometimes"}, "--spec-mode must be one of"),
        (["--max-body-bytes", "10"], {}, "--max-body-bytes"),
    ],
)
def test_bad_settings_give_one_line_reasons(argv, environ, reason):
    with pytest.raises(ValueError, match=reason) as info:
        resolve(argv, environ=environ)
    assert "\n" not in str(info.value)


def test_a_config_built_in_code_is_checked_against_the_choices_too():
    from hipfire_serve.config import EngineConfig

    EngineConfig(drafter_follows_prefill="auto").validate()
    with pytest.raises(ValueError, match="--drafter-follows-prefill must be one of off, on, auto"):
        EngineConfig(drafter_follows_prefill="yes").validate()


def test_unknown_toml_key_is_refused(tmp_path):
    toml = tmp_path / "serve.toml"
    toml.write_text("max_concurency = 5\n")
    with pytest.raises(ValueError, match="unknown setting 'max_concurency'"):
        resolve(["--config", str(toml)], environ={})


def test_serve_refuses_bad_combination_with_one_line(tmp_path):
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "hipfire_serve.cli",
            "serve",
            "--spec-mode",
            "spec",
            "--draft",
            "none",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0
    assert "needs a drafter" in proc.stderr


def test_hash_key_subcommand(capsys, monkeypatch):
    assert hash_key_main(["secret"]) == 0
    assert capsys.readouterr().out.strip() == hash_key("secret")
    monkeypatch.setattr("sys.stdin", __import__("io").StringIO("from-stdin\n"))
    assert hash_key_main([]) == 0
    assert capsys.readouterr().out.strip() == hash_key("from-stdin")
    assert hash_key_main(["a", "b"]) == 2


def test_serve_refuses_a_bad_tenants_file(tmp_path):
    tenants = tmp_path / "tenants.toml"
    tenants.write_text('[[tenants]]\nname = "acme"\napi_key_sha256 = ["not-a-digest"]\n')
    proc = subprocess.run(
        [sys.executable, "-m", "hipfire_serve.cli", "serve", "--tenants", str(tenants)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0
    assert "tenants[0] (acme)" in proc.stderr and "64 hex digits" in proc.stderr
