"""GlobalOrderSampler: one order per (seed, epoch) at every world size, equal shares per rank, exact state.

    .venv/bin/python -m pytest tests/pretrain/test_sampler.py -q
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from pipeline.common import UserError
from pretrain.data.sampler import GlobalOrderSampler


def take(sampler: GlobalOrderSampler, count: int) -> list[int]:
    iterator = iter(sampler)
    return [next(iterator) for _ in range(count)]


def global_batches(num_samples, batch, seed, world_size, epochs):
    """[epochs * batches_per_epoch, batch]: the global batches as the ranks of `world_size` see them together."""
    samplers = [GlobalOrderSampler(num_samples, batch, seed, rank, world_size) for rank in range(world_size)]
    per_rank = [np.array(take(s, epochs * len(s))).reshape(-1, batch // world_size) for s in samplers]
    return np.concatenate(per_rank, axis=1)


@pytest.mark.parametrize("world_size", [1, 2, 4, 8])
def test_global_batches_do_not_depend_on_world_size(world_size):
    reference = global_batches(42, 8, seed=3, world_size=1, epochs=3)
    assert np.array_equal(global_batches(42, 8, seed=3, world_size=world_size, epochs=3), reference)


def test_epoch_is_a_permutation_minus_the_dropped_remainder():
    sampler = GlobalOrderSampler(42, 8, seed=1)
    assert sampler.batches_per_epoch == 5 and len(sampler) == 40
    seen = np.array(take(sampler, 3 * 40)).reshape(3, 40)
    for epoch, indices in enumerate(seen):
        assert len(set(indices.tolist())) == 40  # nothing twice within an epoch
        expected = np.random.default_rng((1, epoch)).permutation(42)[:40]
        assert np.array_equal(indices, expected)
    dropped = [set(range(42)) - set(row.tolist()) for row in seen]
    assert all(len(d) == 2 for d in dropped)
    assert dropped[0] != dropped[1] or dropped[1] != dropped[2]  # the remainder moves from epoch to epoch
    assert not np.array_equal(seen[0], seen[1])


def test_seed_changes_the_order_and_is_reproducible():
    a = take(GlobalOrderSampler(100, 10, seed=0), 100)
    assert a == take(GlobalOrderSampler(100, 10, seed=0), 100)
    assert a != take(GlobalOrderSampler(100, 10, seed=1), 100)


@pytest.mark.parametrize("world_size", [2, 4])
def test_every_rank_gets_the_same_count_and_contiguous_slices(world_size):
    samplers = [GlobalOrderSampler(50, 8, seed=0, rank=r, world_size=world_size) for r in range(world_size)]
    assert len({len(s) for s in samplers}) == 1
    batch0 = samplers[0].global_batch(0, 0)
    width = 8 // world_size
    for rank, sampler in enumerate(samplers):
        assert take(sampler, width) == batch0[rank * width:(rank + 1) * width].tolist()


def test_refuses_world_size_that_does_not_divide_the_global_batch():
    with pytest.raises(UserError, match="not divisible by world size 3"):
        GlobalOrderSampler(100, 8, seed=0, rank=0, world_size=3)
    with pytest.raises(UserError, match="fewer than one global batch"):
        GlobalOrderSampler(7, 8, seed=0)
    with pytest.raises(ValueError):
        GlobalOrderSampler(100, 8, seed=0, rank=2, world_size=2)


@pytest.mark.parametrize("stop", [0, 1, 7, 39, 40, 41, 85])
def test_state_resumes_exactly_at_the_same_world_size(stop):
    """Any stop (even inside a rank's slice) resumes exactly when the world size is unchanged."""
    full = take(GlobalOrderSampler(42, 8, seed=5, rank=1, world_size=2), 120)
    first = GlobalOrderSampler(42, 8, seed=5, rank=1, world_size=2)
    head = take(first, stop)
    state = json.loads(json.dumps(first.state_dict()))  # what a checkpoint stores
    assert set(state) == {"seed", "epoch", "consumed_samples"}
    second = GlobalOrderSampler(42, 8, seed=999, rank=1, world_size=2)  # the state's seed wins
    second.load_state_dict(state)
    assert head + take(second, 120 - stop) == full


def test_state_at_epoch_end_continues_with_next_epoch():
    sampler = GlobalOrderSampler(42, 8, seed=0)
    take(sampler, 40)
    # the generator has not yet stepped into epoch 1, so the state reads "all of epoch 0 consumed"
    state = sampler.state_dict()
    assert state == {"seed": 0, "epoch": 0, "consumed_samples": 40}
    resumed = GlobalOrderSampler(42, 8, seed=0)
    resumed.load_state_dict(state)
    assert (resumed.epoch, resumed.rank_position) == (1, 0)
    assert take(resumed, 8) == np.random.default_rng((0, 1)).permutation(42)[:8].tolist()


@pytest.mark.parametrize("new_world_size", [1, 2, 4, 8])
def test_boundary_state_resumes_at_another_world_size(new_world_size):
    old = [GlobalOrderSampler(42, 8, seed=2, rank=r, world_size=2) for r in range(2)]
    for s in old:
        take(s, 3 * 4)  # three global batches
    states = [s.state_dict() for s in old]
    assert states[0] == states[1] == {"seed": 2, "epoch": 0, "consumed_samples": 24}
    new = [GlobalOrderSampler(42, 8, seed=2, rank=r, world_size=new_world_size) for r in range(new_world_size)]
    for s in new:
        s.load_state_dict(states[0])
    width = 8 // new_world_size
    got = np.concatenate([np.array(take(s, 4 * width)).reshape(4, width) for s in new], axis=1)
    expected = global_batches(42, 8, seed=2, world_size=1, epochs=2)[3:7]
    assert np.array_equal(got, expected)


def test_mid_batch_state_is_refused_where_it_cannot_be_exact():
    sampler = GlobalOrderSampler(42, 8, seed=0, world_size=4, rank=0)
    with pytest.raises(UserError, match="optimizer step"):
        sampler.load_state_dict({"seed": 0, "epoch": 0, "consumed_samples": 10})
    with pytest.raises(UserError):
        sampler.load_state_dict({"seed": 0, "epoch": -1, "consumed_samples": 0})


def test_another_thread_never_sees_a_new_epoch_with_the_old_ones_position():
    """The remote mode's prefetch thread reads `state_dict()` while the consumer moves the position; at an epoch's
    turn it once saw the next epoch at the finished one's position, took that epoch's shards for read and evicted
    them while the loader workers read them (the cache went over its limit). Here epoch e is left at position
    E - e, so such a mix, (e + 1, E - e), is never a state the consumer was in; the interpreter switches threads
    every microsecond to make the old race show within the test."""
    import sys
    import threading
    import time

    epochs = 60
    current = [GlobalOrderSampler(100, 1, seed=0)]
    seen, stop = [], threading.Event()

    def observe():
        while not stop.is_set():
            state = current[0].state_dict()
            seen.append((state["epoch"], state["consumed_samples"]))

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    observer = threading.Thread(target=observe)
    observer.start()
    # On a loaded two-core machine one pass can end before the observer has run much: pass again, each time on a
    # fresh sampler, until it has seen enough states to have met an epoch's turn many times.
    deadline = time.monotonic() + 30.0
    try:
        while len(seen) < 2000 and time.monotonic() < deadline:
            sampler = GlobalOrderSampler(100, 1, seed=0)
            current[0] = sampler
            for epoch in range(epochs):
                for position in range(epochs - epoch + 1):
                    sampler.rank_position = position
                sampler.next_epoch()
    finally:
        stop.set()
        observer.join()
        sys.setswitchinterval(interval)
    assert len(seen) > 100
    mixed = [(e, p) for e, p in seen if p > epochs - e]
    assert not mixed, mixed[:5]
