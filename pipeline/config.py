"""The settings of the prep jobs, one dataclass per command: each field carries its default, help text and checks,
and the command's flags and `--config` YAML keys are generated from the fields (`pipeline.settings`).

    config = CorpusConfig(input=["corpus.jsonl"], tokenizer="tok/tokenizer.json", out="shards/demo", workers=2)

A bad value raises `UserError` from `__post_init__`, one line naming the flag and the fix.
"""

from __future__ import annotations

from dataclasses import dataclass

from pipeline.common import UserError, usable_cores
from pipeline.settings import setting
from pipeline.span_corruption import T5_MEAN_NOISE_SPAN_LENGTH, T5_NOISE_DENSITY, SpanSpec

SHARD_TARGET_BYTES = 64 << 20  # shard size when --shard-rows is left out
MIN_UNIT_BYTES = 1024
INPUT_HELP = "corpus files/dirs/globs (or `sample`)"


def text_field_setting():
    return setting("text", "the JSON field / parquet or arrow column holding each document's text")


def max_doc_chars_setting():
    return setting(1_000_000, "longer documents are skipped and counted as too_long")


def require_at_least(flag: str, value: int, minimum: int) -> None:
    """Refuse `flag` below `minimum` before anything is read or written (a bad value would fail later, inside Ray)."""
    if value < minimum:
        raise UserError(f"{flag} {value} must be >= {minimum}")


@dataclass(kw_only=True)
class CorpusConfig:
    """`prep corpus`: inputs, tokenizer, lengths and the Ray executor; the fields that shape the shard bytes go
    into the fingerprint (`pipeline.corpus.CorpusJob`)."""

    input: list[str] = setting(help=f"{INPUT_HELP} (required)")
    tokenizer: str = setting(help="tokenizer.json in the T5 layout (required)")
    out: str = setting(help="shard set directory (required)")
    workers: int = setting(usable_cores(), "Ray workers, the CPUs of the local cluster",
                           default_text="the cores this process may use")
    ray_address: str | None = setting(None, "an existing Ray cluster (default: start a local one)")
    text_field: str = text_field_setting()
    input_length: int = setting(512, "tokens per example input; the target length follows from T5's span arithmetic")
    noise_density: float = setting(T5_NOISE_DENSITY, "fraction of each raw window's tokens that are masked")
    mean_span_length: float = setting(T5_MEAN_NOISE_SPAN_LENGTH, "mean length of a masked span, in tokens")
    seed: int = setting(0, "seed of the span masks; work unit k draws from (seed, k)")
    shard_rows: int | None = setting(None, "rows per shard", default_text="about 64 MiB")
    unit_bytes: int = setting(4 << 20, "input bytes per work unit, part of the fingerprint and independent of "
                              "--workers", default_text="4 MiB")
    max_doc_chars: int = max_doc_chars_setting()
    overwrite: bool = setting(False, "replace a different shard set in --out (only prep's own files there are "
                              "removed, and listed first)")
    quiet: bool = setting(False, "no progress bar")

    def __post_init__(self) -> None:
        if self.shard_rows is not None:
            require_at_least("--shard-rows", self.shard_rows, 1)
        require_at_least("--max-doc-chars", self.max_doc_chars, 1)
        require_at_least("--workers", self.workers, 1)
        require_at_least("--seed", self.seed, 0)  # numpy seeds the span masks with (seed, unit): no negative seed
        if self.unit_bytes < MIN_UNIT_BYTES:
            raise UserError(f"--unit-bytes {self.unit_bytes} is too small; use at least {MIN_UNIT_BYTES} "
                            f"(default 4 MiB)")
        self.span_spec()  # checks --input-length, --noise-density and --mean-span-length together

    def span_spec(self) -> SpanSpec:
        return SpanSpec.derive(self.input_length, self.noise_density, self.mean_span_length)

    def resolved_shard_rows(self) -> int:
        """--shard-rows, or as many rows as make about SHARD_TARGET_BYTES."""
        if self.shard_rows is not None:
            return self.shard_rows
        spec = self.span_spec()
        return max(1, SHARD_TARGET_BYTES // (4 * (spec.input_length + spec.target_length)))


@dataclass(kw_only=True)
class TokenizerConfig:
    """`prep tokenizer`: train a T5-layout Unigram tokenizer on --input, or adopt --from FILE."""

    input: list[str] | None = setting(None, INPUT_HELP)
    from_file: str | None = setting(None, "adopt this tokenizer.json instead of training", flag=False)  # --from
    vocab_size: int = setting(32000, "total vocabulary incl. specials and sentinels")
    out: str = setting(help="directory for tokenizer.json")
    text_field: str = text_field_setting()
    max_doc_chars: int = max_doc_chars_setting()
    max_bytes: int | None = setting(None, "stop reading training text once this many bytes (UTF-8) are read")
    overwrite: bool = setting(False, "replace an existing DIR/tokenizer.json (kept as tokenizer.json.bak-<sha12>); "
                              "shard sets made with the old file need the old file")

    def __post_init__(self) -> None:
        if self.from_file and self.input:
            raise UserError("pass either --from FILE (adopt a tokenizer) or --input PATH (train one), not both")
        if not self.from_file and not self.input:
            raise UserError("nothing to train on: pass --input PATH (or `--input sample`), or --from FILE")
        require_at_least("--max-doc-chars", self.max_doc_chars, 1)
        if self.max_bytes is not None:
            require_at_least("--max-bytes", self.max_bytes, 1)
