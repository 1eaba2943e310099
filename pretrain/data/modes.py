"""The loader modes (`TrainConfig.loader`): one call builds this rank's loader, one describes the data to the preflight.

    loader = open_loader(config, rank=0, world_size=2, global_batch=64, pin_memory=True, token_limit=32128)

- `shards`: a local shard set (or an `s3://` one copied whole into the cache first), `ShardDataset` +
  `GlobalOrderSampler` (memory-mapped, global order, elastic resume).
- `online`: `pretrain.data.online`: raw text read, tokenised and span-corrupted in the DataLoader workers.
- `remote`: an `s3://` shard set streamed through a bounded cache (`storage.ShardStreamer`), shard after shard
  (`ShardOrderSampler`), `remote_prefetch_shards` ahead, at most `cache_max_gib` kept.
"""

from __future__ import annotations

from typing import Any

GIB = 1 << 30


def online_source_for(config):
    from pretrain.data.online import online_source

    return online_source(config.data, tokenizer=config.tokenizer, input_length=config.input_length,
                         noise_density=config.noise_density, mean_span_length=config.mean_span_length,
                         unit_bytes=config.unit_bytes, text_field=config.text_field, seed=config.seed)


def describe_data(config) -> dict[str, Any]:
    """What the preflight checks, per mode, without making a loader: {manifest (tokenizer + config sections),
    where, num_examples (None: made on the fly), fingerprint, input_length, target_length, shards}."""
    if config.loader == "online":
        source = online_source_for(config)
        if config.target_length is not None and config.target_length != source.target_length:
            from pipeline.common import UserError
            raise UserError(f"{source.origin}: --loader online makes target_length {source.target_length} at input "
                            f"length {source.input_length}, the run expects {config.target_length}; drop "
                            f"--target-length or change the span settings")
        return {"manifest": source.manifest_view(), "where": source.origin, "num_examples": None,
                "fingerprint": source.fingerprint, "input_length": source.input_length,
                "target_length": source.target_length, "units": len(source.units)}
    if config.loader == "remote":
        from pretrain.data.storage import read_remote_manifest

        manifest = read_remote_manifest(config.data)
        lengths = manifest["config"]
        from pretrain.data.dataset import ShardDataset
        ShardDataset.check_lengths_of(manifest, f"{config.data}/manifest.json", config.input_length,
                                      config.target_length)
        return {"manifest": manifest, "where": f"{config.data}/manifest.json",
                "num_examples": sum(int(s["rows"]) for s in manifest["shards"]),
                "fingerprint": str(manifest["fingerprint"]), "input_length": int(lengths["input_length"]),
                "target_length": int(lengths["target_length"])}
    from pretrain.data.dataset import ShardDataset

    dataset = ShardDataset(config.data, input_length=config.input_length, target_length=config.target_length,
                           cache_dir=config.cache_dir, verify=config.verify)
    return {"manifest": dataset.manifest, "where": f"{dataset.root}/manifest.json", "num_examples": len(dataset),
            "fingerprint": str(dataset.manifest["fingerprint"]), "input_length": dataset.input_length,
            "target_length": dataset.target_length}


def open_loader(config, *, rank: int, world_size: int, global_batch: int, pin_memory: bool,
                token_limit: int | None = None, worker_cores: list[list[int]] | None = None):
    """This rank's loader for `config.loader` (ShardLoader or OnlineLoader), not yet iterating."""
    common = dict(micro_batch_size=config.micro_batch, global_batch_size=global_batch, seed=config.seed, rank=rank,
                  world_size=world_size, num_workers=config.loader_workers, pin_memory=pin_memory,
                  prefetch_factor=config.prefetch_factor, persistent_workers=True, worker_cores=worker_cores)
    if config.loader == "online":
        from pretrain.data.online import OnlineLoader

        return OnlineLoader(online_source_for(config), **common)
    from pretrain.data.dataset import ShardDataset
    from pretrain.data.loader import make_loader

    streamer = None
    if config.loader == "remote":
        from pretrain.data.storage import ShardStreamer

        streamer = ShardStreamer(config.data, cache_dir=config.cache_dir, prefetch=config.remote_prefetch_shards,
                                 max_bytes=None if config.cache_max_gib is None else int(config.cache_max_gib * GIB))
    dataset = ShardDataset(config.data, input_length=config.input_length, target_length=config.target_length,
                           cache_dir=config.cache_dir, streamer=streamer)
    dataset.token_limit = token_limit
    return make_loader(dataset, **common)
