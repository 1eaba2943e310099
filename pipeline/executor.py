"""Ray as the executor of work units: it runs a unit function it is given and knows nothing of what it does.

    for record in run_units_on_ray(process_unit, job, units, workers=2): ...

`unit_fn(job, unit)` must be importable by name on the workers (a module-level function) and return a dict;
`job` is put into Ray's object store once; each unit (anything with `.unit_id` and `.bytes`, for progress)
travels with its task. Without `address` a local, loopback-only cluster of `workers` CPUs is started (no
dashboard) and shut down afterwards; with `address` (or when Ray is already initialised) that cluster is used,
with at most `workers` units in flight. Records come back in completion order; the caller orders them.
"""

from __future__ import annotations

import os
from typing import Any, Callable, Iterator, Sequence

from pipeline.common import UserError


def _run_unit(unit_fn: Callable[[Any, Any], dict], job: Any, unit: Any) -> dict:
    """One Ray task = one unit on one CPU: tokenizers' own thread pool stays off (parallelism comes from tasks)."""
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    return unit_fn(job, unit)


def _progress(total_bytes: int, initial: int, enabled: bool):
    from tqdm import tqdm

    return tqdm(total=total_bytes, initial=initial, unit="B", unit_scale=True, unit_divisor=1024,
                desc="prep corpus", disable=not enabled, dynamic_ncols=True)


def run_units_on_ray(unit_fn: Callable[[Any, Any], dict], job: Any, units: Sequence[Any], *, workers: int,
                     address: str | None = None, progress: bool = True, skipped_bytes: int = 0) -> Iterator[dict]:
    """Yield `unit_fn(job, unit)` for every unit, run as Ray tasks; a `UserError` inside a task is re-raised."""
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    import ray

    started_here = False
    if not ray.is_initialized():
        try:
            if address:
                ray.init(address=address, log_to_driver=False, configure_logging=False)
            else:
                # address="local": always a fresh cluster of our own, never one that happens to run on this host
                ray.init(address="local", num_cpus=workers, include_dashboard=False, _node_ip_address="127.0.0.1",
                         log_to_driver=False, configure_logging=False)
        except (ConnectionError, ValueError) as err:
            raise UserError(f"cannot reach the Ray cluster at {address or 'local'} ({err}); check --ray-address "
                            f"or leave it out to start a local cluster") from None
        started_here = True
    remote_unit = ray.remote(num_cpus=1, max_retries=2)(_run_unit)
    job_ref = ray.put(job)
    pending_units = list(reversed(units))  # pop() takes them in the given order
    in_flight: dict = {}
    bar = _progress(skipped_bytes + sum(u.bytes for u in units), skipped_bytes, progress)
    try:
        while pending_units or in_flight:
            while pending_units and len(in_flight) < workers:
                unit = pending_units.pop()
                in_flight[remote_unit.remote(unit_fn, job_ref, unit)] = unit
            done, _ = ray.wait(list(in_flight), num_returns=1)
            for ref in done:
                unit = in_flight.pop(ref)
                try:
                    record = ray.get(ref)
                except ray.exceptions.RayTaskError as err:
                    cause = err.cause if hasattr(err, "cause") else err
                    if isinstance(cause, UserError):
                        raise cause from None
                    raise
                bar.update(unit.bytes)
                bar.set_postfix(units=f"{unit.unit_id}", refresh=False)
                yield record
    finally:
        bar.close()
        if started_here:
            ray.shutdown()
