"""Ray as the executor of `prep corpus` work units (the steps themselves know nothing about Ray).

    for record in run_units_on_ray(job, units, workers=2): ...

Without `address` it starts a local, loopback-only cluster of `workers` CPUs (no dashboard) and shuts it
down afterwards; with `address` (or when Ray is already initialised) it uses that cluster and keeps at most
`workers` units in flight. Records come back in completion order; the caller orders them by unit id.
"""

from __future__ import annotations

import os
from typing import Iterator

from pipeline.common import UserError


def _unit_task(job: dict, unit: dict) -> dict:
    """One Ray task = one unit on one CPU: tokenizers' own thread pool stays off (parallelism comes from tasks)."""
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    from pipeline.corpus import process_unit

    return process_unit(job, unit)


def _progress(total_bytes: int, initial: int, enabled: bool):
    from tqdm import tqdm

    return tqdm(total=total_bytes, initial=initial, unit="B", unit_scale=True, unit_divisor=1024,
                desc="prep corpus", disable=not enabled, dynamic_ncols=True)


def run_units_on_ray(job: dict, units: list[dict], *, workers: int = 2, address: str | None = None,
                     progress: bool = True, skipped_bytes: int = 0) -> Iterator[dict]:
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
    remote_unit = ray.remote(num_cpus=1, max_retries=2)(_unit_task)
    job_ref = ray.put(job)
    pending_units = list(reversed(units))  # pop() takes them in unit order
    in_flight: dict = {}
    bar = _progress(skipped_bytes + sum(u["bytes"] for u in units), skipped_bytes, progress)
    try:
        while pending_units or in_flight:
            while pending_units and len(in_flight) < workers:
                unit = pending_units.pop()
                in_flight[remote_unit.remote(job_ref, unit)] = unit
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
                bar.update(unit["bytes"])
                bar.set_postfix(units=f"{record['unit']['unit_id']}", refresh=False)
                yield record
    finally:
        bar.close()
        if started_here:
            ray.shutdown()
