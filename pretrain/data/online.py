"""The `online` loader mode: raw text read, tokenised and span-corrupted inside the DataLoader workers.

    source = online_source("corpus/*.jsonl", tokenizer="tok/tokenizer.json", input_length=512)
    loader = OnlineLoader(source, micro_batch_size=8, global_batch_size=64, seed=0, num_workers=4)

The way HF's T5 recipe and nanoT5 feed T5, with prep's own code: the work units of `pipeline.readers.plan_units`,
and for each unit `pipeline.steps.unit_examples` (reader -> tokenizer -> token windows -> span corruption, the masks
seeded by (span seed, unit id)), exactly what `prep corpus` writes into a unit's shards. `--data` is either corpus
files (a path or glob, with `--tokenizer` and the span settings) or a shard set, whose recorded corpus, tokenizer
and settings are then reused: the online examples are that set's examples, made again.

Order. Epoch e of rank r reads the units `default_rng((seed, e)).permutation(n_units)[r::world_size]`, each unit's
examples in the order `default_rng((seed, e, unit_id)).permutation(rows)`; the rank's stream is those units one
after another, epoch after epoch, cut into micro-batches (a micro-batch may span two units). Worker w of W makes
the units at stream positions w, w + W, ... and the DataLoader hands them over round-robin, so the stream is the
same for any number of workers (0 included). A unit is one DataLoader item: a worker sends a whole unit's examples
(inputs and labels as two contiguous int64 tensors, which the DataLoader pins): a micro-batch inside one unit is a
row slice of each, so the training process copies nothing on the host.

Resume granularity: exact at any micro-batch. The state of a rank is (unit position in its stream, examples of
that unit already consumed); a resumed rank makes that unit again and skips those examples. The state differs
between ranks (`per_rank_state`): the trainer saves every rank's, and a run resumes at the same world size only.
"""

from __future__ import annotations

import itertools
import os
import time
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch
from torch.utils.data import IterableDataset, get_worker_info

from pipeline.common import UserError, sha256_json
from pipeline.config import CorpusConfig
from pipeline.readers import RejectCounter, WorkUnit, discover_inputs, plan_units
from pipeline.shard_format import MANIFEST_NAME, read_manifest
from pipeline.span_corruption import T5_MEAN_NOISE_SPAN_LENGTH, T5_NOISE_DENSITY, SpanSpec
from pipeline.steps import tokenizer_errors_as_user_errors, unit_examples
from pretrain.data.loader import LoaderProcesses, data_loader, one_line_user_errors

_PREP_DEFAULTS = {f.name: f.default for f in fields(CorpusConfig)}


@dataclass(frozen=True)
class OnlineSource:
    """What every worker needs to make examples: the units, the tokenizer section, the span settings."""

    origin: str                      # what --data named (corpus files, or the shard set whose corpus is reused)
    units: tuple[WorkUnit, ...]
    tokenizer: dict                  # tokenizer.t5.tokenizer_info: path, sha256, vocab size, special ids
    spec: SpanSpec
    span_seed: int
    text_field: str
    max_doc_chars: int

    @property
    def input_length(self) -> int:
        return self.spec.input_length

    @property
    def target_length(self) -> int:
        return self.spec.target_length

    @property
    def fingerprint(self) -> str:
        """hash(units, tokenizer bytes, span settings): two sources with one fingerprint make the same examples."""
        return sha256_json({"units": [u.to_json() for u in self.units], "tokenizer": self.tokenizer["sha256"],
                            "spec": [self.spec.input_length, self.spec.noise_density,
                                     self.spec.mean_noise_span_length], "seed": self.span_seed,
                            "text_field": self.text_field, "max_doc_chars": self.max_doc_chars})

    def manifest_view(self) -> dict[str, Any]:
        """The manifest sections the preflight checks (tokenizer, lengths), for a source that has no manifest."""
        return {"tokenizer": self.tokenizer, "config": {"input_length": self.input_length,
                                                         "target_length": self.target_length}}


def online_source(data: str, *, tokenizer: str | None = None, input_length: int | None = None,
                  noise_density: float | None = None, mean_span_length: float | None = None,
                  unit_bytes: int | None = None, text_field: str = "text", seed: int = 0) -> OnlineSource:
    """The source `--loader online --data DATA` reads: corpus files (with `tokenizer`), or a shard set's corpus."""
    from tokenizer.t5 import tokenizer_info

    manifest_path = Path(data) / MANIFEST_NAME
    if manifest_path.is_file():
        return _source_of_shard_set(Path(data), tokenizer=tokenizer, input_length=input_length,
                                    noise_density=noise_density, mean_span_length=mean_span_length,
                                    unit_bytes=unit_bytes)
    if not tokenizer:
        raise UserError(f"--loader online --data {data}: corpus files need --tokenizer tok/tokenizer.json (or give a "
                        f"shard set as --data to reuse its corpus and tokenizer)")
    with tokenizer_errors_as_user_errors():
        info = tokenizer_info(tokenizer)
    spec = SpanSpec.derive(input_length or _PREP_DEFAULTS["input_length"], noise_density or T5_NOISE_DENSITY,
                           mean_span_length or T5_MEAN_NOISE_SPAN_LENGTH)
    units = plan_units(discover_inputs([data]), unit_bytes or _PREP_DEFAULTS["unit_bytes"])
    return OnlineSource(origin=data, units=tuple(units), tokenizer=info, spec=spec, span_seed=seed,
                        text_field=text_field, max_doc_chars=_PREP_DEFAULTS["max_doc_chars"])


def _source_of_shard_set(shard_dir: Path, *, tokenizer, input_length, noise_density, mean_span_length,
                         unit_bytes) -> OnlineSource:
    """The corpus, tokenizer and settings a shard set was made with (its manifest), for making its examples again."""
    from tokenizer.t5 import tokenizer_info

    manifest = read_manifest(shard_dir)
    config, where = manifest["config"], shard_dir / MANIFEST_NAME
    for flag, given, recorded in (("--input-length", input_length, config["input_length"]),
                                  ("--noise-density", noise_density, config["noise_density"]),
                                  ("--mean-span-length", mean_span_length, config["mean_noise_span_length"]),
                                  ("--unit-bytes", unit_bytes, config["unit_bytes"])):
        if given is not None and given != recorded:
            raise UserError(f"{where}: made with {flag} {recorded}, the run asks for {given}; drop {flag} (the shard "
                            f"set's corpus is made again with its own settings) or give the corpus files as --data")
    path = tokenizer or manifest["tokenizer"]["path"]
    with tokenizer_errors_as_user_errors():
        info = tokenizer_info(path)
    if info["sha256"] != manifest["tokenizer"]["sha256"]:
        raise UserError(f"{where}: made with tokenizer sha256 {manifest['tokenizer']['sha256'][:12]}.., {path} has "
                        f"{info['sha256'][:12]}..; pass the tokenizer the set was made with as --tokenizer")
    paths = [item["path"] for item in manifest["inputs"]]
    missing = [p for p in paths if not os.path.exists(p)]
    if missing:
        raise UserError(f"{where}: its corpus file {missing[0]} is gone; --loader online remakes a shard set's examples "
                        f"from its corpus: give the corpus files as --data (with --tokenizer) instead")
    units = plan_units(discover_inputs(paths), int(config["unit_bytes"]))
    spec = SpanSpec.derive(int(config["input_length"]), float(config["noise_density"]),
                           float(config["mean_noise_span_length"]))
    return OnlineSource(origin=str(shard_dir), units=tuple(units), tokenizer=info, spec=spec,
                        span_seed=int(config["seed"]), text_field=str(config["text_field"]),
                        max_doc_chars=int(config["max_doc_chars"]))


def make_unit_rows(source: OnlineSource, unit: WorkUnit) -> np.ndarray:
    """One unit's examples in prep's order as [rows, input_length + target_length] int32 (inputs, then labels)."""
    with tokenizer_errors_as_user_errors():
        examples, _ = unit_examples(unit, source.tokenizer, source.spec, source.span_seed,
                                    text_field=source.text_field, max_doc_chars=source.max_doc_chars,
                                    rejected=RejectCounter())
        parts = [np.concatenate([inputs, labels], axis=1) for inputs, labels in examples]
    if not parts:
        return np.zeros((0, source.input_length + source.target_length), dtype=np.int32)
    return np.concatenate(parts)


class RankUnits:
    """Rank `rank`'s stream of units: position p -> (epoch, index into source.units)."""

    def __init__(self, num_units: int, seed: int, rank: int, world_size: int):
        if num_units < world_size:
            raise UserError(f"the corpus makes {num_units} work unit(s), fewer than the {world_size} ranks that each "
                            f"need one; lower --unit-bytes or add text")
        self.num_units, self.seed, self.rank, self.world_size = num_units, seed, rank, world_size
        self.per_epoch = len(range(rank, num_units, world_size))

    def unit_at(self, position: int) -> tuple[int, int]:
        epoch, k = divmod(int(position), self.per_epoch)
        order = np.random.default_rng((self.seed, epoch)).permutation(self.num_units)
        return epoch, int(order[self.rank + k * self.world_size])


class _UnitItems(IterableDataset):
    """DataLoader items: (stream position, that unit's examples shuffled) for positions start + w, start + w + W..."""

    def __init__(self, source: OnlineSource, order: RankUnits, start: int, seed: int):
        self.source, self.order, self.start, self.seed = source, order, start, seed

    def __iter__(self) -> Iterator[tuple[int, torch.Tensor]]:
        os.environ["TOKENIZERS_PARALLELISM"] = "false"      # one loading process = one core
        info = get_worker_info()
        worker, workers = (0, 1) if info is None else (info.id, info.num_workers)
        for position in itertools.count(self.start + worker, workers):
            epoch, index = self.order.unit_at(position)
            unit = self.source.units[index]
            rows = make_unit_rows(self.source, unit)
            rows = rows[np.random.default_rng((self.seed, epoch, unit.unit_id)).permutation(len(rows))]
            # int64 inputs and labels apart, each contiguous: the DataLoader pins them (its pin thread), and a
            # micro-batch inside one unit is then a row slice of each, handed to the device with no host copy
            length = self.source.input_length
            yield (position, torch.from_numpy(np.ascontiguousarray(rows[:, :length], dtype=np.int64)),
                   torch.from_numpy(np.ascontiguousarray(rows[:, length:], dtype=np.int64)))


class OnlineLoader(LoaderProcesses):
    """Micro-batches {"input_ids", "labels"} (int64) of an OnlineSource forever; exact resume (module docstring)."""

    per_rank_state = True

    def __init__(self, source: OnlineSource, *, micro_batch_size: int, global_batch_size: int, seed: int,
                 rank: int = 0, world_size: int = 1, num_workers: int = 0, pin_memory: bool = False,
                 prefetch_factor: int = 2, persistent_workers: bool = True,
                 worker_cores: list[list[int]] | None = None):
        self._created = time.perf_counter()
        if global_batch_size % world_size or (global_batch_size // world_size) % micro_batch_size:
            raise UserError(f"micro batch {micro_batch_size} x {world_size} ranks does not divide the global batch "
                            f"{global_batch_size}; pick --micro-batch and --global-batch that fit")
        self.source, self.seed, self.rank, self.world_size = source, int(seed), rank, world_size
        self.micro_batch_size = micro_batch_size
        self.grad_accum = global_batch_size // world_size // micro_batch_size
        self.order = RankUnits(len(source.units), self.seed, rank, world_size)
        self.num_workers, self.pin_memory = num_workers, pin_memory
        self._loader_args = dict(num_workers=num_workers, pin_memory=pin_memory, prefetch_factor=prefetch_factor,
                                 persistent_workers=persistent_workers, worker_cores=worker_cores)
        self.position, self.offset, self.consumed = 0, 0, 0    # next example: unit `position`, row `offset`
        self.dataloader = None
        self._iterating = False

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        self._iterating = True
        self.dataloader = data_loader(_UnitItems(self.source, self.order, self.position, self.seed), batch_size=None,
                                      seed=self.seed, **self._loader_args)
        items = one_line_user_errors(iter(self.dataloader))
        micro = self.micro_batch_size
        inputs = labels = None
        skip, empty_in_a_row = self.offset, 0
        while True:
            pieces, need = [], micro
            while need:
                if inputs is None or self.offset == len(inputs):
                    if inputs is not None:
                        self.position, self.offset = self.position + 1, 0
                    position, inputs, labels = next(items)
                    assert position == self.position, (position, self.position)
                    self.offset, skip = skip, 0
                    empty_in_a_row = empty_in_a_row + 1 if len(inputs) == 0 else 0
                    if empty_in_a_row >= self.order.per_epoch:
                        raise UserError(f"{self.source.origin}: a whole epoch of this rank's work units gave no "
                                        f"example of {self.source.input_length} tokens; check that the records hold "
                                        f"their text in --text-field {self.source.text_field!r}, or use a shorter "
                                        f"--input-length or more text")
                    continue
                take = min(need, len(inputs) - self.offset)
                pieces.append((inputs[self.offset:self.offset + take], labels[self.offset:self.offset + take]))
                self.offset += take
                need -= take
            self._mark_first_batch()
            self.consumed += micro
            if len(pieces) == 1:            # inside one unit: views of the (pinned) unit tensors, no copy
                batch_inputs, batch_labels = pieces[0]
            else:                           # across units (once per unit): joined, and pinned here
                batch_inputs, batch_labels = (torch.cat([piece[i] for piece in pieces]) for i in (0, 1))
                if self.pin_memory and torch.cuda.is_available():
                    batch_inputs, batch_labels = batch_inputs.pin_memory(), batch_labels.pin_memory()
            yield {"input_ids": batch_inputs, "labels": batch_labels}

    def state_dict(self) -> dict[str, Any]:
        """This rank's position: unit `unit_position` of its stream, `example_offset` of its examples consumed."""
        position, offset = self.position, self.offset
        return {"mode": "online", "seed": self.seed, "rank": self.rank, "world_size": self.world_size,
                "unit_position": position, "example_offset": offset, "epoch": position // self.order.per_epoch,
                "consumed_samples": self.consumed * self.world_size, "fingerprint": self.source.fingerprint}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from this rank's state, or from {"per_rank": [every rank's state]} (what the trainer saves)."""
        if self._iterating:
            raise RuntimeError("load_state_dict must be called before iterating the loader")
        if "per_rank" in state:
            states = state["per_rank"]
            if len(states) != self.world_size:
                raise UserError(f"the checkpoint's online loader state is of {len(states)} ranks, this run has "
                                f"{self.world_size}; --loader online resumes at the world size it saved with")
            state = states[self.rank]
        if state.get("mode") != "online":
            raise UserError(f"loader state {dict(state)} is not an online-mode state; resume with the --loader the "
                            f"run was saved with")
        if state.get("fingerprint") != self.source.fingerprint:
            raise UserError(f"the checkpoint's online loader read another corpus or settings (fingerprint "
                            f"{str(state.get('fingerprint'))[:12]}.., now {self.source.fingerprint[:12]}..); resume with "
                            f"the --data, --tokenizer and span settings it was saved with")
        self.seed = int(state["seed"])
        self.order = RankUnits(len(self.source.units), self.seed, self.rank, self.world_size)
        self.position, self.offset = int(state["unit_position"]), int(state["example_offset"])
        self.consumed = int(state["consumed_samples"]) // self.world_size

    def close(self) -> None:
        """Shut down the worker processes now."""
        self._shutdown_workers()

    def __enter__(self) -> "OnlineLoader":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()
