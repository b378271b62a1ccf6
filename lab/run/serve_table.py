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
    if ("rate" in table) == ("concurrency" in table):
        raise r.error("serve", None, "needs the load: rate = <requests/s> or concurrency = <clients>, one of them")
    if table.get("requests", 16) > MAX_SERVED:
        raise r.error("serve", "requests", f"= {table['requests']}: an executed load takes at most {MAX_SERVED}")
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


__all__ = ["MAX_SERVED", "SERVE", "SERVE_LENGTHS", "serve_table"]
