"""The shard loader: a shard set (local or `s3://`) read as memory-mapped examples in one resumable global order.

    from pretrain.data.dataset import ShardDataset; from pretrain.data.loader import make_loader

- `dataset.py`: `ShardDataset`, the zero-copy map-style dataset over a shard set.
- `sampler.py`: `GlobalOrderSampler`, the world-size-independent order and its exact state.
- `loader.py`: `ShardLoader` / `make_loader`, micro-batches forever through a torch DataLoader.
- `storage.py`: `resolve_shard_dir`, an `s3://` (fsspec) shard set as a checked local cache (no torch).
"""
