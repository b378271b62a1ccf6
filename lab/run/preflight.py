"""The process's environment, checked before JAX starts: ``JAX_PLATFORMS`` and ``XLA_FLAGS``.

JAX reads both once, when its first backend starts, and a bad value then ends the command far from its cause:
a platform that is not here raises inside JAX's backend table (an empty ``AssertionError`` for ``cuda`` without
the CUDA plugin), a device count of 0 or -1 fails with "Could not determine process_index" or
``vector::reserve``, and a flag XLA cannot parse aborts the process from C++ after printing XLA's whole flag list
(nothing Python can catch). :func:`check_environment` refuses each of these in one line naming the variable and
a valid value, before anything runs; :func:`backend_error` words a backend that still fails to start.

What the lab cannot judge itself, a flag of XLA's other than the device count and :data:`KNOWN_FLAGS`, is tried by
XLA in a child process (3.5 s on this 2-core host: JAX's import and a CPU backend), once per process and value.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys

from lab.core.errors import UserError
from lab.core.limits import MAX_EMULATED

# Platform names JAX_PLATFORMS takes (jax._src.xla_bridge: the backend factories and their aliases).
PLATFORMS = ("cpu", "tpu", "cuda", "rocm", "gpu")
DEVICE_COUNT = "--xla_force_host_platform_device_count"
_PROBE = "import jax; jax.devices()"
# XLA flags whose value the lab checks itself, so that the usual ones cost no child process: each with its
# value's kind and the jaxlib minor versions that know it (None: every jaxlib the lab runs on, 0.10 and 0.11).
# A flag XLA drops in a later jaxlib must name the versions it was seen in, or a typo-free line would abort there.
KNOWN_FLAGS: dict[str, tuple[str, tuple[str, ...] | None]] = {
    "--xla_backend_optimization_level": ("int", None),
    "--xla_llvm_disable_expensive_passes": ("bool", None),
    "--xla_cpu_multi_thread_eigen": ("bool", None),
    "--xla_dump_to": ("text", None),
    "--xla_dump_hlo_as_text": ("bool", None),
    "--xla_cpu_use_fusion_emitters": ("bool", ("0.10",)),  # what the test suite sets on jaxlib 0.10
}
_checked: set[str] = set()  # XLA_FLAGS values the child already accepted in this process
_PROBE_TIMEOUT_S = 120
_XLA_SAYS = re.compile(
    r"(Unknown flag in XLA_FLAGS: \S+|Couldn't interpret value \S* for flag \S+|Could not open file)"
)


def check_environment(env: dict[str, str] | None = None) -> None:
    """Refuse a ``JAX_PLATFORMS`` or ``XLA_FLAGS`` that JAX or XLA would fail on, in one line (a UserError)."""
    env = dict(os.environ if env is None else env)
    _check_platforms(env.get("JAX_PLATFORMS", ""))
    _check_xla_flags(env.get("XLA_FLAGS", ""), env)


def _check_platforms(value: str) -> None:
    if not value.strip():
        return
    names = [n.strip() for n in value.split(",")]
    for n in names:
        if n.lower() not in PLATFORMS:
            what = "an empty name" if not n else f"{n!r}"
            raise UserError(
                f"JAX_PLATFORMS={value!r}: {what} is not a JAX platform; use one of {', '.join(PLATFORMS)} "
                "(e.g. JAX_PLATFORMS=cpu), or unset it to let JAX choose"
            )


def _check_xla_flags(value: str, env: dict[str, str]) -> None:
    if not value.strip():
        return
    try:
        tokens = shlex.split(value)
    except ValueError as exc:
        raise UserError(f"XLA_FLAGS={value!r}: {exc}; give flags as --name=value separated by spaces") from None
    others = []
    for t in tokens:
        if not t.startswith("--"):
            raise UserError(
                f"XLA_FLAGS={value!r}: {t!r} is not a flag (XLA would read it as a file of flags); give "
                f"--name=value, e.g. XLA_FLAGS={DEVICE_COUNT}=8"
            )
        name, _, count = t.partition("=")
        if name == DEVICE_COUNT:
            _check_count(value, count)
        else:
            others.append(t)
    if any(not _known(t) for t in others) and value not in _checked:
        _probe(value, env)
        _checked.add(value)


def _known(token: str) -> bool:
    """The flag is one of :data:`KNOWN_FLAGS` that this jaxlib knows, with a value of its kind."""
    name, eq, value = token.partition("=")
    kind, versions = KNOWN_FLAGS.get(name, (None, None))
    if kind is None or (versions is not None and _jaxlib_minor() not in versions):
        return False
    if kind == "bool":
        return not eq or value in ("true", "false")
    if kind == "int":
        return value.lstrip("-").isdigit()
    return bool(value)


def _jaxlib_minor() -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return ".".join(version("jaxlib").split(".")[:2])
    except PackageNotFoundError:
        return None


def _check_count(value: str, count: str) -> None:
    try:
        n = int(count)
    except ValueError:
        n = None
    if n is None or not 1 <= n <= MAX_EMULATED:
        raise UserError(
            f"XLA_FLAGS={value!r}: {DEVICE_COUNT} must be a whole number of host devices from 1 to {MAX_EMULATED} "
            f"(the most one process emulates), e.g. {DEVICE_COUNT}=8; got {count!r}"
        )


def _probe(value: str, env: dict[str, str]) -> None:
    """Let XLA parse the flags in a child process on the CPU backend; its own complaint, in one line."""
    child = env | {"JAX_PLATFORMS": "cpu"}
    try:
        r = subprocess.run(
            [sys.executable, "-c", _PROBE], env=child, capture_output=True, text=True, timeout=_PROBE_TIMEOUT_S
        )
    except (OSError, subprocess.TimeoutExpired):
        return  # no verdict: the command itself will meet whatever XLA says
    if r.returncode == 0:
        return
    said = _XLA_SAYS.search(r.stderr)
    why = said.group(1) if said else "XLA could not start with them"
    raise UserError(f"XLA_FLAGS={value!r}: {why}; fix or remove that flag (e.g. XLA_FLAGS={DEVICE_COUNT}=8)")


def backend_error(exc: BaseException) -> UserError | None:
    """A JAX backend that would not start, in one line naming the variable to change (None: not that)."""
    text = str(exc)
    platforms = os.environ.get("JAX_PLATFORMS", "")
    if "Unable to initialize backend" in text or (isinstance(exc, AssertionError) and _raised_in(exc, "xla_bridge")):
        reason = text.split(" (set JAX_PLATFORMS")[0].strip() or "its plugin is not installed"
        if platforms:
            return UserError(
                f"JAX_PLATFORMS={platforms!r}: JAX cannot start that platform here ({reason}); unset JAX_PLATFORMS "
                "or set JAX_PLATFORMS=cpu"
            )
        return UserError(f"JAX cannot start a backend here ({reason}); set JAX_PLATFORMS=cpu to use the host")
    if "Multiprocess computations aren't implemented on the CPU backend" in text:
        return UserError(
            f"the host cannot run one program over this many emulated devices (at most {MAX_EMULATED}); give a "
            "smaller mesh"
        )
    return None


def _raised_in(exc: BaseException, module: str) -> bool:
    """The exception was raised inside ``module`` (its innermost frame's file)."""
    tb = exc.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    return tb is not None and module in tb.tb_frame.f_code.co_filename


__all__ = ["DEVICE_COUNT", "PLATFORMS", "backend_error", "check_environment"]
