"""T5 span corruption, vectorised over a batch of raw windows (one numpy pass, no loop per window).

    inputs, labels = span_corrupt(windows, rng, SpanSpec.derive(512, 0.15, 3.0), sentinel_first_id=V - 1, eos_id=1)

Semantics follow `t5.data.preprocessors.span_corruption`: every window of `raw_length` tokens gets exactly
round(raw_length * noise_density) noise tokens in round(noise / mean_noise_span_length) spans, the mask
starts with a non-noise span, inputs = kept tokens with each noise span replaced by the next sentinel + `</s>`,
labels = each noise span preceded by its sentinel + `</s>`. `raw_length` and `target_length` come from T5's
`random_spans_helper` arithmetic (`SpanSpec.derive`), never hard-coded.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from pipeline.common import UserError

MAX_SENTINELS = 100
T5_NOISE_DENSITY = 0.15  # the defaults of T5's span corruption (and of `prep corpus`)
T5_MEAN_NOISE_SPAN_LENGTH = 3.0
MAX_RAW_PER_INPUT = 64  # a raw window longer than this many input lengths is refused (a density near 1)
MAX_NOISE_DENSITY = 0.98  # keeps any raw window under the cap: inputs >= raw * (1 - density) + 1.5 tokens


def _noise_counts(raw_length: int, noise_density: float, mean_noise_span_length: float) -> tuple[int, int]:
    """(noise tokens, noise spans) of a raw window: round(raw * density) tokens in round(noise / mean) spans, clamped
    as T5's `random_spans_noise_mask` clamps them (at least one noise token, one kept token and one span)."""
    num_noise_tokens = min(max(int(round(raw_length * noise_density)), 1), raw_length - 1)
    num_noise_spans = max(int(round(num_noise_tokens / mean_noise_span_length)), 1)
    return num_noise_tokens, num_noise_spans


def _lengths_after_corruption(raw_length: int, noise_density: float, mean_noise_span_length: float) -> tuple[int, int]:
    """(inputs length, targets length) that a raw window of `raw_length` tokens becomes, `</s>` included.

    From the clamped counts the mask is drawn with: T5's `random_spans_helper` uses the unclamped ones, which differ
    where a clamp binds (a mean span longer than the noise, a density that rounds to no noise token) and then give
    lengths the examples do not have. Where no clamp binds (T5's settings) both give the same lengths."""
    num_noise_tokens, num_noise_spans = _noise_counts(raw_length, noise_density, mean_noise_span_length)
    return raw_length - num_noise_tokens + num_noise_spans + 1, num_noise_tokens + num_noise_spans + 1


@dataclass(frozen=True)
class SpanSpec:
    """Lengths and counts of one span-corruption setting; build it with `SpanSpec.derive`."""

    input_length: int  # length of every `input_ids` row (padded with pad_id if the arithmetic lands short)
    target_length: int  # length of every `labels` row
    raw_length: int  # tokens per raw window
    noise_density: float
    mean_noise_span_length: float
    num_noise_tokens: int
    num_noise_spans: int
    corrupted_input_length: int  # kept tokens + sentinels + `</s>` before padding

    @classmethod
    def derive(cls, input_length: int, noise_density: float = T5_NOISE_DENSITY,
               mean_noise_span_length: float = T5_MEAN_NOISE_SPAN_LENGTH) -> "SpanSpec":
        """The largest raw window whose corrupted inputs fit `input_length` (T5's `random_spans_helper`)."""
        if input_length < 4:
            raise UserError(f"--input-length {input_length} is too short; use at least 4 (T5 uses 512)")
        if not 0.0 < noise_density < 1.0:
            raise UserError(f"--noise-density {noise_density} must lie strictly between 0 and 1 "
                            f"(T5 uses {T5_NOISE_DENSITY})")
        if mean_noise_span_length < 1.0:
            raise UserError(f"--mean-span-length {mean_noise_span_length} must be >= 1 "
                            f"(T5 uses {T5_MEAN_NOISE_SPAN_LENGTH})")
        # The inputs length never shrinks as the raw window grows (a token more adds 0 or 1 noise tokens, and a noise
        # token more adds 0 or 1 spans), so T5's loop `while inputs(raw + 1) <= input_length: raw += 1` ends at the
        # largest raw length that fits, found here by bisection between input_length - 1 (which always fits: a span
        # has a noise token) and a cap (refused when it fits: a density near 1 makes windows without end).
        def fits(raw: int) -> bool:
            return _lengths_after_corruption(raw, noise_density, mean_noise_span_length)[0] <= input_length

        too_long = MAX_RAW_PER_INPUT * input_length
        if fits(too_long):
            raise UserError(f"--noise-density {noise_density} keeps so few tokens that a raw window would exceed "
                            f"{MAX_RAW_PER_INPUT} x --input-length; use --noise-density {MAX_NOISE_DENSITY} or less "
                            f"(T5 uses {T5_NOISE_DENSITY})")
        raw_length = input_length - 1
        while too_long - raw_length > 1:
            middle = (raw_length + too_long) // 2
            raw_length, too_long = (middle, too_long) if fits(middle) else (raw_length, middle)
        corrupted_input_length, target_length = _lengths_after_corruption(
            raw_length, noise_density, mean_noise_span_length)
        if noise_density == 0.5 and target_length > corrupted_input_length:  # T5's nudge towards equal lengths
            raw_length -= 1
            corrupted_input_length, target_length = _lengths_after_corruption(
                raw_length, noise_density, mean_noise_span_length)
        num_noise_tokens, num_noise_spans = _noise_counts(raw_length, noise_density, mean_noise_span_length)
        if num_noise_spans > MAX_SENTINELS:
            raise UserError(f"input length {input_length} with noise density {noise_density} and mean span "
                            f"{mean_noise_span_length} needs {num_noise_spans} sentinels per example, more than "
                            f"the tokenizer's {MAX_SENTINELS}; use a shorter --input-length or a longer "
                            f"--mean-span-length")
        if raw_length - num_noise_tokens < num_noise_spans:
            raise UserError(f"noise density {noise_density} leaves fewer kept tokens than noise spans; "
                            f"lower --noise-density or raise --mean-span-length")
        return cls(input_length=input_length, target_length=target_length, raw_length=raw_length,
                   noise_density=noise_density, mean_noise_span_length=mean_noise_span_length,
                   num_noise_tokens=num_noise_tokens, num_noise_spans=num_noise_spans,
                   corrupted_input_length=corrupted_input_length)


def _random_segment_lengths(rng: np.random.Generator, rows: int, num_items: int, num_segments: int) -> np.ndarray:
    """[rows, num_segments] positive lengths summing to `num_items`: a uniform random composition per row."""
    if num_segments == 1:
        return np.full((rows, 1), num_items, dtype=np.int64)
    # Choose num_segments-1 distinct cut points among the num_items-1 gaps (uniform over compositions): the gaps of
    # the smallest random keys. A partition finds them in linear time; the same set a full argsort's first ones are.
    chosen = np.argpartition(rng.random((rows, num_items - 1)), num_segments - 2, axis=1)[:, : num_segments - 1]
    cuts = np.sort(chosen, axis=1) + 1
    bounds = np.concatenate([np.zeros((rows, 1), np.int64), cuts, np.full((rows, 1), num_items, np.int64)], axis=1)
    return np.diff(bounds, axis=1)


def random_noise_mask(rng: np.random.Generator, rows: int, spec: SpanSpec) -> np.ndarray:
    """[rows, raw_length] bool; each row: exactly `num_noise_tokens` True in `num_noise_spans` runs, first run False."""
    noise_lengths = _random_segment_lengths(rng, rows, spec.num_noise_tokens, spec.num_noise_spans)
    kept_lengths = _random_segment_lengths(rng, rows, spec.raw_length - spec.num_noise_tokens, spec.num_noise_spans)
    run_lengths = np.stack([kept_lengths, noise_lengths], axis=2).reshape(rows, -1)  # kept, noise, kept, noise...
    run_is_noise = np.tile(np.array([False, True]), rows * spec.num_noise_spans)
    return np.repeat(run_is_noise, run_lengths.reshape(-1)).reshape(rows, spec.raw_length)


def span_corrupt(windows: np.ndarray, rng: np.random.Generator, spec: SpanSpec, *, sentinel_first_id: int,
                 eos_id: int, pad_id: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Corrupt a batch of raw windows [rows, raw_length] -> (input_ids [rows, input_length], labels [rows, target_length]).

    Sentinel k (k-th span of a row) is `sentinel_first_id - k` (`<extra_id_0>` = vocab_size - 1, descending).
    """
    rows, raw_length = windows.shape
    if raw_length != spec.raw_length:
        raise ValueError(f"windows have {raw_length} tokens, the spec wants {spec.raw_length}")
    if rows == 0:
        return (np.zeros((0, spec.input_length), np.int32), np.zeros((0, spec.target_length), np.int32))
    noise = random_noise_mask(rng, rows, spec)
    previous = np.zeros_like(noise)
    previous[:, 1:] = noise[:, :-1]
    noise_start = noise & ~previous  # first token of each noise span
    kept_start = ~noise & previous  # first kept token after a noise span
    kept_start[:, 0] = True  # the mask always opens with a kept span, which precedes noise span 0
    span_index = np.cumsum(noise_start, axis=1) - 1  # for noise tokens: which span they belong to
    kept_span_index = np.cumsum(kept_start, axis=1) - 1  # kept span k precedes noise span k
    sentinels_for_inputs = (sentinel_first_id - span_index).astype(np.int32)
    sentinels_for_labels = (sentinel_first_id - kept_span_index).astype(np.int32)
    tokens = windows.astype(np.int32, copy=False)

    input_values = np.where(noise_start, sentinels_for_inputs, tokens)
    inputs = input_values[~noise | noise_start].reshape(rows, -1)
    label_values = np.where(kept_start, sentinels_for_labels, tokens)
    labels = label_values[noise | kept_start].reshape(rows, -1)

    input_ids = np.full((rows, spec.input_length), pad_id, dtype=np.int32)
    input_ids[:, : inputs.shape[1]] = inputs
    input_ids[:, inputs.shape[1]] = eos_id
    label_ids = np.empty((rows, spec.target_length), dtype=np.int32)
    label_ids[:, : labels.shape[1]] = labels
    label_ids[:, labels.shape[1]] = eos_id
    return input_ids, label_ids


def reconstruct(input_ids: np.ndarray, labels: np.ndarray, *, sentinel_first_id: int, eos_id: int) -> list[np.ndarray]:
    """Undo span corruption for checking (tests, `prep inspect`): interleave inputs and labels by sentinel.

    A plain reference implementation, one row at a time; not used on any hot path.
    """
    lowest_sentinel = sentinel_first_id - MAX_SENTINELS + 1
    windows = []
    for inp, lab in zip(input_ids, labels):
        inp = inp[: int(np.flatnonzero(inp == eos_id)[-1])]  # drop the closing `</s>` and any padding
        lab = lab[: int(np.flatnonzero(lab == eos_id)[-1])]
        label_spans: dict[int, list[int]] = {}
        current = None
        for token in lab.tolist():
            if lowest_sentinel <= token <= sentinel_first_id:
                current = token
                label_spans[current] = []
            elif current is not None:
                label_spans[current].append(token)
        out: list[int] = []
        for token in inp.tolist():
            if lowest_sentinel <= token <= sentinel_first_id:
                out.extend(label_spans.get(token, []))
            else:
                out.append(token)
        windows.append(np.array(out, dtype=np.int64))
    return windows
