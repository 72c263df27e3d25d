"""Server configuration and the `hipfire-serve serve` command line.

Flags are generated from the fields of two dataclasses, `EngineConfig` (the engine's) and
`ServerConfig` (below): `max_concurrency` becomes `--max-concurrency`, the field's
`metadata["help"]` its help text, `metadata["choices"]` its allowed values.

Every setting can come from four places; a later one wins:

    1. the field's default
    2. the TOML file given with `--config FILE` (flat keys, `max_concurrency = 32` or
       `max-concurrency = 32`; optional `[engine]` and `[server]` tables are merged in)
    3. environment variables `HIPFIRE_<FIELD>` (e.g. `HIPFIRE_MAX_CONCURRENCY=32`)
    4. command-line flags
"""

from __future__ import annotations

import argparse
import dataclasses
import ipaddress
import os
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hipfire_serve.config import EngineConfig, config_fields
from hipfire_serve.server.tool_parsers import tool_parser_names

ENV_PREFIX = "HIPFIRE_"


def _f(default, help_: str, *, in_repr: bool = True, **extra):
    return field(default=default, repr=in_repr, metadata={"help": help_, **extra})


@dataclass(frozen=True, kw_only=True)
class ServerConfig:
    host: str = _f("127.0.0.1", "address to listen on (0.0.0.0 exposes the server to the network)")
    port: int = _f(8000, "TCP port to listen on")
    served_model_name: str = _f("", "model name in the API (default: the model's directory name)")
    tenants: str = _f(
        "", "tenants TOML file (API keys, weights, rate limits); without one the server is open"
    )
    log_level: str = _f(
        "info", "log level", choices=("critical", "error", "warning", "info", "debug")
    )
    metrics_compat: str = _f(
        "none", "also export metrics under vLLM's names", choices=("none", "vllm")
    )
    metrics_tenant_labels: bool = _f(
        False,
        "label per-request metrics with the tenant's name; /metrics takes no API key, so anyone "
        "who can reach it then sees every tenant's name and traffic",
    )
    request_timeout: float = _f(
        600.0,
        "seconds from a request's arrival (waiting for the engine to take it included) after "
        "which it is aborted with 504 (0: never)",
    )
    drain_timeout: float = _f(
        30.0, "on SIGTERM/SIGINT: seconds to finish in-flight requests before aborting them"
    )
    max_body_bytes: int = _f(4 << 20, "largest request body accepted (bytes)")
    stream_interval: int = _f(
        1,
        "engine rounds between writes to one SSE stream (1: every round; more trades token "
        "latency for fewer writes and client wake-ups per token)",
    )
    engine_loop: str = _f(
        "thread",
        "where the engine runs: a thread of the server process, or a child process "
        "(no GIL shared with HTTP handling; outputs cross a pipe)",
        choices=("thread", "process"),
    )
    retry_after: int = _f(
        1, "seconds put in Retry-After with a 503 (queue full, draining, engine down)"
    )
    engine_stall_timeout: float = _f(
        30.0,
        "seconds without an engine round, while requests wait on the engine, after which the "
        "engine counts as stalled and is failed like a dead one (0: never)",
    )
    engine_restarts: int = _f(
        3,
        "process loop: restarts of a dead or stalled engine allowed within 10 minutes; past "
        "them (and always with the thread loop) the server exits with status 1",
    )
    # repr=False: a logged or printed config never shows the keys
    api_key: tuple[str, ...] = _f(
        (),
        in_repr=False,
        help_="API key(s) every route but /health, /metrics and /version requires as "
        "'Authorization: Bearer KEY' (vLLM's flag; several may follow it). With --tenants they "
        "belong to the tenant 'default' (the file's, or one without limits). The environment "
        "variable takes a comma-separated list and keeps the keys out of the process list",
    )
    chat_template: str = _f(
        "",
        "chat template for the chat API and /tokenize: a Jinja file, or the template itself "
        "inline (escapes such as \\n read as in Python); default: the model's",
    )
    generation_config: str = _f(
        "auto",
        "default sampling parameters of requests that leave them out (temperature, top_p, "
        "top_k, min_p, repetition_penalty; max_new_tokens caps max_tokens), as vLLM reads "
        "them: 'auto' from the model's generation_config.json, 'vllm' none, or a folder "
        "holding a generation_config.json",
    )
    tool_call_parser: str = _f(
        "auto",
        "format of the tool calls in the model's text, read for tool_choice auto (vLLM's "
        "flag): hermes (<tool_call>{json}</tool_call>, Qwen and Hermes models); auto: hermes "
        "for the demo model (auto tool choice on), none for other models",
        choices=("auto", "none", *tool_parser_names()),
    )
    enable_auto_tool_choice: bool = _f(
        False,
        "serve tool_choice auto, the default of requests with tools, where the model decides "
        "whether to call (vLLM's flag; needs --tool-call-parser). Without it such requests get "
        "a 400, while tool_choice required and named functions are served through a grammar",
    )
    exclude_tools_when_tool_choice_none: bool = _f(
        False, "leave the tools out of the chat template's input under tool_choice none"
    )

    def validate(self) -> None:
        """Raises ValueError with a one-line reason for a bad setting."""
        if not 0 <= self.port <= 65535:
            raise ValueError(f"--port must be in [0, 65535], got {self.port}")
        try:
            ipaddress.ip_address(self.host)
        except ValueError:
            if not self.host or any(c.isspace() for c in self.host):
                raise ValueError(
                    f"--host must be an address or host name, got {self.host!r}"
                ) from None
        if self.request_timeout < 0:
            raise ValueError(f"--request-timeout must be >= 0, got {self.request_timeout}")
        if self.drain_timeout < 0:
            raise ValueError(f"--drain-timeout must be >= 0, got {self.drain_timeout}")
        if self.max_body_bytes < 1024:
            raise ValueError(f"--max-body-bytes must be >= 1024, got {self.max_body_bytes}")
        if self.stream_interval < 1:
            raise ValueError(f"--stream-interval must be >= 1, got {self.stream_interval}")
        if self.retry_after < 1:
            raise ValueError(f"--retry-after must be >= 1, got {self.retry_after}")
        if self.engine_stall_timeout < 0:
            raise ValueError(
                f"--engine-stall-timeout must be >= 0, got {self.engine_stall_timeout}"
            )
        if self.engine_restarts < 0:
            raise ValueError(f"--engine-restarts must be >= 0, got {self.engine_restarts}")
        if self.tenants and not Path(self.tenants).is_file():
            raise ValueError(f"--tenants {self.tenants}: no such file")
        if any(not key or any(c.isspace() for c in key) for key in self.api_key):
            raise ValueError("--api-key: a key must be non-empty and hold no whitespace")
        if self.enable_auto_tool_choice and self.tool_call_parser == "none":
            raise ValueError("--enable-auto-tool-choice needs a --tool-call-parser other than none")
        if self.generation_config not in ("auto", "vllm"):
            folder = Path(self.generation_config)
            if not (folder / "generation_config.json").is_file():
                raise ValueError(
                    f"--generation-config {folder}: no generation_config.json there "
                    "(give 'auto', 'vllm' or a folder holding one)"
                )


CONFIG_CLASSES = (EngineConfig, ServerConfig)


def _all_fields() -> dict[str, dataclasses.Field]:
    out: dict[str, dataclasses.Field] = {}
    for cls in CONFIG_CLASSES:
        for f in config_fields(cls):
            out[f.name] = f
    return out


def _type_name(f: dataclasses.Field) -> str:
    # `from __future__ import annotations` leaves the annotations as strings.
    return f.type if isinstance(f.type, str) else f.type.__name__


def _coerce(f: dataclasses.Field, value: Any, source: str) -> Any:
    """A TOML or environment value as the field's type; ValueError naming the source."""
    type_name = _type_name(f)
    try:
        if type_name.startswith("tuple"):
            # a TOML list or string; an environment value lists its items with commas
            items = value.split(",") if isinstance(value, str) else value
            if not isinstance(items, list) or not all(isinstance(i, str) for i in items):
                raise ValueError
            return tuple(i.strip() for i in items if i.strip())
        if type_name == "bool":
            if isinstance(value, bool):
                return value
            text = str(value).strip().lower()
            if text in ("1", "true", "yes", "on"):
                return True
            if text in ("0", "false", "no", "off"):
                return False
            raise ValueError
        if type_name == "int":
            if isinstance(value, bool | float):
                raise ValueError
            return int(value)
        if type_name == "float":
            if isinstance(value, bool):
                raise ValueError
            return float(value)
        if isinstance(value, bool | int | float) and not isinstance(value, str):
            return str(value)
        if not isinstance(value, str):
            raise ValueError
        return value
    except ValueError:
        raise ValueError(f"{source}: expected {type_name}, got {value!r}") from None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hipfire-serve serve",
        description="Start the OpenAI-compatible server. Settings come from defaults, then "
        "--config FILE (TOML), then HIPFIRE_<FIELD> environment variables, then flags; "
        "a later source wins.",
    )
    parser.add_argument(
        "--config", default=argparse.SUPPRESS, metavar="FILE", help="TOML file with settings"
    )
    parser.add_argument(
        "model_tag",
        nargs="?",
        default=argparse.SUPPRESS,
        metavar="MODEL",
        help="model directory, as `vllm serve MODEL` takes it: the same as --model (put it "
        "first: a flag taking several values, such as --api-key, would take it too)",
    )
    for cls in CONFIG_CLASSES:
        group = parser.add_argument_group(f"{cls.__name__} options")
        for f in config_fields(cls):
            flag = "--" + f.name.replace("_", "-")
            help_ = f.metadata.get("help", "")
            choices = f.metadata.get("choices")
            kwargs: dict[str, Any] = {"default": argparse.SUPPRESS, "dest": f.name}
            type_name = _type_name(f)
            if type_name == "bool":
                kwargs["action"] = argparse.BooleanOptionalAction
            elif type_name.startswith("tuple"):
                kwargs.update(nargs="+", action="extend", metavar=f.name.upper())
            else:
                kwargs["type"] = {"int": int, "float": float}.get(type_name, str)
                kwargs["metavar"] = f.name.upper() if not choices else None
                if choices:
                    kwargs["choices"] = choices
            default = f.default
            kwargs["help"] = f"{help_} (default: {default!r}; env {ENV_PREFIX}{f.name.upper()})"
            group.add_argument(flag, **kwargs)
    return parser


def _toml_settings(path: str) -> dict[str, Any]:
    try:
        doc = tomllib.loads(Path(path).read_text())
    except OSError as exc:
        raise ValueError(f"--config {path}: cannot read ({exc.strerror})") from None
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"--config {path}: not valid TOML ({exc})") from None
    flat: dict[str, Any] = {}
    for key, value in doc.items():
        if key in ("engine", "server") and isinstance(value, dict):
            flat.update({k.replace("-", "_"): v for k, v in value.items()})
        else:
            flat[key.replace("-", "_")] = value
    return flat


def resolve(
    argv: list[str], environ: Mapping[str, str] | None = None
) -> tuple[EngineConfig, ServerConfig]:
    """Command line + environment + TOML file -> validated configs (precedence in the module
    doc). Raises ValueError with a one-line reason; argparse exits on malformed flags."""
    environ = os.environ if environ is None else environ
    fields = _all_fields()
    args = vars(build_parser().parse_args(argv))
    model_tag = args.pop("model_tag", None)
    if model_tag is not None and args.setdefault("model", model_tag) != model_tag:
        raise ValueError(
            f"the model is given twice ({model_tag!r} and --model {args['model']!r}): give one"
        )
    args = {k: tuple(v) if isinstance(v, list) else v for k, v in args.items()}
    config_path = args.pop("config", None) or environ.get(ENV_PREFIX + "CONFIG")
    settings: dict[str, Any] = {}
    if config_path:
        for key, value in _toml_settings(config_path).items():
            if key not in fields:
                raise ValueError(f"--config {config_path}: unknown setting {key!r}")
            settings[key] = _coerce(fields[key], value, f"--config {config_path}: {key}")
    for name, f in fields.items():
        env_name = ENV_PREFIX + name.upper()
        if env_name in environ:
            settings[name] = _coerce(f, environ[env_name], env_name)
    settings.update(args)
    for name, value in settings.items():
        choices = fields[name].metadata.get("choices")
        if choices and value not in choices:
            flag = "--" + name.replace("_", "-")
            raise ValueError(f"{flag} must be one of {', '.join(choices)}, got {value!r}")
    engine_names = {f.name for f in config_fields(EngineConfig)}
    engine_config = EngineConfig(**{k: v for k, v in settings.items() if k in engine_names})
    server_config = ServerConfig(**{k: v for k, v in settings.items() if k not in engine_names})
    engine_config.validate()
    server_config.validate()
    return engine_config, server_config
