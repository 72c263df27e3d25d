"""Finding a GGUF file and reading its metadata (torch-free: the tokenizer reads it too)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from executor.model_config import ModelLoadError


def find_gguf_file(path: Path | str) -> Path | None:
    """The GGUF file a model path names: the path itself when it ends in `.gguf`, or the one
    `.gguf` file of a directory without a config.json (an HF directory stays HF); None
    otherwise. Several candidates in one directory are refused: the path must name one."""
    path = Path(path)
    if path.suffix == ".gguf":
        if not path.is_file():
            raise ModelLoadError(f"GGUF file not found: {path}")
        return path
    if not path.is_dir() or (path / "config.json").is_file():
        return None
    files = sorted(path.glob("*.gguf"))
    if len(files) > 1:
        names = ", ".join(f.name for f in files[:4])
        raise ModelLoadError(f"{path} holds several .gguf files ({names}): name one of them")
    return files[0] if files else None


class GGUFMetadata:
    """A GGUF file's key/value metadata and its tensors (memory-mapped by `gguf.GGUFReader`)."""

    def __init__(self, path: Path):
        try:
            from gguf import GGUFReader
        except ImportError:
            raise ModelLoadError("reading GGUF files needs the `gguf` package") from None
        try:
            self.reader = GGUFReader(str(path))
        except Exception as e:  # a truncated or foreign file: one line, not a numpy trace
            raise ModelLoadError(f"{path.name} is not a readable GGUF file: {e}") from None
        self.path = path
        if int(self.get("split.count", 1) or 1) > 1:
            raise ModelLoadError(
                f"{path.name} is one part of a split GGUF; merge the parts into one file "
                "(llama-gguf-split --merge)"
            )

    def get(self, key: str, default: Any = None) -> Any:
        field = self.reader.get_field(key)
        return default if field is None else field.contents()

    @property
    def arch(self) -> str:
        return str(self.get("general.architecture", ""))

    def arch_get(self, key: str, default: Any = None) -> Any:
        """`<architecture>.<key>`, as GGUF names the model's hyperparameters."""
        return self.get(f"{self.arch}.{key}", default)
