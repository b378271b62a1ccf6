"""The collective kinds, once: the lab's names, the HLO op each compiles to, the spellings a user may type, and the
scopes a collective can span. Every module that names a kind (the cost model, the estimates, the audit's HLO parser,
the ledger, the plots) reads this table."""

from __future__ import annotations

from lab.core.errors import UserError

KINDS = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "permute")
SCOPES = ("node", "cross-node")
# the HLO op of each kind (XLA names a permute "collective-permute"; the others as the lab does)
HLO_NAME = {kind: ("collective-permute" if kind == "permute" else kind) for kind in KINDS}
HLO_NAMES = tuple(HLO_NAME.values())
# spellings accepted for a kind, hyphens and underscores dropped (``AllGather``, ``all_gather``, ``ag``)
ALIASES = {
    "allgather": "all-gather",
    "ag": "all-gather",
    "reducescatter": "reduce-scatter",
    "rs": "reduce-scatter",
    "allreduce": "all-reduce",
    "ar": "all-reduce",
    "psum": "all-reduce",
    "alltoall": "all-to-all",
    "a2a": "all-to-all",
    "ppermute": "permute",
    "collectivepermute": "permute",
}


def canonical_kind(kind: str) -> str:
    """``AllGather``, ``all_gather``, ``ag``, ``collective-permute`` -> the lab's name; anything else refused."""
    key = str(kind).strip().lower().replace("_", "-")
    key = ALIASES.get(key.replace("-", ""), key)
    if key not in KINDS:
        raise UserError(f"unknown collective {kind!r}; valid: {', '.join(KINDS)}")
    return key


def from_hlo(name: str) -> str:
    """The lab's kind of an HLO collective op name (``collective-permute`` -> ``permute``); other names unchanged."""
    return "permute" if name == HLO_NAME["permute"] else name


def is_collective(kind: str) -> bool:
    """A kind or an HLO op name of a collective."""
    return kind in KINDS or kind in HLO_NAMES


__all__ = ["ALIASES", "HLO_NAME", "HLO_NAMES", "KINDS", "SCOPES", "canonical_kind", "from_hlo", "is_collective"]
