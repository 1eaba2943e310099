"""Checkpoints that are either complete or ignored: DeepSpeed state + loader state + RNG + run config.

    save_checkpoint(engine, run_dir / "checkpoints", step, client_state, rank=0, world_size=2)
    tag = latest_complete(run_dir / "checkpoints")     # "step-00000010" or None

Layout: checkpoints/step-SSSSSSSS/ holds DeepSpeed's files (model, optimizer and scheduler state, per ZeRO
partition), `rng-rank-R.pt` per rank (torch, numpy and python RNG states), and COMPLETE.json, written by
rank 0 last, after every rank has finished writing (a barrier). `checkpoints/latest` names the newest tag and
is rewritten (atomically) after the marker. A tag directory without COMPLETE.json is a checkpoint that was
killed half-way: it is never resumed from, and the next save of that step replaces it.
"""

from __future__ import annotations

import io
import json
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


def load_checkpoint(engine, checkpoint_dir: str | Path, tag: str, *, rank: int, world_size: int) -> dict[str, Any]:
    """Load model/optimizer/scheduler state of `tag` into `engine`; returns the client state. RNG states are
    restored when the world size is the one the checkpoint was saved at."""
    root = Path(checkpoint_dir)
    tag_dir = root / tag
    if not is_complete(tag_dir):
        raise UserError(f"{tag_dir}: checkpoint has no {MARKER} (written half-way); it cannot be resumed from")
    marker = json.loads((tag_dir / MARKER).read_text())
    saved_world = int(marker["world_size"])
    zero_stage = engine.zero_optimization_stage()
    if saved_world != world_size and zero_stage > 0:
        raise UserError(f"{tag_dir}: saved by {saved_world} ranks at ZeRO {zero_stage}, resumed with {world_size}; "
                        f"ZeRO {zero_stage} partitions are per rank: resume with --nproc {saved_world} (or convert it "
                        f"with DeepSpeed's ds_to_universal.py first); ZeRO 0 checkpoints resume at any rank count")
    path, client_state = engine.load_checkpoint(str(root), tag=tag, load_optimizer_states=True,
                                                load_lr_scheduler_states=True)
    if path is None:
        raise UserError(f"{tag_dir}: DeepSpeed could not load this checkpoint; check the files or delete the tag")
    rng_file = tag_dir / f"rng-rank-{rank}.pt"
    if saved_world == world_size and rng_file.is_file():
        set_rng_state(torch.load(rng_file, weights_only=False))
    return client_state or {}
