"""A small parser for the Prometheus text exposition format (version 0.0.4).

Only samples are kept: `name{label="value",...} value [timestamp]`. HELP and TYPE comments are
skipped; label values may contain escaped quotes, backslashes and newlines.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

Labels = tuple[tuple[str, str], ...]  # sorted (name, value) pairs


@dataclass(frozen=True)
class Sample:
    name: str
    labels: Labels
    value: float

    def label(self, key: str, default: str = "") -> str:
        return dict(self.labels).get(key, default)


def parse(text: str) -> list[Sample]:
    samples: list[Sample] = []
    for lineno, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        try:
            samples.append(_parse_line(line))
        except ValueError as exc:
            raise ValueError(f"metrics line {lineno}: {exc}: {raw[:120]!r}") from None
    return samples


def _parse_line(line: str) -> Sample:
    brace = line.find("{")
    space = line.find(" ")
    if brace != -1 and (space == -1 or brace < space):
        name = line[:brace]
        labels, rest = _parse_labels(line, brace + 1)
    else:
        if space == -1:
            raise ValueError("no value")
        name, rest = line[:space], line[space:]
        labels = ()
    fields = rest.split()
    if not fields or not name:
        raise ValueError("no value")
    return Sample(name, labels, _parse_value(fields[0]))


def _parse_value(text: str) -> float:
    special = {"+Inf": math.inf, "-Inf": -math.inf, "NaN": math.nan}
    return special[text] if text in special else float(text)


def _parse_labels(line: str, pos: int) -> tuple[Labels, str]:
    labels: list[tuple[str, str]] = []
    while True:
        while pos < len(line) and line[pos] in " ,":
            pos += 1
        if pos >= len(line):
            raise ValueError("unterminated label set")
        if line[pos] == "}":
            return tuple(sorted(labels)), line[pos + 1 :]
        eq = line.find("=", pos)
        if eq == -1 or eq + 1 >= len(line) or line[eq + 1] != '"':
            raise ValueError("bad label")
        key = line[pos:eq].strip()
        pos = eq + 2
        value: list[str] = []
        while True:
            if pos >= len(line):
                raise ValueError("unterminated label value")
            ch = line[pos]
            if ch == "\\" and pos + 1 < len(line):
                nxt = line[pos + 1]
                value.append({"n": "\n", "\\": "\\", '"': '"'}.get(nxt, "\\" + nxt))
                pos += 2
            elif ch == '"':
                pos += 1
                break
            else:
                value.append(ch)
                pos += 1
        labels.append((key, "".join(value)))


class Snapshot:
    """Samples of one scrape, indexed by metric name."""

    def __init__(self, samples: list[Sample]) -> None:
        self.by_name: dict[str, list[Sample]] = {}
        for s in samples:
            self.by_name.setdefault(s.name, []).append(s)

    @classmethod
    def from_text(cls, text: str) -> Snapshot:
        return cls(parse(text))

    def has(self, name: str) -> bool:
        return name in self.by_name

    def total(self, name: str, **match: str) -> float:
        """Sum of the samples of `name` whose labels include `match` (0 when absent)."""
        return sum(
            s.value
            for s in self.by_name.get(name, [])
            if all(s.label(k) == v for k, v in match.items())
        )

    def by_label(self, name: str, key: str) -> dict[str, float]:
        """Sum of `name` grouped by the value of label `key`."""
        out: dict[str, float] = {}
        for s in self.by_name.get(name, []):
            out[s.label(key)] = out.get(s.label(key), 0.0) + s.value
        return out
