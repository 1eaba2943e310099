"""The built-in sample corpus: English documentation text that ships with Python, no download needed.

    prep sample-corpus --out corpus/            # -> corpus/sample.jsonl

Documents, in a fixed order: each `pydoc_data.topics` entry (the language reference behind `help()`), then,
for every standard-library module (sorted by path), its module, class and function docstrings joined into one
document. Sources are parsed with `ast` only; nothing is imported or executed.
"""

from __future__ import annotations

import ast
import json
import os
import sysconfig
import warnings
from pathlib import Path
from typing import Iterator

from pipeline.common import UserError, atomic_write_bytes

SAMPLE_FILE = "sample.jsonl"
SKIPPED_DIRS = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__", "lib2to3"}


def _pydoc_topics() -> Iterator[str]:
    # Read the data file as text and evaluate its one literal, so nothing is imported.
    import importlib.util

    spec = importlib.util.find_spec("pydoc_data.topics")
    if spec is None or spec.origin is None:
        return
    tree = ast.parse(Path(spec.origin).read_text(encoding="utf-8"))
    for node in tree.body:
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", None) == "topics":
            topics = ast.literal_eval(node.value)
            for name in sorted(topics):
                yield topics[name]


def _stdlib_sources() -> Iterator[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in SKIPPED_DIRS and not d.startswith("."))
        for name in sorted(filenames):
            if name.endswith(".py"):
                yield Path(dirpath) / name


def _module_docstrings(path: Path) -> str:
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            tree = ast.parse(path.read_bytes(), filename=str(path))
    except (SyntaxError, ValueError, OSError):
        return ""
    nodes = [tree] + [n for n in ast.walk(tree) if isinstance(n, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))]
    docs = [doc for node in nodes if (doc := ast.get_docstring(node, clean=True))]
    return "\n\n".join(docs)


def sample_documents() -> Iterator[str]:
    """The sample corpus as a stream of non-empty documents, always in the same order."""
    yield from (t for t in _pydoc_topics() if t.strip())
    for path in _stdlib_sources():
        text = _module_docstrings(path)
        if text.strip():
            yield text


def write_sample_corpus(out_dir: str | Path, max_bytes: int | None = None) -> tuple[Path, int, int]:
    """Write DIR/sample.jsonl ({"text": ...} per line), stopping before `max_bytes`; -> (path, documents, bytes).
    A DIR/sample.jsonl with these bytes already is left alone; one with other bytes
    (another --max-bytes, or a file of the user's) is refused with a `UserError`, never replaced."""
    lines: list[bytes] = []
    total = 0
    for text in sample_documents():
        line = (json.dumps({"text": text}, ensure_ascii=False) + "\n").encode("utf-8")
        if max_bytes is not None and total + len(line) > max_bytes:
            if not lines:
                continue
            break
        lines.append(line)
        total += len(line)
    path = Path(out_dir) / SAMPLE_FILE
    data = b"".join(lines)
    if path.is_file() or path.is_dir():
        if path.is_file() and path.stat().st_size == len(data) and path.read_bytes() == data:
            return path, len(lines), total
        what = "a directory" if path.is_dir() else "other bytes"
        raise UserError(f"{path}: already there and not this sample corpus ({what}); remove it or choose another --out")
    atomic_write_bytes(path, data)
    return path, len(lines), total
