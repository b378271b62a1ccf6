"""The ``[serve]`` table of a ``serve`` experiment: the load its engine runs and its simulator prices (read with the
rest of the file by :mod:`lab.run.experiment`, JAX-free)."""

from __future__ import annotations

from typing import Any

from lab.core.errors import UserError
from lab.core.plan import Plan
from lab.core.schema import Field, read_table
from lab.core.serving import Lengths, PoolConfig, Request

# The load a ``serve`` experiment runs through its engine and its simulator (lab.core.serving): Poisson arrivals at
# ``rate`` or ``concurrency`` clients; each request's prompt and output lengths fixed or a range "LO-HI".
SERVE = {
    "rate": Field("number+", "Poisson arrivals, requests/s"),
    "concurrency": Field("int+", "or: clients, one request each at a time"),
    "requests": Field("int+", "requests served"),
    "seed": Field("int0", "of the arrivals, the lengths and the prompts' tokens"),
    "trace": Field(
        "str", "or: a JSON-lines file of requests beside the experiment (arrival_s, prompt_len, output_len)"
    ),
}
SERVE_LENGTHS = ("prompt_len", "output_len")
MAX_SERVED = 4096  # requests one executed load takes: each is tens of engine steps on the host


def serve_table(r, plan: Plan) -> dict[str, Any] | None:
    """The [serve] table of a ``serve`` experiment (none for another program), each request checked to fit the
    model's positions and the pool."""
    if plan.program != "serve":
        if "serve" in r.doc:
            raise r.error("serve", None, f"describes a load for program serve; {plan.program} serves no requests")
        return None
    raw = r.doc.get("serve")
    if not isinstance(raw, dict):
        raise UserError(f"{r.path}: program serve needs a [serve] table (rate = 4.0 or concurrency = 2, requests = 16)")
    table = read_table({k: v for k, v in raw.items() if k not in SERVE_LENGTHS}, SERVE, "serve", r.where("serve"))
    if sum(k in table for k in ("rate", "concurrency", "trace")) != 1:
        raise r.error(
            "serve", None, "needs the load: rate = <requests/s>, concurrency = <clients> or trace = <file>, one of them"
        )
    if table.get("requests", 16) > MAX_SERVED:
        raise r.error("serve", "requests", f"= {table['requests']}: an executed load takes at most {MAX_SERVED}")
    if "trace" in table:
        return _traced(r, plan, table)
    lengths = {}
    for key in SERVE_LENGTHS:
        value = raw.get(key, 8)
        if isinstance(value, bool) or not isinstance(value, int | str):
            raise r.error("serve", key, f'= {value!r} must be a token count or a range "LO-HI", e.g. 8 or "4-40"')
        try:
            lengths[key] = Lengths.parse(value, "")
        except UserError:
            raise r.error(
                "serve", key, f'= {value!r} must be a token count or a range "LO-HI", e.g. 8 or "4-40"'
            ) from None
    m, z = plan.model, plan.sizes
    longest = lengths["prompt_len"].hi + lengths["output_len"].hi
    if m is not None and longest - 1 > m.max_seq_len:
        raise r.error("serve", None, f"requests of up to {longest} tokens pass max_seq_len = {m.max_seq_len}")
    pool = PoolConfig(z["pages"], z["page_size"], z["max_seqs"], z["token_budget"])
    try:
        pool.check_fits(Request(0, 0.0, lengths["prompt_len"].hi, lengths["output_len"].hi))
    except UserError as exc:
        raise r.error("serve", None, f"cannot run: {exc}") from None
    return {"requests": 16, "seed": 0} | table | lengths


def _traced(r, plan: Plan, table: dict[str, Any]) -> dict[str, Any]:
    """A [serve] load read from its trace file (a path relative to the experiment's folder)."""
    from lab.core.serving import load_trace

    if any(k in r.doc["serve"] for k in (*SERVE_LENGTHS, "requests")):
        raise r.error(
            "serve", "trace", "gives every request's lengths and arrival; drop prompt_len, output_len, requests"
        )
    path = (r.path.parent / table["trace"]).resolve()
    try:
        requests = load_trace(path)
    except UserError as exc:
        raise r.error("serve", "trace", str(exc).removeprefix(f"--trace {str(path)!r} ")) from None
    if len(requests) > MAX_SERVED:
        raise r.error("serve", "trace", f"holds {len(requests)} requests: an executed load takes at most {MAX_SERVED}")
    z, m = plan.sizes, plan.model
    pool = PoolConfig(z["pages"], z["page_size"], z["max_seqs"], z["token_budget"])
    for req in requests:
        if m is not None and req.prompt_len + req.output_len - 1 > m.max_seq_len:
            raise r.error(
                "serve",
                "trace",
                f"request {req.rid} of {req.prompt_len} + {req.output_len} tokens passes max_seq_len = {m.max_seq_len}",
            )
        try:
            pool.check_fits(req)
        except UserError as exc:
            raise r.error("serve", "trace", f"cannot run request {req.rid}: {exc}") from None
    lo_p, hi_p = min(q.prompt_len for q in requests), max(q.prompt_len for q in requests)
    lo_o, hi_o = min(q.output_len for q in requests), max(q.output_len for q in requests)
    return (
        {"seed": 0}
        | table
        | {
            "requests": len(requests),
            "prompt_len": Lengths(lo_p, hi_p),
            "output_len": Lengths(lo_o, hi_o),
            "trace_requests": tuple(requests),
        }
    )


__all__ = ["MAX_SERVED", "SERVE", "SERVE_LENGTHS", "serve_table"]
