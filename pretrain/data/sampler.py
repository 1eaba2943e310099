"""GlobalOrderSampler: one order of a shard set's samples per epoch, the same at every world size, with exact state.

    sampler = GlobalOrderSampler(num_samples=40, global_batch_size=8, seed=0, rank=1, world_size=2)

The order of epoch e comes from (seed, e) alone; global batch k is perm[k*B:(k+1)*B] at every world size and
rank r reads the r-th contiguous slice of it. The remainder `num_samples % B` of each epoch's permutation is
dropped (a different remainder every epoch).

State: {"seed", "epoch", "consumed_samples"} where consumed_samples counts the global samples of `epoch`
already consumed (k*B after k global batches). Only states at a global-batch boundary resume at another world
size; a mid-batch state (k*B + q*world_size: every rank took q samples of its slice) resumes at the same one.
"""

from __future__ import annotations

from typing import Any, Iterator

import numpy as np
from torch.utils.data import Sampler

from pipeline.common import UserError


class GlobalOrderSampler(Sampler[int]):
    """This rank's sample indices, global batch after global batch, epoch after epoch (forever).

    Epoch e's order is `np.random.default_rng((seed, e)).permutation(num_samples)`, cut into
    num_samples // global_batch_size global batches (the remainder is dropped); rank r takes the r-th
    contiguous slice of global_batch_size // world_size indices of each. Iterating advances the state.
    """

    def __init__(self, num_samples: int, global_batch_size: int, seed: int, rank: int = 0, world_size: int = 1):
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is not in [0, world_size={world_size})")
        if global_batch_size < 1 or global_batch_size % world_size:
            raise UserError(f"global batch {global_batch_size} is not divisible by world size {world_size}; "
                            f"pick a --global-batch that is a multiple of the number of ranks")
        if num_samples < global_batch_size:
            raise UserError(f"the shard set has {num_samples} examples, fewer than one global batch of "
                            f"{global_batch_size}; lower --global-batch or prepare more data")
        self.num_samples = int(num_samples)
        self.global_batch_size = int(global_batch_size)
        self.seed = int(seed)
        self.rank = int(rank)
        self.world_size = int(world_size)
        self.rank_batch_size = self.global_batch_size // self.world_size
        self.batches_per_epoch = self.num_samples // self.global_batch_size
        # (epoch, indices of it this rank has yielded, over all its slices) in one attribute: the remote mode's
        # prefetch thread reads the position while the consumer moves it, and an epoch's turn must not show it
        # a new epoch with the old one's position (it would evict the shards being read)
        self._at = (0, 0)

    @property
    def epoch(self) -> int:
        """Read-only: an epoch moves on only by `next_epoch` (or `load_state_dict`), with its position."""
        return self._at[0]

    @property
    def rank_position(self) -> int:
        return self._at[1]

    @rank_position.setter
    def rank_position(self, value: int) -> None:
        self._at = (self._at[0], int(value))

    def next_epoch(self) -> None:
        """Position 0 of the next epoch, in one step (see `_at`)."""
        self._at = (self._at[0] + 1, 0)

    def epoch_order(self, epoch: int) -> np.ndarray:
        """All samples in the order of `epoch`: a permutation seeded by (seed, epoch)."""
        return np.random.default_rng((self.seed, int(epoch))).permutation(self.num_samples)

    def epoch_indices(self, epoch: int) -> np.ndarray:
        """This rank's indices of `epoch` as [batches_per_epoch, rank_batch_size] (row k: its slice of batch k)."""
        order = self.epoch_order(epoch)
        batches = order[: self.batches_per_epoch * self.global_batch_size].reshape(self.batches_per_epoch, -1)
        start = self.rank * self.rank_batch_size
        return batches[:, start:start + self.rank_batch_size]

    def global_batch(self, epoch: int, k: int) -> np.ndarray:
        """All B indices of global batch k of `epoch` (what every world size agrees on)."""
        return self.epoch_order(epoch)[k * self.global_batch_size:(k + 1) * self.global_batch_size]

    def __len__(self) -> int:
        """Indices per epoch on this rank."""
        return self.batches_per_epoch * self.rank_batch_size

    def __iter__(self) -> Iterator[int]:
        while True:
            flat = self.epoch_indices(self.epoch).reshape(-1)
            while self.rank_position < flat.size:
                index = int(flat[self.rank_position])
                self.rank_position += 1
                yield index
            self.next_epoch()

    def state_dict(self) -> dict[str, int]:
        epoch, position = self._at
        full, partial = divmod(position, self.rank_batch_size)
        return {"seed": self.seed, "epoch": epoch,
                "consumed_samples": full * self.global_batch_size + partial * self.world_size}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from `state` (the seed comes from the state: a resumed run keeps the saved order)."""
        seed, epoch, consumed = int(state["seed"]), int(state["epoch"]), int(state["consumed_samples"])
        full, partial = divmod(consumed, self.global_batch_size)
        if epoch < 0 or consumed < 0 or partial % self.world_size:
            raise UserError(f"sampler state {dict(state)} does not fit global batch {self.global_batch_size} at "
                            f"world size {self.world_size}; resume from a checkpoint saved after an optimizer "
                            f"step, with the same --global-batch")
        epoch += full // self.batches_per_epoch  # a state at the very end of an epoch continues in the next
        full %= self.batches_per_epoch
        self.seed = seed
        self._at = (epoch, full * self.rank_batch_size + partial // self.world_size)


class ShardOrderSampler(GlobalOrderSampler):
    """A GlobalOrderSampler whose epoch order walks the shards one after another (for shard sets streamed from
    object storage: a shard is fetched once, read, then evicted). Epoch e: the shards in the order
    `default_rng((seed, e)).permutation(n_shards)`, each shard's rows permuted by `default_rng((seed, e, shard))`.
    Batches, rank slices and state are GlobalOrderSampler's (world-size independent, exact resume)."""

    def __init__(self, shard_rows, global_batch_size: int, seed: int, rank: int = 0, world_size: int = 1):
        self.shard_rows = np.asarray(shard_rows, dtype=np.int64)
        self.shard_offsets = np.concatenate([[0], np.cumsum(self.shard_rows)]).astype(np.int64)
        super().__init__(int(self.shard_rows.sum()), global_batch_size, seed, rank=rank, world_size=world_size)

    def shard_sequence(self, epoch: int) -> np.ndarray:
        """The shards in the order epoch `epoch` reads them."""
        return np.random.default_rng((self.seed, int(epoch))).permutation(len(self.shard_rows))

    def epoch_order(self, epoch: int) -> np.ndarray:
        parts = [self.shard_offsets[s] + np.random.default_rng((self.seed, int(epoch), int(s))).permutation(
            int(self.shard_rows[s])) for s in self.shard_sequence(epoch)]
        return np.concatenate(parts)

    def shards_ahead(self, epoch: int, consumed_samples: int) -> tuple[list[int], list[int]]:
        """(shards already read, in order; shards still to read, in order) of `epoch` once `consumed_samples` global
        samples of it are consumed (the shard holding the next sample comes first among those to read)."""
        sequence = [int(s) for s in self.shard_sequence(epoch)]
        ends = np.cumsum(self.shard_rows[sequence])
        first_open = int(np.searchsorted(ends, consumed_samples, side="right"))
        return sequence[:first_open], sequence[first_open:]
