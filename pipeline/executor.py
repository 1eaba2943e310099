"""Ray as the executor of work units: it runs a unit function it is given and knows nothing of what it does.

    for record in run_units_on_ray(process_unit, job, units, workers=2): ...

`unit_fn(job, unit)` must be importable by name on the workers (a module-level function) and return a dict;
`job` is put into Ray's object store once; each unit (anything with `.unit_id` and `.bytes`, for progress)
travels with its task. Without `address` a local, loopback-only cluster of `workers` CPUs is started (no
dashboard) and shut down afterwards; with `address` (or when Ray is already initialised) that cluster is used,
with at most `workers` units in flight. Records come back in completion order; the caller orders them.

An `address` is asked first, with one gRPC call of a few seconds, whether a Ray cluster answers there: Ray's own
connect would retry for minutes and ignore SIGTERM meanwhile. A local cluster dies with the driver even when the
driver is SIGKILLed: a small reaper process, started before the cluster, waits for the driver's end (its stdin
pipe closes) and kills every process that carries this cluster's token in its environment, and their descendants,
sweeping until none is left (Ray's agents would otherwise outlive a killed driver by a minute or more, trying to
report to the dead GCS).
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
import uuid
from typing import Any, Callable, Iterator, Sequence

from pipeline.common import UserError

CLUSTER_TOKEN_ENV = "T5ZERO_PREP_CLUSTER"
PROBE_TIMEOUT_S = 5.0
# Run by the reaper (`python -c`): wait for EOF on stdin, then SIGKILL every process whose environment holds
# T5ZERO_PREP_CLUSTER=<token> (Linux /proc; Ray's processes inherit the driver's environment) and every descendant
# of one; sweep again until a sweep finds none, as a dying raylet may still start an agent. Ray's fate-sharing
# kills the raylet with the driver, as a rule before the first sweep: its agents are orphans by then and only their
# token finds them (hence SPT_NOENV in `_start_reaper`).
_REAPER_CODE = """
import os, signal, sys, time
sys.stdin.buffer.read()
mark = ("%s=" % sys.argv[1]).encode() + sys.argv[2].encode() + b"\\0"
def ours():
    found, parent = set(), {}
    for pid in map(int, filter(str.isdigit, os.listdir("/proc"))):
        try:
            with open("/proc/%d/environ" % pid, "rb") as f:
                if mark in f.read():
                    found.add(pid)
            with open("/proc/%d/stat" % pid, "rb") as f:
                parent[pid] = int(f.read().rpartition(b")")[2].split()[1])
        except (OSError, ValueError, IndexError):
            pass
    grown = True
    while grown:
        grown = False
        for pid, ppid in parent.items():
            if ppid in found and pid not in found:
                found.add(pid)
                grown = True
    found.discard(os.getpid())
    return found
for sweep in range(20):
    pids = ours()
    if not pids:
        break
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    time.sleep(0.25)
"""


def _cluster_problem(address: str, timeout_s: float = PROBE_TIMEOUT_S) -> str | None:
    """Why no Ray cluster answers at `address` ("host:port" of its GCS), or None when one does or when the
    address is not of that form (`auto`, `ray://...`: Ray's own checks apply)."""
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit() or "://" in address:
        return None
    try:
        import grpc
        from ray.core.generated import gcs_service_pb2, gcs_service_pb2_grpc
    except ImportError:  # another Ray layout: leave the check to ray.init
        return None
    channel = grpc.insecure_channel(address, options=[("grpc.enable_http_proxy", 0)])
    try:
        gcs_service_pb2_grpc.NodeInfoGcsServiceStub(channel).GetClusterId(gcs_service_pb2.GetClusterIdRequest(),
                                                                           timeout=timeout_s)
    except grpc.RpcError as err:
        if err.code() in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED):
            return None  # a cluster answers; ray.init reports its own authentication error
        return f"no Ray cluster answers there within {timeout_s:.0f}s: {err.code().name}"
    finally:
        channel.close()
    return None


def check_ray_address(address: str) -> None:
    """`UserError` in one line, within seconds, when no Ray cluster answers at `address` (and Ray is not
    initialised in this process already)."""
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    import ray

    problem = None if ray.is_initialized() else _cluster_problem(address)
    if problem:
        raise UserError(f"--ray-address {address}: {problem}; start the cluster (`ray start --head`), fix the "
                        f"address, or leave --ray-address out to start a local cluster")


def _exit_cleanly_on_sigterm():
    """SIGTERM -> one line and exit status 143 through the `finally` blocks (Ray's own handler dumps a native
    stack and aborts); after the line, the process's stderr goes to /dev/null. Returns what puts the previous
    handler back (nothing is changed off the main thread)."""
    if threading.current_thread() is not threading.main_thread():
        return lambda: None

    def stop(signum, frame):
        print("stopped by SIGTERM; finished work units are kept, and the same command resumes", file=sys.stderr,
              flush=True)
        # The rest of the way out is Ray's: its C++ core worker reports on stderr the tasks the shutdown cancels
        # ("Failed to push error to driver", now and then); the one line above is what the user needs
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 2)
        os.close(devnull)
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, stop)
    return lambda: signal.signal(signal.SIGTERM, signal.SIG_DFL if previous is None else previous)


def _start_reaper() -> subprocess.Popen | None:
    """Mark this process's environment with a fresh cluster token and start the reaper (Linux only)."""
    if not sys.platform.startswith("linux"):
        return None
    token = uuid.uuid4().hex
    os.environ[CLUSTER_TOKEN_ENV] = token
    # Ray's process titles (its built-in setproctitle) would otherwise zero the start of the environment block that
    # /proc shows, and the raylet passes its agents their environment in no fixed order: in about half the runs
    # the token of the dashboard and runtime-env agents was wiped, and they outlived a kill -9 of the driver
    os.environ.setdefault("SPT_NOENV", "1")
    env = {k: v for k, v in os.environ.items() if k != CLUSTER_TOKEN_ENV}
    return subprocess.Popen([sys.executable, "-c", _REAPER_CODE, CLUSTER_TOKEN_ENV, token], stdin=subprocess.PIPE,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env, start_new_session=True)


def _stop_reaper(reaper: subprocess.Popen | None) -> None:
    """After ray.shutdown: let the reaper sweep what is left of our cluster, and wait for it."""
    os.environ.pop(CLUSTER_TOKEN_ENV, None)
    if reaper is not None:
        reaper.stdin.close()
        try:
            reaper.wait(timeout=30)
        except subprocess.TimeoutExpired:
            reaper.kill()


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
    reaper = None
    if not ray.is_initialized():
        if address:
            check_ray_address(address)
        try:
            if address:
                ray.init(address=address, log_to_driver=False, configure_logging=False)
            else:
                # Ray announces on stderr that it turned token authentication on for the new cluster; a
                # loopback-only cluster of our own needs no such line in every prep run.
                logging.getLogger("ray._private.authentication.authentication_token_setup").setLevel(logging.ERROR)
                reaper = _start_reaper()
                # address="local": always a fresh cluster of our own, never one that happens to run on this host
                ray.init(address="local", num_cpus=workers, include_dashboard=False, _node_ip_address="127.0.0.1",
                         log_to_driver=False, configure_logging=False)
        except (ConnectionError, ValueError) as err:
            _stop_reaper(reaper)
            raise UserError(f"cannot reach the Ray cluster at {address or 'local'} ({err}); check --ray-address "
                            f"or leave it out to start a local cluster") from None
        except BaseException:
            _stop_reaper(reaper)
            raise
        started_here = True
    restore_sigterm = _exit_cleanly_on_sigterm()
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
        restore_sigterm()
        if started_here:
            ray.shutdown()
            _stop_reaper(reaper)
