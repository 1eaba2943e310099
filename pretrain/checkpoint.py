"""Checkpoints that are either complete or ignored: DeepSpeed state + loader state + RNG + run config.

    save_checkpoint(engine, run_dir / "checkpoints", step, client_state, rank=0, world_size=2)
    tag = latest_complete(run_dir / "checkpoints")     # "step-00000010" or None

Layout: checkpoints/step-SSSSSSSS/ holds DeepSpeed's files (model, optimizer and scheduler state, per ZeRO
partition), `rng-rank-R.pt` per rank (torch, numpy and python RNG states), and COMPLETE.json, written by
rank 0 last, after every rank has finished writing (a barrier). `checkpoints/latest` names the newest tag and
is rewritten (atomically) after the marker. A tag directory without COMPLETE.json is a checkpoint that was
killed half-way: it is never resumed from, and the next save of that step replaces it.

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


def latest_complete(checkpoint_dir: str | Path) -> str | None:
    """Newest tag with its COMPLETE.json marker; half-written tags are skipped."""
    root = Path(checkpoint_dir)
    if not root.is_dir():
        return None
    tags = sorted((p for p in root.glob("step-*") if p.is_dir() and is_complete(p)), key=lambda p: p.name)
    return tags[-1].name if tags else None


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
                                             "loader": client_state.get("loader")})
        atomic_write_bytes(root / LATEST, tag.encode())
    barrier()
    return tag_dir


def saved_world_size(tag_dir: Path) -> int:
    return int(json.loads((Path(tag_dir) / MARKER).read_text())["world_size"])


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
