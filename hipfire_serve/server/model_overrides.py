"""What the operator's flags change about the served model's defaults, as vLLM's flags do.

- `--chat-template`: a Jinja file, or the template itself inline, replaces the model's.
- `--generation-config`: default sampling parameters from a `generation_config.json` (the
  model's with `auto`, a folder's, or none with `vllm`) for requests that leave them out.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jinja2

from hipfire_serve.config import EngineConfig
from hipfire_serve.tokenizer import compile_chat_template
from hipfire_serve.types import SamplingParams

# generation_config.json keys that become request defaults (max_new_tokens caps max_tokens),
# with Hugging Face GenerationConfig's own defaults: vLLM reads the file's difference from
# those, so e.g. a top_k of 50 (the library default) sets nothing.
GENERATION_KEYS = {
    "temperature": 1.0,
    "top_p": 1.0,
    "top_k": 50,
    "min_p": None,
    "repetition_penalty": 1.0,
    "max_new_tokens": None,
}


def load_chat_template(value: str) -> str | None:
    """The template a `--chat-template` value names: the file's text, or the value itself when
    it reads as a template (has `{`, `}` or a newline) rather than a path; None for ''.
    ValueError when there is no such file or the template does not compile."""
    if not value:
        return None
    path = Path(value)
    try:
        source = path.read_text(encoding="utf-8") if path.is_file() else None
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"--chat-template {value}: cannot read ({exc})") from None
    if source is None:
        if not any(c in value for c in "{}\n"):
            raise ValueError(f"--chat-template {value}: no such file (nor a Jinja template)")
        # A single-line form writes newlines as \n, as vLLM reads it; other characters stay.
        source = value.encode("latin-1", "backslashreplace").decode("unicode_escape")
    try:
        compile_chat_template(source)
    except jinja2.TemplateSyntaxError as exc:
        raise ValueError(f"--chat-template: the template does not compile: {exc}") from None
    return source


def model_dir(config: EngineConfig) -> Path | None:
    """The served model's directory (None for random weights)."""
    if config.model == "demo":
        from hipfire_serve.demo import demo_model_dir

        return demo_model_dir()
    return None if config.model.startswith("random:") else Path(config.model)


def generation_defaults(setting: str, directory: Path | None) -> dict[str, Any]:
    """`--generation-config` as SamplingParams field defaults (`max_tokens` a cap). `auto`
    without a generation_config.json means none. ValueError on values a request could not
    take."""
    if setting == "vllm":
        return {}
    if setting != "auto":
        directory = Path(setting)
    file = None if directory is None else directory / "generation_config.json"
    if file is None or not file.is_file():
        if setting == "auto":
            return {}
        raise ValueError(f"--generation-config {setting}: no generation_config.json there")
    try:
        raw = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"--generation-config: {file} is not readable JSON ({exc})") from None
    if not isinstance(raw, dict):
        raise ValueError(f"--generation-config: {file} must hold a JSON object")
    defaults = {
        ("max_tokens" if key == "max_new_tokens" else key): raw[key]
        for key, library_default in GENERATION_KEYS.items()
        if raw.get(key) is not None and raw[key] != library_default
    }
    for key, value in defaults.items():
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ValueError(f"--generation-config: {file}: {key} must be a number, got {value!r}")
        if key in ("top_k", "max_tokens") and value != int(value):
            raise ValueError(f"--generation-config: {file}: {key} must be an integer")
    defaults = {
        k: int(v) if k in ("top_k", "max_tokens") else float(v) for k, v in defaults.items()
    }
    try:
        SamplingParams(**defaults).validate()
    except ValueError as exc:
        raise ValueError(f"--generation-config: {file}: {exc}") from None
    return defaults
