"""Checkpoints that are either complete or ignored: DeepSpeed state + loader state + RNG + run config.

    save_checkpoint(engine, run_dir / "checkpoints", step, client_state, rank=0, world_size=2)
    tag = latest_complete(run_dir / "checkpoints")     # "step-00000010" or None

Layout: checkpoints/step-SSSSSSSS/ holds DeepSpeed's files (model, optimizer and scheduler state, per ZeRO
partition), `rng-rank-R.pt` per rank (torch, numpy and python RNG states), and COMPLETE.json, written by
rank 0 last, after every rank has finished writing (a barrier): step, world size, loader state, the run's
settings and shard fingerprint, and every file of the tag with its size. `checkpoints/latest` names the newest
tag and is rewritten (atomically) after the marker. A tag directory without COMPLETE.json is a checkpoint that
was killed half-way: it is never resumed from, and the next save of that step replaces it. A tag whose files
no longer match the sizes in its marker (truncated, deleted) is reported by `tag_problem`, naming the file,
and `--resume` falls back to the previous complete tag. `prune` keeps the newest K complete tags.

Another world size at ZeRO 1-3 (the optimizer state, and at stage 3 the weights, are partitioned per rank):
rank 0 converts the tag once with DeepSpeed's `ds_to_universal` into checkpoints/universal/step-SSSSSSSS/
(written under a temporary name, renamed into place, its own COMPLETE.json last), and the engine, configured
with `checkpoint: {load_universal: true}`, loads that at the new partitioning. ZeRO 0 checkpoints (whole
optimizer state in every rank's view) load directly at any world size.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import random
import shutil
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from pipeline.common import UserError, atomic_write_bytes, atomic_write_json

MARKER = "COMPLETE.json"
LATEST = "latest"
UNIVERSAL = "universal"      # checkpoints/universal/<tag>: converted copies


def tag_for(step: int) -> str:
    return f"step-{step:08d}"


def is_complete(tag_dir: Path) -> bool:
    return (tag_dir / MARKER).is_file()


def step_of(tag: str) -> int:
    return int(tag.split("-", 1)[1])


def complete_tags(checkpoint_dir: str | Path) -> list[str]:
    """Tags with their COMPLETE.json marker, newest first; half-written tags are left out."""
    root = Path(checkpoint_dir)
    if not root.is_dir():
        return []
    return sorted((p.name for p in root.glob("step-*") if p.is_dir() and is_complete(p)), reverse=True)


def latest_complete(checkpoint_dir: str | Path) -> str | None:
    """Newest tag with its COMPLETE.json marker; half-written tags are skipped."""
    tags = complete_tags(checkpoint_dir)
    return tags[0] if tags else None


def read_marker(tag_dir: Path) -> dict[str, Any]:
    return json.loads((Path(tag_dir) / MARKER).read_text())


def tag_files(tag_dir: Path) -> dict[str, int]:
    """Every file of a tag (relative path -> bytes), the marker left out."""
    tag_dir = Path(tag_dir)
    return {str(p.relative_to(tag_dir)): p.stat().st_size for p in sorted(tag_dir.rglob("*"))
            if p.is_file() and p.name != MARKER}


def tag_problem(checkpoint_dir: str | Path, tag: str) -> str | None:
    """Why complete tag `tag` cannot be loaded as it stands (a file missing, or not the size its marker records:
    truncated or replaced), naming the file; None when every file is there at its size. A marker of an older
    format (without file sizes, or unreadable) is reported too when it cannot be read."""
    tag_dir = Path(checkpoint_dir) / tag
    try:
        marker = read_marker(tag_dir)
    except (OSError, ValueError) as err:
        return f"{tag_dir / MARKER} cannot be read ({type(err).__name__})"
    for name, size in sorted((marker.get("files") or {}).items()):
        path = tag_dir / name
        if not path.is_file():
            return f"{path} is missing"
        have = path.stat().st_size
        if have != size:
            return f"{path} is {have} bytes, {size} when saved ({'truncated' if have < size else 'replaced'})"
    return None


def prune(checkpoint_dir: str | Path, keep: int, *, protect: tuple[str, ...] = (), say=print) -> list[str]:
    """Delete all but the newest `keep` complete tags (and their universal conversions), never one in `protect`
    (the tag this launch resumed from). keep 0: keep everything. Returns the deleted tags. Rank 0 only."""
    if keep <= 0:
        return []
    root = Path(checkpoint_dir)
    doomed = [tag for tag in complete_tags(root)[keep:] if tag not in protect]
    for tag in doomed:
        _delete_tag(root, tag)
    if doomed:
        say(f"[checkpoint] --keep-checkpoints {keep}: deleted {', '.join(doomed)}")
    return doomed


def drop_after(checkpoint_dir: str | Path, step: int, *, say=print) -> list[str]:
    """Delete the complete tags after `step` (a rollback to `step` leaves them on another timeline). Rank 0 only."""
    root = Path(checkpoint_dir)
    doomed = [tag for tag in complete_tags(root) if step_of(tag) > step]
    for tag in doomed:
        _delete_tag(root, tag)
    if doomed:
        say(f"[checkpoint] rolled back to {tag_for(step)}: deleted the later {', '.join(doomed)}")
    return doomed


def _delete_tag(root: Path, tag: str) -> None:
    (root / tag / MARKER).unlink()      # first: a deletion cut short leaves a half-written tag, never resumed
    shutil.rmtree(root / tag)
    if universal_dir(root, tag).exists():
        shutil.rmtree(universal_dir(root, tag))


def rng_state() -> dict[str, Any]:
    """Global RNG states (torch CPU/CUDA, numpy, python); saved so a resumed run continues identically even
    for code that draws from them (this trainer draws only from explicit generators)."""
    state = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_checkpoint(engine, checkpoint_dir: str | Path, step: int, client_state: dict[str, Any], *, rank: int,
                    world_size: int, barrier) -> Path:
    """Write checkpoint `step` on every rank; rank 0 writes the marker and `latest` last. Returns the tag dir."""
    root = Path(checkpoint_dir)
    tag = tag_for(step)
    tag_dir = root / tag
    if rank == 0:
        if tag_dir.exists():        # a half-written (or superseded) save of the same step
            shutil.rmtree(tag_dir)
        root.mkdir(parents=True, exist_ok=True)
    barrier()
    engine.save_checkpoint(str(root), tag=tag, client_state=client_state, save_latest=False)
    buffer = io.BytesIO()
    torch.save(rng_state(), buffer)
    atomic_write_bytes(tag_dir / f"rng-rank-{rank}.pt", buffer.getvalue())
    barrier()
    if rank == 0:
        atomic_write_json(tag_dir / MARKER, {"step": step, "world_size": world_size, "time": time.time(),
                                             "loader": client_state.get("loader"),
                                             "train": client_state.get("train_config"),
                                             "shard_fingerprint": client_state.get("shard_fingerprint"),
                                             "files": tag_files(tag_dir)})
        atomic_write_bytes(root / LATEST, tag.encode())
    barrier()
    return tag_dir


def saved_world_size(tag_dir: Path) -> int:
    return int(read_marker(tag_dir)["world_size"])


def needs_universal(checkpoint_dir: str | Path, tag: str, *, world_size: int, zero_stage: int) -> bool:
    """True when `tag` holds ZeRO 1-3 partitions of another world size (a universal conversion is needed)."""
    return zero_stage > 0 and saved_world_size(Path(checkpoint_dir) / tag) != world_size


def universal_dir(checkpoint_dir: str | Path, tag: str) -> Path:
    return Path(checkpoint_dir) / UNIVERSAL / tag


def convert_to_universal(checkpoint_dir: str | Path, tag: str, *, say=print) -> Path:
    """Convert checkpoint `tag` with DeepSpeed's ds_to_universal (once: a complete conversion is reused) into
    checkpoints/universal/<tag>; atomic: a temporary folder renamed into place, COMPLETE.json written last.
    Run on one rank only. Returns the converted tag dir."""
    from deepspeed.checkpoint.ds_to_universal import main as ds_to_universal

    source = Path(checkpoint_dir) / tag
    target = universal_dir(checkpoint_dir, tag)
    marker = json.loads((source / MARKER).read_text())
    if is_complete(target) and json.loads((target / MARKER).read_text()).get("source_time") == marker["time"]:
        return target                        # converted before from this very save (not an older one of the tag)
    partial = target.parent / f".{tag}.partial-{os.getpid()}"
    for stale in [target, *target.parent.glob(f".{tag}.partial-*")]:
        if stale.exists():                   # killed half-way, or converted from an older save of the tag
            shutil.rmtree(stale)
    target.parent.mkdir(parents=True, exist_ok=True)
    say(f"[resume] converting {source} (saved by {saved_world_size(source)} ranks) to a universal checkpoint "
        f"-> {target}")
    started = time.time()
    args = argparse.Namespace(input_folder=str(source), output_folder=str(partial), num_extract_workers=1,
                              num_merge_workers=1, keep_temp_folder=False, strict=True, inject_missing_state=True)
    with contextlib.redirect_stdout(io.StringIO()):      # its per-phase prints and progress bars
        ds_to_universal(args)
    os.replace(partial, target)
    atomic_write_json(target / MARKER, {**marker, "converted_from": str(source), "source_time": marker["time"],
                                        "time": time.time(),
                                        "convert_s": round(time.time() - started, 3)})
    atomic_write_bytes(target.parent / "latest_universal", tag.encode())   # ds_to_universal wrote the temp name
    return target


def load_checkpoint(engine, checkpoint_dir: str | Path, tag: str, *, rank: int, world_size: int) -> dict[str, Any]:
    """Load model/optimizer/scheduler state of `tag` into `engine`; returns the client state. RNG states are
    restored when the world size is the one the checkpoint was saved at. A ZeRO 1-3 checkpoint of another
    world size is read from its universal conversion (`convert_to_universal`, done before), which needs an
    engine configured with `checkpoint: {load_universal: true}`."""
    root = Path(checkpoint_dir)
    tag_dir = root / tag
    if not is_complete(tag_dir):
        raise UserError(f"{tag_dir}: checkpoint has no {MARKER} (written half-way); it cannot be resumed from")
    saved_world = saved_world_size(tag_dir)
    zero_stage = engine.zero_optimization_stage()
    load_root = root
    if needs_universal(root, tag, world_size=world_size, zero_stage=zero_stage):
        if not engine.load_universal_checkpoint():
            raise UserError(f"{tag_dir}: saved by {saved_world} ranks at ZeRO {zero_stage}, resumed with "
                            f"{world_size}; ZeRO {zero_stage} partitions are per rank: resume with --nproc "
                            f"{saved_world}; ZeRO 0 checkpoints resume at any rank count")
        if not is_complete(universal_dir(root, tag)):
            raise UserError(f"{universal_dir(root, tag)}: universal conversion of {tag} is missing or incomplete; "
                            f"delete it and --resume again")
        load_root = root / UNIVERSAL
    path, client_state = engine.load_checkpoint(str(load_root), tag=tag, load_optimizer_states=True,
                                                load_lr_scheduler_states=True)
    if path is None:
        raise UserError(f"{load_root / tag}: DeepSpeed could not load this checkpoint; check the files or delete "
                        f"the tag")
    rng_file = tag_dir / f"rng-rank-{rank}.pt"
    if saved_world == world_size and rng_file.is_file():
        set_rng_state(torch.load(rng_file, weights_only=False))
    return client_state or {}


# -- what a resume may change -----------------------------------------------------------------------------------
# Settings that only shape this launch (ranks, loader, logging, checkpoint cadence, checks, how the same math is
# computed): a resume may change them freely. The data is compared by its shard fingerprint (a moved set is the
# same set) and the batch by the resolved global batch (micro batch x accumulation x ranks may be re-cut).
RESUME_FREE = frozenset({
    "data", "out", "nproc", "loader_workers", "prefetch_factor", "log_every", "steady_skip", "profile_steps",
    "stop_after", "save_every", "save_final", "keep_checkpoints", "resume", "resume_allow", "export_hf", "force",
    "verify", "cache_dir", "peak_tflops", "tokenizer", "input_length", "target_length", "compile", "cudagraphs",
    "activation_checkpointing", "stage3_prefetch_bucket_size", "stage3_param_persistence_threshold",
    "stage3_max_live_parameters", "stage3_max_reuse_distance", "stage3_gather_unit", "stage3_module_hooks",
    "nvme_path", "micro_batch", "global_batch", "spike_sigmas", "spike_window", "rollback_after", "debug_nan_batches",
    "debug_spike_batches", "max_restarts", "rank_timeout", "remote_prefetch_shards", "cache_max_gib", "omp_num_threads",
    "cpu_affinity", "optimizer_step"})
# What the checkpoint's tensors are: another value cannot be loaded (another ZeRO stage's partitions, another
# offload's optimizer layout and another precision are not converted here).
RESUME_FIXED = frozenset({"model", "model_overrides", "vocab_size", "zero", "offload", "precision"})
# The rest (steps, schedule, lr, optimizer hyper-parameters, seed, raw deepspeed keys, another data set) changes
# the training itself: refused unless named in --resume-allow, which makes the new values apply from the resumed
# step on (the saved schedule and optimizer settings are replaced).


def resume_differences(saved: dict[str, Any], new: dict[str, Any], *, allow: list[str] | tuple[str, ...] = ()
                       ) -> tuple[list[str], list[str]]:
    """Compare a run's saved settings with a resume's. `saved` / `new`: {"train": TrainConfig as a dict,
    "shard_fingerprint", "global_batch"}. Returns (refused, allowed_changes): each a list of
    "name saved -> new" for the settings that differ, split by whether the resume may go on."""
    refused, allowed = [], []
    saved_train, new_train = saved.get("train") or {}, new["train"]

    def differs(name: str, old: Any, value: Any) -> None:
        change = f"{name} {old!r} -> {value!r}"
        if name in RESUME_FIXED or name not in allow:
            refused.append(change)
        else:
            allowed.append(change)

    for name, value in sorted(new_train.items()):
        if name in RESUME_FREE or name not in saved_train or saved_train[name] == value:
            continue
        differs(name, saved_train[name], value)
    if saved.get("shard_fingerprint") and saved["shard_fingerprint"] != new["shard_fingerprint"]:
        differs("data", f"{saved_train.get('data')} (fingerprint {saved['shard_fingerprint'][:12]})",
                f"{new_train.get('data')} (fingerprint {new['shard_fingerprint'][:12]})")
    if saved.get("global_batch") and int(saved["global_batch"]) != int(new["global_batch"]):
        refused.append(f"global batch {saved['global_batch']} -> {new['global_batch']}")
    return refused, allowed


def resume_refusal(run_dir: Path, refused: list[str]) -> str:
    """The one line that refuses a resume whose settings differ from the saved run's."""
    fixed = [change for change in refused if change.split()[0] in RESUME_FIXED or change.startswith("global batch")]
    hint = ("resume with the saved values" + ("" if len(fixed) == len(refused) else
            ", or name the others in --resume-allow (e.g. --resume-allow steps schedule) to train on with them"))
    return (f"{run_dir}: --resume with other settings than the saved run's: {'; '.join(refused)}; {hint}. "
            f"A resume may change the rank count, loader workers, logging and checkpoint settings freely; "
            f"model, zero, offload, precision and the global batch never")
