"""Span corruption keeps the T5 invariants (DESIGN.md): lengths, exact noise/span counts, sentinel order, reconstruction."""

import numpy as np
import pytest

from pipeline.common import UserError
from pipeline.span_corruption import SpanSpec, random_noise_mask, reconstruct, span_corrupt

VOCAB = 1024
SENTINEL_FIRST = VOCAB - 1
EOS = 1


def test_t5_default_lengths_come_from_the_helper_arithmetic():
    spec = SpanSpec.derive(512, 0.15, 3.0)
    assert (spec.raw_length, spec.target_length, spec.num_noise_tokens, spec.num_noise_spans) == (568, 114, 85, 28)
    assert SpanSpec.derive(128).raw_length == 141 and SpanSpec.derive(128).target_length == 29


def _windows(spec, rows, seed=0):
    # Token ids that are never eos/pad/sentinel, so reconstruction can be checked exactly; a few eos inside too.
    windows = np.random.default_rng(seed).integers(3, VOCAB - 100, size=(rows, spec.raw_length), dtype=np.int32)
    windows[:, spec.raw_length // 2] = EOS  # document boundaries occur inside windows
    return windows


@pytest.mark.parametrize("input_length,noise_density,mean_span", [
    (512, 0.15, 3.0), (128, 0.15, 3.0), (64, 0.3, 2.0), (100, 0.5, 1.0), (37, 0.1, 5.0), (256, 0.15, 8.0)])
def test_invariants(input_length, noise_density, mean_span):
    spec = SpanSpec.derive(input_length, noise_density, mean_span)
    windows = _windows(spec, rows=300)
    inputs, labels = span_corrupt(windows, np.random.default_rng(7), spec, sentinel_first_id=SENTINEL_FIRST, eos_id=EOS)
    assert inputs.shape == (300, input_length) and labels.shape == (300, spec.target_length)
    assert inputs.dtype == np.int32 and labels.dtype == np.int32
    is_sentinel_in = inputs > SENTINEL_FIRST - 100
    is_sentinel_lab = labels > SENTINEL_FIRST - 100
    # exact span count in every row, sentinels in order <extra_id_0>, <extra_id_1>, ... in inputs and labels
    assert (is_sentinel_in.sum(1) == spec.num_noise_spans).all()
    assert (is_sentinel_lab.sum(1) == spec.num_noise_spans).all()
    expected = SENTINEL_FIRST - np.arange(spec.num_noise_spans)
    assert (inputs[is_sentinel_in].reshape(300, -1) == expected).all()
    assert (labels[is_sentinel_lab].reshape(300, -1) == expected).all()
    assert labels[:, 0].tolist() == [SENTINEL_FIRST] * 300  # targets open with <extra_id_0>
    # exact noise count: label tokens that are not sentinels and not the closing eos
    assert ((~is_sentinel_lab).sum(1) - 1 == spec.num_noise_tokens).all()
    assert (labels[:, -1] == EOS).all()
    kept = spec.raw_length - spec.num_noise_tokens
    assert (inputs[:, kept + spec.num_noise_spans] == EOS).all()
    assert (inputs[:, kept + spec.num_noise_spans + 1:] == 0).all()  # padding only when the arithmetic lands short
    for window, rebuilt in zip(windows, reconstruct(inputs, labels, sentinel_first_id=SENTINEL_FIRST, eos_id=EOS)):
        np.testing.assert_array_equal(rebuilt, window)


def test_noise_mask_counts_and_shape():
    spec = SpanSpec.derive(512)
    mask = random_noise_mask(np.random.default_rng(0), 500, spec)
    assert mask.shape == (500, 568) and (mask.sum(1) == 85).all()
    starts = mask[:, 1:] & ~mask[:, :-1]
    # as in T5 (no random roll), a window opens with a kept span and closes with a noise span
    assert (starts.sum(1) == 28).all() and not mask[:, 0].any() and mask[:, -1].all()
    # in between, spans land everywhere, not in a fixed place
    middle = mask[:, 1:-8].mean(0)
    assert middle.min() > 0.05 and middle.max() < 0.3


def test_same_seed_same_bytes_other_seed_differs():
    spec = SpanSpec.derive(128)
    windows = _windows(spec, 64)
    run = lambda seed: span_corrupt(windows, np.random.default_rng((seed, 3)), spec, sentinel_first_id=SENTINEL_FIRST,
                                    eos_id=EOS)
    a, b, c = run(0), run(0), run(1)
    assert a[0].tobytes() == b[0].tobytes() and a[1].tobytes() == b[1].tobytes()
    assert a[0].tobytes() != c[0].tobytes()


def test_empty_batch_and_wrong_width():
    spec = SpanSpec.derive(64)
    inputs, labels = span_corrupt(np.zeros((0, spec.raw_length), np.int32), np.random.default_rng(0), spec,
                                  sentinel_first_id=SENTINEL_FIRST, eos_id=EOS)
    assert inputs.shape == (0, 64) and labels.shape == (0, spec.target_length)
    with pytest.raises(ValueError):
        span_corrupt(np.zeros((2, 5), np.int32), np.random.default_rng(0), spec, sentinel_first_id=SENTINEL_FIRST,
                     eos_id=EOS)


@pytest.mark.parametrize("args", [(2, 0.15, 3.0), (512, 0.0, 3.0), (512, 1.0, 3.0), (512, 0.15, 0.5), (4096, 0.15, 3.0),
                                  (128, 0.99, 1e6)])
def test_bad_settings_are_user_errors(args):
    with pytest.raises(UserError):
        SpanSpec.derive(*args)


def test_settings_where_the_counts_are_clamped_make_examples_of_the_derived_lengths():
    """A mean span longer than the noise (60 .. 200 at input 128) or a density that rounds to no noise token: the
    mask has at least one noise token in at least one span, and the lengths now count those (they crashed prep
    corpus inside Ray with an IndexError or a broadcast error)."""
    for args in [(128, 0.15, 60), (128, 0.15, 100), (128, 0.15, 141), (128, 0.15, 200), (128, 0.001, 3.0)]:
        spec = SpanSpec.derive(*args)
        assert spec.num_noise_spans == 1 and spec.corrupted_input_length <= 128
        windows = _windows(spec, rows=20)
        inputs, labels = span_corrupt(windows, np.random.default_rng(0), spec, sentinel_first_id=SENTINEL_FIRST,
                                      eos_id=EOS)
        assert inputs.shape == (20, 128) and labels.shape == (20, spec.target_length)
        for window, rebuilt in zip(windows, reconstruct(inputs, labels, sentinel_first_id=SENTINEL_FIRST,
                                                        eos_id=EOS)):
            np.testing.assert_array_equal(rebuilt, window)


def test_every_accepted_setting_works_and_every_other_is_refused_in_one_line():
    """A grid of lengths, densities and mean spans, extremes included: derive either refuses with a UserError that
    names an option, or the examples have exactly the lengths it derived and rebuild their windows."""
    accepted = 0
    for input_length in (4, 5, 16, 37, 128, 512, 2048):
        for noise_density in (0.001, 0.05, 0.15, 0.5, 0.9, 0.98):
            for mean_span in (1.0, 1.5, 3.0, 8.0, 100.0, 1e6):
                try:
                    spec = SpanSpec.derive(input_length, noise_density, mean_span)
                except UserError as err:
                    assert "--" in str(err) and "\n" not in str(err), str(err)
                    continue
                accepted += 1
                windows = _windows(spec, rows=3)
                inputs, labels = span_corrupt(windows, np.random.default_rng(1), spec,
                                              sentinel_first_id=SENTINEL_FIRST, eos_id=EOS)
                assert inputs.shape == (3, input_length) and labels.shape == (3, spec.target_length)
                rebuilt = reconstruct(inputs, labels, sentinel_first_id=SENTINEL_FIRST, eos_id=EOS)
                assert all((a == b).all() for a, b in zip(rebuilt, windows)), (input_length, noise_density, mean_span)
    assert accepted > 150
