"""The steps of `prep corpus` after reading: documents -> token windows -> span corruption -> Arrow shards.

    windows = TokenWindows(cached_t5_tokenizer(path), spec.raw_length, eos_id=1)
    for raw in window_batches(map(windows.push, batched_texts(texts)), WINDOWS_PER_CORRUPTION): ...

Each step is a small class or generator that knows nothing of Ray or of the job around it;
`pipeline.corpus.process_unit` composes them for one work unit (`readers.unit_texts` is the first step).
"""

from __future__ import annotations

import contextlib
import itertools
import os
from pathlib import Path
from typing import Any, Iterable, Iterator

import numpy as np

from pipeline.common import UserError, sha256_file, write_error
from pipeline.shard_format import shard_name, write_shard
from pipeline.span_corruption import SpanSpec, span_corrupt

WINDOWS_PER_CORRUPTION = 4096


@contextlib.contextmanager
def tokenizer_errors_as_user_errors() -> Iterator[None]:
    """Around calls into `tokenizer.t5` (a package that stands alone): its `TokenizerError` becomes `UserError`."""
    from tokenizer.t5 import TokenizerError

    try:
        yield
    except TokenizerError as err:
        raise UserError(str(err)) from None


_TOKENIZERS: dict[str, Any] = {}


def cached_t5_tokenizer(path: str):
    """The T5-layout tokenizer at `path`, loaded once per process (a Ray worker runs many units)."""
    if path not in _TOKENIZERS:
        from tokenizer.t5 import load_tokenizer

        with tokenizer_errors_as_user_errors():
            _TOKENIZERS[path] = load_tokenizer(path)
    return _TOKENIZERS[path]


class TokenWindows:
    """Tokenise batches of documents (`</s>` after each) and cut the running token stream into raw windows."""

    def __init__(self, tokenizer, raw_length: int, eos_id: int) -> None:
        self.tokenizer = tokenizer
        self.raw_length = raw_length
        self.eos_id = eos_id
        self.carry = np.zeros(0, dtype=np.int32)
        self.documents = 0
        self.tokens = 0

    def push(self, texts: list[str]) -> np.ndarray:
        """Tokenise `texts`; return the full windows now available, [n, raw_length] int32."""
        encodings = self.tokenizer.encode_batch_fast(texts, add_special_tokens=False)
        id_lists = [e.ids for e in encodings]
        lengths = np.fromiter(map(len, id_lists), dtype=np.int64, count=len(id_lists)) + 1  # + </s>
        stream = np.full(int(lengths.sum()), self.eos_id, dtype=np.int32)
        not_eos = np.ones(len(stream), dtype=bool)
        not_eos[np.cumsum(lengths) - 1] = False
        stream[not_eos] = np.fromiter(itertools.chain.from_iterable(id_lists), dtype=np.int32,
                                      count=int(lengths.sum()) - len(id_lists))
        self.documents += len(texts)
        self.tokens += len(stream)
        stream = np.concatenate([self.carry, stream])
        full = len(stream) // self.raw_length * self.raw_length
        self.carry = stream[full:].copy()
        return stream[:full].reshape(-1, self.raw_length)


def window_batches(windows: Iterable[np.ndarray], min_rows: int) -> Iterator[np.ndarray]:
    """Join arrays of windows until they hold at least `min_rows` rows; the rest comes last (never empty)."""
    ready: list[np.ndarray] = []
    ready_rows = 0
    for new_windows in windows:
        if len(new_windows):
            ready.append(new_windows)
            ready_rows += len(new_windows)
        if ready_rows >= min_rows:
            yield np.concatenate(ready)
            ready, ready_rows = [], 0
    if ready_rows:
        yield np.concatenate(ready)


def corrupted(raw_batches: Iterable[np.ndarray], rng: np.random.Generator, spec: SpanSpec,
              tokenizer_info: dict) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """(input_ids, labels) of each batch of raw windows, drawing the span masks from `rng` in batch order."""
    for raw in raw_batches:
        yield span_corrupt(raw, rng, spec, sentinel_first_id=tokenizer_info["sentinel_first_id"],
                           eos_id=tokenizer_info["eos_id"], pad_id=tokenizer_info["pad_id"])


def unit_examples(unit, tokenizer_info: dict, spec: SpanSpec, seed: int, *, text_field: str, max_doc_chars: int,
                  rejected) -> tuple[Iterator[tuple[np.ndarray, np.ndarray]], TokenWindows]:
    """One work unit's span-corrupted examples, batch by batch, and the TokenWindows that counts its documents and
    tokens: `readers.unit_texts` -> `TokenWindows` -> `window_batches` -> `corrupted`, the span masks drawn from
    `default_rng((seed, unit.unit_id))`. What `prep corpus` writes into shards and what `pretrain --loader online`
    makes in its workers: one implementation, so both follow the same rules."""
    from pipeline.readers import batched_texts, unit_texts

    texts = unit_texts(unit, text_field, max_doc_chars, rejected)
    windows = TokenWindows(cached_t5_tokenizer(tokenizer_info["path"]), spec.raw_length, tokenizer_info["eos_id"])
    raw_batches = window_batches(map(windows.push, batched_texts(texts)), WINDOWS_PER_CORRUPTION)
    rng = np.random.default_rng((seed, unit.unit_id))
    return corrupted(raw_batches, rng, spec, tokenizer_info), windows


class ShardWriter:
    """Collect corrupted examples and write `data/part-UUUUU-KKKK.arrow` shards of `shard_rows` rows (tmp + rename)."""

    def __init__(self, out_dir: Path, unit_id: int, shard_rows: int) -> None:
        self.out_dir = out_dir
        self.unit_id = unit_id
        self.shard_rows = shard_rows
        self.pending_inputs: list[np.ndarray] = []
        self.pending_labels: list[np.ndarray] = []
        self.pending_rows = 0
        self.shards: list[dict] = []

    def add(self, input_ids: np.ndarray, labels: np.ndarray) -> None:
        self.pending_inputs.append(input_ids)
        self.pending_labels.append(labels)
        self.pending_rows += len(input_ids)
        while self.pending_rows >= self.shard_rows:
            self._flush(self.shard_rows)

    def close(self) -> list[dict]:
        """Write what is left as the last shard; -> every shard's {path, rows, bytes, sha256}."""
        if self.pending_rows:
            self._flush(self.pending_rows)
        return self.shards

    def _flush(self, rows: int) -> None:
        inputs = np.concatenate(self.pending_inputs)
        labels = np.concatenate(self.pending_labels)
        relative = shard_name(self.unit_id, len(self.shards))
        final = self.out_dir / relative
        tmp = final.with_name(f".{final.name}.{os.getpid()}.tmp")
        try:
            size = write_shard(tmp, inputs[:rows], labels[:rows])
            digest = sha256_file(tmp)
            os.replace(tmp, final)
        except OSError as err:  # a full or read-only --out: no partial shard stays behind
            tmp.unlink(missing_ok=True)
            raise write_error(final, err, fix="free some space or choose another --out; a rerun resumes") from None
        self.shards.append({"path": relative, "rows": rows, "bytes": size, "sha256": digest})
        self.pending_inputs, self.pending_labels = [inputs[rows:]], [labels[rows:]]
        self.pending_rows = len(inputs) - rows
