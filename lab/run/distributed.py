"""Several processes, one program: JAX's own distributed runtime, started the way clusters start it.

``shardlab run`` is one of several processes when it is told so (``--distributed``, or the variables
``shardlab launch`` sets) or when the environment says so the way ``jax.distributed.initialize()`` reads it
(SLURM, Open MPI, a multi-host TPU VM). It then initializes the runtime before JAX touches a device, builds
the global mesh with the Plan's slow axes laid over the processes, and, after each process profiled and parsed
its own trace, gathers one small summary per process to process 0 with JAX's collectives
(``multihost_utils.process_allgather``): no home-made protocol, and no shared file system needed.
"""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any

from lab.core.errors import UserError

# What `shardlab launch` tells each process it starts.
COORDINATOR, NUM_PROCESSES, PROCESS_ID, LOCAL_DEVICES = (
    "SHARDLAB_COORDINATOR",
    "SHARDLAB_NUM_PROCESSES",
    "SHARDLAB_PROCESS_ID",
    "SHARDLAB_LOCAL_DEVICES",
)
TIMEOUT_S = 60  # how long a process waits for the coordinator and its peers before it gives up
TIMEOUT_ENV = "SHARDLAB_JOIN_TIMEOUT_S"  # overrides it (seconds)


@dataclass(frozen=True)
class Cluster:
    """How this process joins the others: explicit (launch's variables or flags) or detected by JAX."""

    coordinator: str | None = None
    processes: int | None = None
    process_id: int | None = None
    local_devices: int | None = None
    source: str = "explicit"


def detect(explicit: bool = False) -> Cluster | None:
    """The cluster this process belongs to, or None when it runs alone.

    ``shardlab launch``'s variables come first; then SLURM (``SLURM_NTASKS`` > 1), Open MPI
    (``OMPI_COMM_WORLD_SIZE`` > 1) and a multi-host TPU VM (``TPU_WORKER_HOSTNAMES`` with more than one host),
    for which ``jax.distributed.initialize()`` finds the coordinator itself; ``explicit`` (``--distributed``)
    asks JAX to detect even where none of these is set.
    """
    env = os.environ
    if COORDINATOR in env:
        n = _int_var(NUM_PROCESSES, minimum=1)
        rank = _int_var(PROCESS_ID, minimum=0)
        if rank >= n:
            raise UserError(
                f"{PROCESS_ID}={rank} is not a rank of {n} processes ({NUM_PROCESSES}); give 0 to {n - 1}, one per "
                "process"
            )
        local = _int_var(LOCAL_DEVICES, minimum=1) if env.get(LOCAL_DEVICES) else None
        return Cluster(env[COORDINATOR], n, rank, local, "shardlab launch")
    for var, source in (("SLURM_NTASKS", "SLURM"), ("OMPI_COMM_WORLD_SIZE", "Open MPI")):
        if env.get(var, "").isdigit() and int(env[var]) > 1:
            return Cluster(source=source)
    if len([h for h in env.get("TPU_WORKER_HOSTNAMES", "").split(",") if h]) > 1:
        return Cluster(source="TPU VM")
    return Cluster(source="detected by JAX") if explicit else None


def join_timeout() -> int:
    """Seconds to wait for the coordinator and the peers: ``$SHARDLAB_JOIN_TIMEOUT_S`` or :data:`TIMEOUT_S`."""
    raw = os.environ.get(TIMEOUT_ENV, "").strip()
    if not raw:
        return TIMEOUT_S
    if not raw.isdigit() or not 1 <= int(raw) <= 3600:
        raise UserError(f"{TIMEOUT_ENV}={raw!r} must be a whole number of seconds from 1 to 3600, e.g. 60")
    return int(raw)


def _int_var(name: str, minimum: int) -> int:
    """An integer launch variable, or one line naming it (set with the coordinator by `shardlab launch`)."""
    raw = os.environ.get(name, "").strip()
    if not raw.isdigit() or int(raw) < minimum:
        raise UserError(
            f"{name}={raw!r} must be a whole number of at least {minimum} (it goes with {COORDINATOR}); start the "
            "processes with `shardlab launch`, or fix it"
        )
    return int(raw)


def initialize(cluster: Cluster, timeout_s: int | None = None) -> None:
    """Join the runtime before JAX uses a device; a clear error naming the setting when it cannot.

    JAX aborts a process whose peers do not all register in time (a fatal error and a C++ stack trace, exit 134).
    So the coordinator's address is checked first (process 0: its port is free; the others: something listens
    there), and a watchdog ends the wait one line and exit code 2 before JAX's own deadline does.
    """
    import jax

    timeout_s = timeout_s or join_timeout()
    if cluster.coordinator:
        _check_coordinator(cluster, timeout_s)
    if cluster.local_devices:
        jax.config.update("jax_num_cpu_devices", cluster.local_devices)
    if cluster.coordinator and _is_loopback(cluster.coordinator):
        _gloo_on_loopback()
    who = f"process {cluster.process_id} of {cluster.processes}" if cluster.processes else "this process"
    where = cluster.coordinator or f"the coordinator JAX detects ({cluster.source})"
    advice = "check that every process was started, with the same coordinator address and process count"
    watchdog = threading.Timer(
        timeout_s,
        _give_up,
        (
            f"{who} could not join the distributed runtime at {where} within {timeout_s} s "
            f"({TIMEOUT_ENV}): not every process registered; {advice}",
        ),
    )
    watchdog.daemon = True
    watchdog.start()
    try:
        jax.distributed.initialize(
            coordinator_address=cluster.coordinator,
            num_processes=cluster.processes,
            process_id=cluster.process_id,
            initialization_timeout=timeout_s + 30,
        )
    except (RuntimeError, ValueError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        if cluster.source == "detected by JAX":
            raise UserError(
                f"--distributed: JAX found no cluster to join here ({first.rstrip('.')}): no TPU VM, SLURM or Open "
                "MPI job; start every process under one, or several on this machine with `shardlab launch`"
            ) from None
        raise UserError(f"{who} cannot join the distributed runtime at {where}: {first[:200]}; {advice}") from None
    finally:
        watchdog.cancel()
    if cluster.processes:  # JAX takes process 0's count; a process told another would fail later, or hang
        claims = [int(c["processes"]) for c in gather({"processes": cluster.processes})]
        if len(set(claims)) > 1 or claims[0] != jax.process_count():
            raise UserError(
                f"the processes were told different process counts ({', '.join(map(str, claims))}, in rank "
                f"order; {NUM_PROCESSES}); start every process with the same count"
            )


def _is_loopback(coordinator: str) -> bool:
    host = coordinator.rpartition(":")[0].strip("[]")
    return host in ("localhost", "::1") or host.startswith("127.")


def _gloo_on_loopback() -> None:
    """Bind the CPU collectives (gloo) to 127.0.0.1 when the processes meet on loopback.

    JAX's CPU client makes its gloo transport from this machine's hostname, which on some laptops resolves to a
    network address; the processes ``shardlab launch`` starts must keep their traffic on loopback. JAX exposes
    no option for it, so the CPU backend's factory is wrapped (JAX's own, with gloo given the loopback
    hostname); where the JAX version lays this out differently, nothing changes.
    """
    try:
        from jax._src import distributed as jdist
        from jax._src import xla_bridge
        from jax._src.lib import _jax

        registered = xla_bridge._backend_factories["cpu"]
        make = xla_bridge.make_cpu_client

        def cpu_on_loopback():
            gloo = _jax.make_gloo_tcp_collectives(distributed_client=jdist.global_state.client, hostname="127.0.0.1")
            return make(collectives=gloo)

        xla_bridge._backend_factories["cpu"] = dataclasses.replace(registered, factory=cpu_on_loopback)
    except (ImportError, AttributeError, KeyError, TypeError):
        return


def _give_up(message: str) -> None:
    """The watchdog's end: one line and exit code 2, from any thread, before JAX's fatal error."""
    sys.stderr.write(f"shardlab: error: {message}\n")
    sys.stderr.flush()
    os._exit(2)


def _check_coordinator(cluster: Cluster, timeout_s: int) -> None:
    """Process 0 can listen on the coordinator's port; every other process reaches it within ``timeout_s``."""
    host, _, port = str(cluster.coordinator).rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise UserError(
            f"{COORDINATOR}={cluster.coordinator!r} is not host:port; give e.g. 127.0.0.1:12355 (`shardlab launch` "
            "picks a free one)"
        )
    address = (host.strip("[]"), int(port))
    if cluster.process_id == 0:
        with socket.socket(socket.AF_INET6 if ":" in address[0] else socket.AF_INET) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a port in TIME_WAIT is free to serve again
            try:
                s.bind(address)
            except OSError as exc:
                raise UserError(
                    f"process 0 cannot serve the coordinator at {cluster.coordinator}: {exc.strerror}; pick a free "
                    "port (`shardlab launch --port`, or leave it out for a free one)"
                ) from None
        return
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            socket.create_connection(address, timeout=1.0).close()
            return
        except OSError as exc:
            if time.monotonic() > deadline:
                raise UserError(
                    f"process {cluster.process_id} found nothing listening at the coordinator {cluster.coordinator} "
                    f"within {timeout_s} s ({exc.strerror or exc}); start process 0 with the same address, or fix "
                    f"{COORDINATOR}"
                ) from None
            time.sleep(0.2)


def process_count() -> int:
    import jax

    return jax.process_count()


def rank() -> int:
    import jax

    return jax.process_index()


def combine(summary: dict[str, Any]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Every process's summary gathered (in rank order, without the per-op tables) and the slowest process's
    whole summary: the one with the longest median step (a job runs at the pace of its slowest process)."""
    everyone = gather(summary)
    slowest = max(everyone, key=lambda p: (p.get("step_time_measured_s") or 0.0, -p["rank"]))
    brief = [{k: v for k, v in p.items() if k not in ("medians", "spreads")} for p in everyone]
    return brief, slowest


def gather(summary: dict[str, Any]) -> list[dict[str, Any]]:
    """Every process's ``summary`` (JSON-able), in process order, on every process (one allgather of bytes)."""
    import numpy as np
    from jax.experimental import multihost_utils

    data = np.frombuffer(json.dumps(summary).encode(), dtype=np.uint8)
    sizes = multihost_utils.process_allgather(np.array([data.size], dtype=np.int64))
    padded = np.zeros(int(np.max(sizes)), dtype=np.uint8)
    padded[: data.size] = data
    rows = multihost_utils.process_allgather(padded)
    return [json.loads(bytes(row[: int(n)]).decode()) for row, n in zip(rows, np.ravel(sizes), strict=True)]


def agree(value: str) -> str:
    """Process 0's ``value`` on every process (a run directory's name, chosen once)."""
    import numpy as np
    from jax.experimental import multihost_utils

    raw = np.zeros(512, dtype=np.uint8)
    encoded = value.encode()[:512]
    raw[: len(encoded)] = np.frombuffer(encoded, dtype=np.uint8)
    out = multihost_utils.broadcast_one_to_all(raw)
    return bytes(np.asarray(out)).rstrip(b"\0").decode()


__all__ = [
    "COORDINATOR",
    "LOCAL_DEVICES",
    "NUM_PROCESSES",
    "PROCESS_ID",
    "TIMEOUT_ENV",
    "Cluster",
    "agree",
    "combine",
    "detect",
    "gather",
    "initialize",
    "join_timeout",
    "process_count",
    "rank",
]
