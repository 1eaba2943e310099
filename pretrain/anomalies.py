"""Skipping bad optimizer steps: non-finite or spiking loss / gradient norm, and the rollback after a streak.

    guard = StepGuard(sigmas=6.0, window=100, rollback_after=3)
    reason = guard.verdict(loss, grad_norm)       # None: apply the update; else why it is skipped
    guard.record(step, global_batch, reason, loss, grad_norm)
    guard.streak                                  # skipped steps in a row (>= rollback_after: roll back)

Every rank holds the same guard and feeds it the same numbers (the loss all-reduced over ranks, DeepSpeed's
global gradient norm), so all ranks reach the same verdict without another collective. The window holds the
losses and gradient norms of the last `window` accepted steps; a value more than `sigmas` standard deviations
above the window's mean is a spike (only once the window is full). Its state (window, streak and the history
of skips and rollbacks) travels in the checkpoint's client state, so a resumed run judges exactly as an
uninterrupted one. No torch here: the trainer (`pretrain.trainer`) does the skipping.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from typing import Any

NONFINITE_LOSS = "nonfinite_loss"
NONFINITE_GRAD_NORM = "nonfinite_grad_norm"
LOSS_SPIKE = "loss_spike"
GRAD_NORM_SPIKE = "grad_norm_spike"
MAX_ROLLBACKS = 10          # per launch: a run that keeps diverging stops instead of looping over the data
DEBUG_SPIKE_FACTOR = 1000.0  # --debug-spike-batches multiplies the loss by this


class StepGuard:
    """The verdict on each optimizer step and the record of the skipped ones (see the module docstring)."""

    def __init__(self, *, sigmas: float, window: int, rollback_after: int, state: dict[str, Any] | None = None):
        self.sigmas, self.window, self.rollback_after = float(sigmas), int(window), int(rollback_after)
        self.losses: deque[float] = deque(maxlen=self.window)
        self.grad_norms: deque[float] = deque(maxlen=self.window)
        self.streak = 0
        self.skipped: list[dict[str, Any]] = []      # every skipped step of the run, in order
        self.rollbacks: list[dict[str, Any]] = []
        if state:
            self.load_state_dict(state)

    def verdict(self, loss: float, grad_norm: float | None) -> str | None:
        """Why this step's update must be skipped, or None."""
        if not math.isfinite(loss):
            return NONFINITE_LOSS
        if grad_norm is not None and not math.isfinite(grad_norm):
            return NONFINITE_GRAD_NORM
        if self.sigmas > 0:
            if _spike(loss, self.losses, self.sigmas):
                return LOSS_SPIKE
            if grad_norm is not None and _spike(grad_norm, self.grad_norms, self.sigmas):
                return GRAD_NORM_SPIKE
        return None

    def record(self, step: int, global_batch: int, reason: str | None, loss: float,
               grad_norm: float | None) -> None:
        """Account for step `step` (which read global batch `global_batch`): accepted values join the window."""
        if reason is None:
            self.streak = 0
            self.losses.append(float(loss))
            if grad_norm is not None:
                self.grad_norms.append(float(grad_norm))
            return
        self.streak += 1
        self.skipped.append({"step": step, "global_batch": global_batch, "reason": reason,
                             "loss": _finite_or_none(loss), "grad_norm": _finite_or_none(grad_norm)})

    def must_roll_back(self) -> bool:
        return self.rollback_after > 0 and self.streak >= self.rollback_after

    def rolled_back(self, *, from_step: int, to_step: int, skipped_batches: list[int]) -> dict[str, Any]:
        """Note a rollback from `from_step` to the checkpoint of `to_step`; the window keeps its accepted values
        (they came before the streak, and the reloaded state is theirs). Returns the event."""
        event = {"from_step": from_step, "to_step": to_step, "skipped_batches": skipped_batches,
                 "reasons": [s["reason"] for s in self.skipped[-self.streak:]] if self.streak else []}
        self.rollbacks.append(event)
        self.streak = 0
        return event

    def summary(self) -> dict[str, Any]:
        """summary.json's "anomalies": counts, every skipped step and every rollback of the run."""
        return {"skipped_steps": len(self.skipped), "rollbacks": len(self.rollbacks), "skipped": self.skipped,
                "rollback_events": self.rollbacks,
                "skipped_batches": sorted({s["global_batch"] for s in self.skipped}
                                          | {b for r in self.rollbacks for b in r["skipped_batches"]})}

    def state_dict(self) -> dict[str, Any]:
        return {"losses": list(self.losses), "grad_norms": list(self.grad_norms), "streak": self.streak,
                "skipped": self.skipped, "rollbacks": self.rollbacks}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.losses.extend(state.get("losses", []))
        self.grad_norms.extend(state.get("grad_norms", []))
        self.streak = int(state.get("streak", 0))
        self.skipped = list(state.get("skipped", []))
        self.rollbacks = list(state.get("rollbacks", []))


def _spike(value: float, window: deque, sigmas: float) -> bool:
    if len(window) < window.maxlen:
        return False
    mean = statistics.fmean(window)
    return value > mean + sigmas * statistics.pstdev(window, mean)


def _finite_or_none(value: float | None) -> float | None:
    return None if value is None or not math.isfinite(value) else float(value)
