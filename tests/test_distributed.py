"""Several processes, one program: `shardlab launch` on loopback, the gathered report, failures, bad settings.

The launch tests start real processes (two of `shardlab run`, four emulated CPU devices each, JAX's distributed
runtime with gloo collectives) and compare what they compute with one process running the same experiment on
eight devices. The unit tests check the pieces without JAX: where a cluster is detected, how the slow axis is
priced, how launch splits the devices and refuses what cannot run.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from lab.core.errors import UserError
from lab.core.hardware import default_catalog
from lab.core.plan import MeshAxis
from lab.run import distributed as dist
from lab.run.experiment import load_experiment
from lab.run.launch import FORCED, child_env, free_port

ROOT = Path(__file__).resolve().parent.parent
EXPERIMENTS = ROOT / "experiments"
TRAIN = EXPERIMENTS / "multiprocess_dp_tp.toml"
MATMUL = EXPERIMENTS / "sharded_matmul_case2.toml"
RESULT_RTOL = 1e-5  # float32 sums over a whole model's parameters, reduced in another order across processes
LAUNCH_ENV_KEYS = (dist.COORDINATOR, dist.NUM_PROCESSES, dist.PROCESS_ID, dist.LOCAL_DEVICES)


def _env(**extra: str) -> dict[str, str]:
    """The test's environment without its device count or shared XLA cache (processes started together would
    write the same cache entries at once) and without launch variables, plus ``extra``. The suite's other XLA
    flags (conftest: compile without LLVM's loop optimisation) stay, with an ``XLA_FLAGS`` in ``extra`` after them."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k != "XLA_FLAGS" and not k.startswith("JAX_PERSISTENT") and k != "JAX_COMPILATION_CACHE_DIR"
    }
    for k in LAUNCH_ENV_KEYS:
        env.pop(k, None)
    flags = FORCED.sub("", os.environ.get("XLA_FLAGS", "")).strip()
    if flags:
        env["XLA_FLAGS"] = flags
    if "XLA_FLAGS" in extra:
        extra = extra | {"XLA_FLAGS": f"{flags} {extra['XLA_FLAGS']}".strip()}
    return env | extra


def _xla_cache() -> dict[str, str]:
    """The suite's persistent-compilation-cache variables (conftest), which ``_env`` leaves out."""
    return {k: v for k, v in os.environ.items() if k.startswith("JAX_PERSISTENT") or k == "JAX_COMPILATION_CACHE_DIR"}


def _shardlab(*args: str, env: dict[str, str] | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "lab", *args],
        cwd=ROOT,
        env=env or _env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


# ----- without JAX ------------------------------------------------------------------------------------------------


def test_detect_reads_launch_variables_and_cluster_schedulers(monkeypatch):
    for k in (*LAUNCH_ENV_KEYS, "SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE", "TPU_WORKER_HOSTNAMES"):
        monkeypatch.delenv(k, raising=False)
    assert dist.detect() is None
    assert dist.detect(explicit=True) == dist.Cluster(source="detected by JAX")
    monkeypatch.setenv("SLURM_NTASKS", "1")  # one task: alone
    assert dist.detect() is None
    monkeypatch.setenv("SLURM_NTASKS", "4")
    assert dist.detect().source == "SLURM"
    monkeypatch.delenv("SLURM_NTASKS")
    monkeypatch.setenv("TPU_WORKER_HOSTNAMES", "w0,w1")
    assert dist.detect().source == "TPU VM"
    monkeypatch.setenv(dist.COORDINATOR, "127.0.0.1:5000")
    monkeypatch.setenv(dist.NUM_PROCESSES, "2")
    monkeypatch.setenv(dist.PROCESS_ID, "1")
    monkeypatch.setenv(dist.LOCAL_DEVICES, "4")
    assert dist.detect() == dist.Cluster("127.0.0.1:5000", 2, 1, 4, "shardlab launch")
    monkeypatch.setenv(dist.PROCESS_ID, "one")
    with pytest.raises(UserError, match=dist.PROCESS_ID):
        dist.detect()


def test_child_env_keeps_every_process_on_loopback_with_its_share_of_devices(monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=8 --xla_dump_to=/tmp/x")
    env = child_env(1, 2, 23456, 4)
    assert env[dist.COORDINATOR] == "127.0.0.1:23456"
    assert (env[dist.NUM_PROCESSES], env[dist.PROCESS_ID], env[dist.LOCAL_DEVICES]) == ("2", "1", "4")
    assert env["XLA_FLAGS"] == "--xla_dump_to=/tmp/x"  # the user's other flags stay; the count is per process
    assert env["JAX_PLATFORMS"] == "cpu"


def test_the_runtimes_chatter_inside_process_zeros_json_report_is_cut_out():
    """gloo writes into the pipe process 0 prints its report to; a message can land inside one of its lines (seen
    on a loaded host: the launch failed with 'printed no JSON report')."""
    import json

    from lab.run.launch import json_report

    report = {"experiment": "x", "timings": {"report_s": 0.65, "total_s": 2.54}, "ops": [1, 2]}
    text = json.dumps(report, indent=2) + "\n"
    cut = text.index('"report_s"') + 5
    chatter = "[Gloo] Rank 0 is connected to 1 peer ranks. Expected number of connected peer ranks is : 1\n"
    assert json_report(text[:cut] + chatter + text[cut:]) == report
    assert json_report(chatter + text + chatter) == report
    split = chatter.replace(". Expected", ".\nExpected")  # its two sentences on two lines
    assert json_report(split + split + text[:cut] + split + text[cut:]) == report
    with pytest.raises(ValueError):
        json_report("[rank 0] no report\n")


def test_a_gloo_message_cut_in_two_by_another_leaves_no_stray_count():
    """Two of gloo's threads writing at once: one message cut after "is : ", its count on a line of its own after
    the other's (seen on a loaded host as a stray "[rank 1] 1" under a launch's error line)."""
    import io

    from lab.run.launch import _forward, _Proc

    msg = "[Gloo] Rank 1 is connected to 1 peer ranks. Expected number of connected peer ranks is : "
    stream = io.StringIO(f"{msg}{msg}1\n1\nshardlab: error: unknown hardware 'x'\n7\nstep 3 of 5\n")
    proc, written = _Proc(1, None), []
    _forward(proc, stream, False, written.append, {"failed": None})
    assert proc.last_error == "unknown hardware 'x'"
    assert written == ["[rank 1] 7\n", "[rank 1] step 3 of 5\n"]  # a count not after a cut message is output


def test_free_port_picks_one_or_refuses_a_port_in_use():
    port = free_port(None)
    assert 1024 <= port < 65536
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        taken = s.getsockname()[1]
        with pytest.raises(UserError, match=f"--port {taken}: cannot listen on 127.0.0.1:{taken}"):
            free_port(taken)


def test_join_timeout_is_read_and_checked(monkeypatch):
    monkeypatch.delenv(dist.TIMEOUT_ENV, raising=False)
    assert dist.join_timeout() == dist.TIMEOUT_S
    monkeypatch.setenv(dist.TIMEOUT_ENV, "7")
    assert dist.join_timeout() == 7
    for bad in ("0", "-1", "1.5", "nan", "99999"):
        monkeypatch.setenv(dist.TIMEOUT_ENV, bad)
        with pytest.raises(UserError, match=dist.TIMEOUT_ENV):
            dist.join_timeout()


def test_the_slow_axis_is_priced_on_the_scale_out_link_by_estimate_and_ledger_alike():
    """The train step's gradient AllReduce over a slow data axis costs what DCN charges, in the estimate and in
    the ledger's pricing of the same bytes; over a fast axis, what ICI charges."""
    from lab.predict.collectives import collective_time
    from lab.predict.placement import on_mesh
    from lab.predict.program.estimate import estimate_program

    chip = default_catalog().get("tpu-v5e")
    slow = dataclasses.replace(load_experiment(str(TRAIN)).plan, dtype="bfloat16")  # v5e has no fp32 peak
    fast = dataclasses.replace(slow, mesh=tuple(MeshAxis(a.name, a.size) for a in slow.mesh))
    assert slow.slow_axes == ("data",) and fast.slow_axes == ()

    def dp_op(plan):
        (op,) = [o for o in estimate_program(plan, chip).ops if o.name == "DP gradient AllReduce"]
        assert op.axes == ("data",)
        return op

    slow_op, fast_op = dp_op(slow), dp_op(fast)
    assert slow_op.bytes == fast_op.bytes
    # DCN per chip (6.25 GB/s) is far below a v5e ICI link (45 GB/s): the same bytes take several times longer
    assert slow_op.time_s > 3 * fast_op.time_s
    mesh = slow.shape
    assert on_mesh(("data",), mesh, slow.slow_axes) == {"scope": "cross-node", "members_per_node": 1}
    assert on_mesh(("model",), mesh, slow.slow_axes) == {}
    assert on_mesh(("data", "model"), mesh, slow.slow_axes) == {"scope": "cross-node", "members_per_node": 4}
    # the ledger prices an HLO collective over `data` with the same keywords the estimator used
    from lab.report.ledger import predict_ops

    hlo = _all_reduce_hlo(groups="{{0,4},{1,5},{2,6},{3,7}}")  # pairs 4 apart: the data axis of data=2 x model=4
    (slow_ledger,) = [o for o in predict_ops(hlo, chip, mesh, slow.slow_axes) if o.kind == "all-reduce"]
    (fast_ledger,) = [o for o in predict_ops(hlo, chip, mesh, ()) if o.kind == "all-reduce"]
    assert slow_ledger.axes == ("data",)
    want = collective_time("all-reduce", 4096 * 4, [2], chip, scope="cross-node", members_per_node=1).time_s
    assert slow_ledger.predicted_s == pytest.approx(want, rel=1e-12)
    assert slow_ledger.predicted_s > 3 * fast_ledger.predicted_s


def _all_reduce_hlo(groups: str) -> str:
    return f"""HloModule m, entry_computation_layout={{(f32[4096]{{0}})->f32[4096]{{0}}}}, num_partitions=8

add {{
  a = f32[] parameter(0)
  b = f32[] parameter(1)
  ROOT s = f32[] add(a, b)
}}

ENTRY e {{
  p = f32[4096]{{0}} parameter(0)
  ROOT r = f32[4096]{{0}} all-reduce(p), channel_id=1, replica_groups={groups}, use_global_device_ids=true, to_apply=add
}}
"""


@pytest.mark.parametrize(
    "processes, message",
    [
        (3, "which 3 processes cannot share evenly; use a --local-processes that divides 8"),
        (4, "the slow axes data of .* span 2 processes, not 4; use --local-processes 2"),
        (1, "launch at least 2"),
    ],
)
def test_launch_refuses_a_split_that_cannot_run(processes, message):
    r = _shardlab("launch", "--local-processes", str(processes), str(TRAIN), "--hardware", "cpu", timeout=60)
    assert r.returncode == 2, r.stderr
    (line,) = r.stderr.strip().splitlines()
    assert line.startswith("shardlab: error: ") and re.search(message, line), line


def test_launch_refuses_a_port_in_use():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        r = _shardlab("launch", "--local-processes", "2", "--port", str(port), str(MATMUL), "--hardware", "cpu")
    assert r.returncode == 2
    assert r.stderr.strip() == (
        f"shardlab: error: --port {port}: cannot listen on 127.0.0.1:{port} (Address already in use); pick another "
        "port, or leave --port out for a free one"
    )


def test_launch_checks_run_options_before_starting_anything():
    r = _shardlab("launch", "--local-processes", "2", str(MATMUL), "--bogus", timeout=60)
    assert (r.returncode, r.stderr) == (2, "shardlab run: error: unrecognized arguments: --bogus\n")
    r = _shardlab("launch", "--local-processes", "2", str(MATMUL), "--resume", timeout=60)
    assert r.returncode == 2 and r.stderr.startswith("shardlab: error: --resume continues a run of one process")


def test_a_processs_user_error_is_one_line_naming_it():
    r = _shardlab("launch", "--local-processes", "2", str(MATMUL), "--hardware", "tpu-v9", timeout=120)
    assert r.returncode == 2
    (line,) = r.stderr.strip().splitlines()  # the processes' own error lines are folded into this one
    assert re.fullmatch(
        r"shardlab: error: process [01] of 2 exited with code 2: unknown hardware 'tpu-v9'; valid: .*; stopped the "
        r"others",
        line,
    ), line


# ----- real processes -------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    """Both experiments as 2 processes x 4 devices and as 1 process x 8 devices: their JSON reports."""
    out = tmp_path_factory.mktemp("runs")
    reports = {}
    calls = ("--warmup", "1", "--repeats", "2")  # what is computed and gathered, not how fast: few calls
    for exp in (MATMUL, TRAIN):
        r = _shardlab(
            "launch", "--local-processes", "2", str(exp), "--hardware", "cpu", "--out", str(out), "--json", *calls
        )
        assert r.returncode == 0, r.stderr[-3000:]
        one = _shardlab(
            "run",
            str(exp),
            "--hardware",
            "cpu",
            "--out",
            str(out),
            "--json",
            *calls,
            # one process alone may share the suite's compiled programs (only processes started together may not)
            env=_env(XLA_FLAGS="--xla_force_host_platform_device_count=8", **_xla_cache()),
        )
        assert one.returncode == 0, one.stderr[-3000:]
        reports[exp.stem] = (json.loads(r.stdout), json.loads(one.stdout), r.stderr)
    return out, reports


@pytest.mark.parametrize("name", [MATMUL.stem, TRAIN.stem])
def test_two_processes_compute_what_one_does(launched, name):
    _, reports = launched
    two, one, _ = reports[name]
    assert two["devices"] == one["devices"] == 8
    assert two["result"]["leaves"] == one["result"]["leaves"] >= 1
    for key in ("sum", "sum_sq"):
        assert two["result"][key] == pytest.approx(one["result"][key], rel=RESULT_RTOL)
    assert two["audit"]["all_match"] is True  # the same collectives, over the same axes, as estimated


@pytest.mark.parametrize("name", [MATMUL.stem, TRAIN.stem])
def test_process_zero_gathers_every_process(launched, name):
    out, reports = launched
    two, one, stderr = reports[name]
    procs = two["processes"]
    assert [p["rank"] for p in procs] == [0, 1]
    assert all(p["local_devices"] == 4 and p["host"] == socket.gethostname() for p in procs)
    assert all(len(p["step_times_s"]) == two["summary"]["repeats"] for p in procs)
    slowest = max(procs, key=lambda p: p["step_time_measured_s"])
    assert two["slowest_process"] == slowest["rank"]
    assert two["step_time_measured_s"] == slowest["step_time_measured_s"]  # the report is the slowest process's
    assert "processes" not in one
    # process 1 kept its trace and a small JSON beside process 0's run, nothing else
    rank1 = Path(procs[1]["tensorboard"]).parent
    assert rank1.name == f"{two['run_id']}.rank1" and rank1.parent == out
    assert sorted(p.name for p in rank1.iterdir()) == [".complete", "report.json", "tensorboard"]
    small = json.loads((rank1 / "report.json").read_text())
    assert small["rank"] == 1 and small["process"] == procs[1] and small["result"] == two["result"]
    assert any(line.startswith("[rank 1] {") for line in stderr.splitlines())  # its output, prefixed


def test_train_step_slow_axis_carries_only_the_gradient_reduction(launched):
    """Tensor parallelism stays inside each process; only data-parallel collectives cross the slow axis."""
    _, reports = launched
    two, _, _ = reports[TRAIN.stem]
    axes = {tuple(o["axes"]) for o in two["ops"] if o["kind"] in ("all-reduce", "all-gather", "reduce-scatter")}
    assert axes == {("model",), ("data",)}
    named = {o["name"]: o for o in two["estimated_ops"]}
    dp = [o for name, o in named.items() if name.startswith("DP gradient AllReduce")]
    assert len(dp) == 1


def _children(pid: int) -> list[int]:
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                stat = (d / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(d.name))
    return out


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _tcp_peers(pid: int) -> set[str]:
    """The local and remote IPv4/IPv6 addresses of every TCP socket ``pid`` holds."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    addrs = set()
    for table in ("tcp", "tcp6"):
        for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
            f = line.split()
            if f[9] in inodes:
                addrs |= {f[1].split(":")[0], f[2].split(":")[0]}
    return addrs


LOOPBACK = {"0100007F", "00000000000000000000000001000000", "0000000000000000FFFF00000100007F"}
ANY = {"00000000", "00000000000000000000000000000000"}  # a listening socket's unbound end


def _slow_train(tmp_path: Path) -> Path:
    text = TRAIN.read_text().replace("repeats = 5", "repeats = 400")
    path = tmp_path / "long.toml"
    path.write_text(text)
    return path


def _start_launch(exp: Path, out: Path) -> subprocess.Popen:
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "lab",
            "launch",
            "--local-processes",
            "2",
            str(exp),
            "--hardware",
            "cpu",
            "--out",
            str(out),
        ],
        cwd=ROOT,
        env=_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _wait_for(proc: subprocess.Popen, needle: str, timeout: float = 180) -> list[str]:
    seen, deadline = [], time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = proc.stderr.readline()
        if not line:
            break
        seen.append(line)
        if needle in line:
            return seen
    raise AssertionError(f"never saw {needle!r}: {''.join(seen)[-2000:]}")


def test_killing_one_process_stops_the_launch_naming_it_and_leaves_no_orphans(tmp_path):
    launch = _start_launch(_slow_train(tmp_path), tmp_path / "runs")
    try:
        _wait_for(launch, "profiling")
        time.sleep(1.0)  # mid-profile
        children = _children(launch.pid)
        assert len(children) == 2
        for pid in children:  # every connection the processes hold is on loopback
            assert _tcp_peers(pid) - ANY <= LOOPBACK, _tcp_peers(pid)
        rank1 = next(p for p in children if f"{dist.PROCESS_ID}=1" in Path(f"/proc/{p}/environ").read_text("latin-1"))
        os.kill(rank1, signal.SIGKILL)
        _, err = launch.communicate(timeout=300)  # a hang guard, not a speed bound (benchmarks time things)
    finally:
        if launch.poll() is None:
            launch.kill()
    assert launch.returncode not in (0, None)
    assert "shardlab: error: process 1 of 2 was killed by SIGKILL; stopped the others" in err  # noticed, not hung
    assert not [p for p in children if _alive(p)]


def test_killing_the_launcher_takes_its_processes_with_it(tmp_path):
    launch = _start_launch(_slow_train(tmp_path), tmp_path / "runs")
    try:
        _wait_for(launch, "building")
        children = _children(launch.pid)
        assert len(children) == 2
    finally:
        launch.kill()
        launch.wait()
    deadline = time.monotonic() + 120  # a hang guard: the children must go, however busy the host
    while time.monotonic() < deadline and any(_alive(p) for p in children):
        time.sleep(0.1)
    assert not [p for p in children if _alive(p)]


# ----- bad settings of processes started by hand ----------------------------------------------------------------


def _by_hand(rank: int, processes: int, port: int, local: int) -> subprocess.Popen:
    """Process ``rank`` of ``processes`` started as a cluster would, told the settings under test (each of these
    tests fails before anything is written, so --out names a folder that cannot be created)."""
    env = _env(
        **{
            dist.COORDINATOR: f"127.0.0.1:{port}",
            dist.NUM_PROCESSES: str(processes),
            dist.PROCESS_ID: str(rank),
            dist.LOCAL_DEVICES: str(local),
            dist.TIMEOUT_ENV: "4",
            "JAX_PLATFORMS": "cpu",
        }
    )
    cmd = [sys.executable, "-m", "lab", "run", str(MATMUL), "--hardware", "cpu", "--quiet", "--out", "/proc/none"]
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _errors(proc: subprocess.Popen, timeout: float = 300) -> tuple[int, list[str]]:
    """The process's exit code and its shardlab lines; ``timeout`` guards against a hang (it bounds no speed)."""
    _, err = proc.communicate(timeout=timeout)
    lines = [x for x in err.splitlines() if x.startswith("shardlab: ")]
    return proc.returncode, lines


def test_an_unreachable_coordinator_is_named_within_the_timeout():
    port = free_port(None)  # nothing listens there
    code, lines = _errors(_by_hand(1, 2, port, 4))
    assert code == 2
    assert lines == [
        f"shardlab: error: process 1 found nothing listening at the coordinator 127.0.0.1:{port} within 4 s "
        f"(Connection refused); start process 0 with the same address, or fix {dist.COORDINATOR}"
    ]


def test_a_missing_peer_ends_the_wait_with_one_line_not_a_hang():
    port = free_port(None)
    code, lines = _errors(_by_hand(0, 2, port, 4))
    assert code == 2
    assert lines == [
        f"shardlab: error: process 0 of 2 could not join the distributed runtime at 127.0.0.1:{port} within 4 s "
        f"({dist.TIMEOUT_ENV}): not every process registered; check that every process was started, with the same "
        "coordinator address and process count"
    ]


def test_mismatched_process_counts_are_refused_by_every_process():
    port = free_port(None)
    first = _by_hand(0, 2, port, 4)
    second = _by_hand(1, 3, port, 4)
    for proc in (first, second):
        code, lines = _errors(proc)
        assert code == 2
        assert lines == [
            "shardlab: error: the processes were told different process counts (2, 3, in rank order; "
            f"{dist.NUM_PROCESSES}); start every process with the same count"
        ]


def test_a_mesh_larger_than_all_processes_devices_is_refused(tmp_path):
    port = free_port(None)
    procs = [_by_hand(rank, 2, port, 2) for rank in range(2)]  # 4 devices in all, the mesh wants 8
    for proc in procs:
        code, lines = _errors(proc)
        assert code == 2
        assert lines == [
            f"shardlab: error: the mesh {{'X': 2, 'Y': 4}} of {MATMUL} has 8 devices but the 2 processes have 4 "
            f"(2 each); give the mesh 4 devices, or each process 4 ({dist.LOCAL_DEVICES} or the accelerators per host)"
        ]
    assert math.prod(load_experiment(str(MATMUL)).mesh.values()) == 8


def test_distributed_with_no_cluster_to_join_says_so():
    r = _shardlab("run", str(MATMUL), "--distributed", "--hardware", "cpu", "--out", "/proc/none", timeout=60)
    assert r.returncode == 2
    (line,) = r.stderr.strip().splitlines()  # JAX's own reason sits in the parentheses, in its words
    assert line.startswith("shardlab: error: --distributed: JAX found no cluster to join here (")
    assert line.endswith(
        "): no TPU VM, SLURM or Open MPI job; start every process under one, or several on this machine with "
        "`shardlab launch`"
    )
