"""``shardlab launch``: N processes of ``shardlab run`` on this machine, the way a cluster would start them.

Each process is told the coordinator (``127.0.0.1:<port>``, a free port unless ``--port`` names one), the
process count, its rank and its share of the emulated host devices, through the variables
:mod:`lab.run.distributed` reads; JAX's runtime does the rest (CPU collectives through gloo, all on loopback).
The launcher forwards every process's output with a ``[rank k]`` prefix and watches them: the first process
to fail stops the others (SIGTERM, then SIGKILL after :data:`GRACE_S`), and the launcher exits with its exit
code, naming it. The processes die with the launcher (``PR_SET_PDEATHSIG``), so none outlives it.
"""

from __future__ import annotations

import contextlib
import ctypes
import math
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from lab.core.errors import Interrupted, UserError, interrupt_in
from lab.run import distributed as dist

GRACE_S = 5.0  # how long the others get to stop after one failed, before SIGKILL
POLL_S = 0.05
# gloo's connection chatter, written by several threads at once (so its lines interleave)
NOISE = re.compile(r"\[Gloo\]|connected peer ranks|^\s*$")
# one message of that chatter (its two sentences sometimes on two lines): written by the runtime's own stream into
# the same pipe as process 0's JSON report, it can land inside a line of it, so it is cut out, not the line
GLOO_MESSAGE = re.compile(
    r"\[Gloo\] Rank \d+ is connected to \d+ peer ranks\.\s*Expected number of connected peer ranks is : \d+\n?"
)
# the count that ends a message another thread's message cut in two: alone on the line after the noise
GLOO_TAIL = re.compile(r"^\s*\d+\s*$")
# a process's last words: `shardlab: error: ...`, `shardlab run: error: ...`, an internal error, Ctrl-C
ERROR = re.compile(r"^shardlab[^:]*: (?:error: |(?=internal error: |interrupted: ))")
FORCED = re.compile(r"--xla_force_host_platform_device_count=\S+")


def free_port(port: int | None) -> int:
    """``port`` when it can be bound on loopback (else a clear error), or a free one the system picks."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # TIME_WAIT is free; a listener is not
        try:
            s.bind(("127.0.0.1", port or 0))
        except OSError as exc:
            raise UserError(
                f"--port {port}: cannot listen on 127.0.0.1:{port} ({exc.strerror}); pick another port, or leave "
                "--port out for a free one"
            ) from None
        return s.getsockname()[1]


def _die_with_parent() -> None:
    """In the child, before exec: SIGKILL when the launcher dies, however it dies (Linux)."""
    with contextlib.suppress(Exception):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def child_env(rank: int, processes: int, port: int, local_devices: int) -> dict[str, str]:
    """The environment of process ``rank``: the launch variables, the CPU backend, its share of the devices."""
    env = dict(os.environ)
    env["XLA_FLAGS"] = FORCED.sub("", env.get("XLA_FLAGS", "")).strip()  # its share comes from LOCAL_DEVICES
    env.update(
        {
            dist.COORDINATOR: f"127.0.0.1:{port}",
            dist.NUM_PROCESSES: str(processes),
            dist.PROCESS_ID: str(rank),
            dist.LOCAL_DEVICES: str(local_devices),
            "JAX_PLATFORMS": "cpu",
            "JAX_CPU_COLLECTIVES_IMPLEMENTATION": "gloo",
            "PYTHONUNBUFFERED": "1",
        }
    )
    return env


# the runtime's own C++ log lines (glog: E1130 11:18:41.745958 ...); held back, since when one process fails the
# others log the lost coordinator or peer before they are stopped, and that is an echo, not news
RUNTIME_LOG = re.compile(r"^[IWEF]\d{4} \d\d:\d\d:\d\d")


@dataclass
class _Proc:
    rank: int
    popen: subprocess.Popen
    stdout: list[str] = field(default_factory=list)
    held: list[str] = field(default_factory=list)  # runtime log lines: shown for the failed process, or at the end
    last_error: str = ""


def _forward(proc: _Proc, stream, keep: bool, write: Callable[[str], None], state: dict) -> None:
    """Copy one stream of one process, line by line, with its rank in front (``keep``: hold stdout instead).
    Once a process has failed, the others' output is their reaction to it and is not copied."""
    cut = False  # the last line held a gloo message without its count (seen on a loaded host: "[rank 1] 1")
    for line in iter(stream.readline, ""):
        if keep:  # process 0's report: kept whole (json_report cuts the chatter out of it)
            proc.stdout.append(line)
            continue
        if NOISE.search(line) or (cut and GLOO_TAIL.match(line)):
            cut = line.count("[Gloo]") > len(GLOO_MESSAGE.findall(line))
            continue
        cut = False
        if ERROR.match(line):  # said once, in the launcher's own line naming the process
            proc.last_error = ERROR.sub("", line.strip())
            continue
        if RUNTIME_LOG.match(line):
            proc.held.append(f"[rank {proc.rank}] {line}")
            continue
        if state.get("failed") in (None, proc):
            write(f"[rank {proc.rank}] {line}")
    stream.close()


def _stop(procs: Sequence[_Proc]) -> None:
    """SIGTERM every live process, then SIGKILL those still alive after the grace period."""
    for p in procs:
        if p.popen.poll() is None:
            p.popen.terminate()
    deadline = time.monotonic() + GRACE_S
    for p in procs:
        with contextlib.suppress(subprocess.TimeoutExpired):
            p.popen.wait(max(0.0, deadline - time.monotonic()))
        if p.popen.poll() is None:
            p.popen.kill()
            p.popen.wait()


def _how(code: int) -> str:
    if code < 0:
        with contextlib.suppress(ValueError):
            return f"was killed by {signal.Signals(-code).name}"
    return f"exited with code {code}"


def _watch(procs: Sequence[_Proc], threads: Sequence[threading.Thread], state: dict, write) -> tuple[int, _Proc | None]:
    """Wait for every process; at the first failure stop the rest. The exit code and the failed process."""
    failed: _Proc | None = None
    while any(p.popen.poll() is None for p in procs):
        failed = next((p for p in procs if p.popen.poll() not in (None, 0)), None)
        if failed is not None:
            break
        time.sleep(POLL_S)
    failed = failed or next((p for p in procs if p.popen.returncode != 0), None)
    if failed is not None:
        state["failed"] = failed  # from now on only its own output is copied
        _stop(procs)
    for t in threads:
        t.join(timeout=GRACE_S)
    for p in procs:  # the runtime's log lines: the failed process's (its own account), or all of a clean run's
        if failed is None or p is failed:
            for line in p.held:
                write(line)
    return (0, None) if failed is None else (failed.popen.returncode, failed)


def json_report(stdout: str) -> dict:
    """Process 0's ``--json`` report from its standard output, the runtime's chatter cut out of it.

    Raises:
        ValueError: nothing there parses as JSON.
    """
    import json

    lines = GLOO_MESSAGE.sub("", stdout).splitlines()
    lines = [line for line in lines if not NOISE.search(line)]  # a fragment of the chatter, on its own line
    start = next((i for i, line in enumerate(lines) if line == "{"), 0)  # the report is printed indented
    return json.loads("\n".join(lines[start:]))


@dataclass(frozen=True)
class Launched:
    """What ``launch`` returns: the exit code, the failed rank (if any) and process 0's standard output."""

    code: int
    failed_rank: int | None
    stdout: str
    message: str


def launch(
    processes: int,
    experiment: str,
    run_args: Sequence[str],
    *,
    port: int | None = None,
    json_out: bool = False,
    write: Callable[[str], None] = sys.stderr.write,
) -> Launched:
    """Start ``processes`` local processes of ``shardlab run experiment run_args`` and wait for them.

    Raises:
        UserError: a mesh that cannot be split between the processes, a port in use (before anything starts).
        Interrupted: Ctrl-C (the processes are stopped).
    """
    from lab.run.experiment import load_experiment

    exp = load_experiment(experiment)
    local = _local_devices(exp, processes)
    _calibrate_once(exp, run_args, write)
    port = free_port(port)
    cmd = [sys.executable, "-m", "lab", "run", experiment, *run_args, *(["--json"] if json_out else [])]
    procs: list[_Proc] = []
    threads: list[threading.Thread] = []
    state: dict = {"failed": None}
    try:
        for rank in range(processes):
            popen = subprocess.Popen(
                cmd,
                env=child_env(rank, processes, port, local),
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                errors="replace",
                preexec_fn=_die_with_parent,
            )
            proc = _Proc(rank, popen)
            procs.append(proc)
            for stream, keep in ((popen.stdout, json_out and rank == 0), (popen.stderr, False)):
                t = threading.Thread(target=_forward, args=(proc, stream, keep, write, state), daemon=True)
                t.start()
                threads.append(t)
        code, failed = _watch(procs, threads, state, write)
    except BaseException as exc:
        if interrupt_in(exc) is None:
            raise
        _stop(procs)
        raise Interrupted(f"stopped all {processes} processes; what each kept is in its run folder") from None
    if failed is None:
        return Launched(0, None, "".join(procs[0].stdout), f"all {processes} processes finished")
    why = f": {failed.last_error}" if failed.last_error else ""
    message = f"process {failed.rank} of {processes} {_how(code)}{why}; stopped the others"
    return Launched(code if code > 0 else 1, failed.rank, "".join(procs[0].stdout), message)


def _local_devices(exp, processes: int) -> int:
    """Each process's share of the mesh's devices: the mesh must split evenly, its slow axes over the processes."""
    if processes < 2:
        raise UserError(f"--local-processes {processes}: launch at least 2 (run the experiment directly for one)")
    if exp.devices % processes:
        raise UserError(
            f"the mesh {exp.mesh} of {exp.path} has {exp.devices} devices, which {processes} processes cannot share "
            f"evenly; use a --local-processes that divides {exp.devices}"
        )
    slow = exp.plan.slow_axes
    span = math.prod(exp.mesh[a] for a in slow)
    if slow and span != processes:
        raise UserError(
            f"the slow axes {', '.join(slow)} of {exp.path} span {span} processes, not {processes}; use "
            f"--local-processes {span}"
        )
    return exp.devices // processes


def _calibrate_once(exp, run_args: Sequence[str], write: Callable[[str], None]) -> None:
    """Calibrate the host first, alone, when the run will price with its calibration and there is none yet."""
    from lab.core.hardware import default_catalog

    if exp.plan.hardware != "calibrated" or "--hardware" in run_args:
        return
    if default_catalog().get("cpu").calibrated:
        return
    from lab.measure.calibrate import check_writable

    check_writable()  # a spec folder that cannot take the spec: said now, by name, not after the calibration
    write("shardlab launch: no calibration for this host yet: calibrating it first, alone (quick)\n")
    done = subprocess.run(
        [sys.executable, "-m", "lab", "calibrate", "--quick", "--force"],
        env={k: v for k, v in os.environ.items() if k != "XLA_FLAGS"},
        capture_output=True,
        text=True,
    )
    if done.returncode:
        last = (done.stderr.strip().splitlines() or ["no message"])[-1]
        raise UserError(f"calibrating the host failed ({last}); run `shardlab calibrate --quick` and read why")


__all__ = ["GRACE_S", "Launched", "child_env", "free_port", "launch"]
