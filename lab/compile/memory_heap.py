"""The temporary heap of the default memory space, as ``memory_analysis()`` counts it: its size, and on a TPU the
fragmentation figure libtpu adds on top.

XLA places a program's temporaries in one preallocated heap per memory space (``preallocated-temp`` in the buffer
assignment). ``memory_analysis()``'s ``temp_size_in_bytes`` counts the default memory space's heap (HBM on a TPU,
host memory on XLA:CPU); a TPU's other spaces (VMEM, SMEM, sync flags) sit beside HBM and are not in it. What
:mod:`lab.compile.memory` lists at the peak is the heap's values live there; the rest of the heap at that moment
is free space (between buffers, and on a TPU the 16 KiB alignment slots the heap is carved in).

On a TPU, libtpu's ``temp_size_in_bytes`` is not the heap's size but the heap's size plus XLA's fragmentation
figure for it: ``heap + (heap - no-fragmentation peak)``, where

* ``heap`` is the allocation's size rounded up to the program's HBM alignment (``xla_jf_program_hbm_alignment_in_kib``
  in libtpu's flag file, 16 KiB);
* the no-fragmentation peak is the heap simulator's trace replayed without placing anything (each buffer it
  allocates adds its bytes until it is freed; a buffer placed by sharing another's space adds nothing), plus the
  bytes of the heap's places the simulator did not place (XLA:TPU gives each tuple index table a slot of its own
  before the simulation; they count as held throughout).

That reproduces libtpu's number to within 512 bytes on train_fsdp_tp (v5e:2x4, v5p:2x2x2),
llama3_8b_train_2layer (v5e:2x4 under remat none, selective and full; v5p:2x2x2; v6e:4x4 with a 16-chip mesh) and
llama3_8b_decode (v5e:2x4, v5p:2x2x2). On llama3_8b_decode on v6e:4x4 (a 16-chip mesh) the replay falls 4 MiB short
of libtpu's peak (one buffer that shares another's space is counted there; which such buffers libtpu counts is not
established). The figure holds no buffer: it is the heap's free space by XLA's measure, counted a second time.
libtpu's own ``peak_memory_in_bytes`` leaves it (and the heap's free space) out.

A heap that holds nothing but tuple index tables and scalars (no array of rank 1 or more) libtpu does not count at
all: ``temp_size_in_bytes`` is 0 (train_fsdp_tp with one layer, or on v6e:4x4; five small programs besides).
"""

from __future__ import annotations

from dataclasses import dataclass

from lab.compile.hlo import parse_shapes
from lab.compile.memory_dump import Allocation, HeapTrace


@dataclass(frozen=True)
class Heap:
    """The default memory space's temporary heap(s) as ``memory_analysis()`` counts them.

    ``size``: bytes, each heap rounded up to ``alignment``; 0 where the heap is not counted (``counted`` False: only
    tuple index tables and scalars, which libtpu keeps out of HBM). ``fragmentation``: the figure libtpu adds to
    ``temp_size_in_bytes`` (``size`` - ``no_fragmentation_peak``); None on the host, where nothing is added, or
    where the compile wrote no heap simulator trace."""

    size: float = 0.0
    alignment: int = 1
    counted: bool = True
    no_fragmentation_peak: float | None = None
    fragmentation: float | None = None

    def to_dict(self) -> dict[str, float | int | bool | None]:
        return {
            "size": self.size,
            "alignment": self.alignment,
            "counted": self.counted,
            "no_fragmentation_peak": self.no_fragmentation_peak,
            "fragmentation": self.fragmentation,
        }


def default_heaps(allocations: list[Allocation]) -> list[Allocation]:
    """The preallocated temporary heaps of the default memory space (color 0)."""
    return [a for a in allocations if a.kind == "temp" and a.color == 0]


def _has_array(heap: Allocation) -> bool:
    """The heap holds an array of rank 1 or more (not only tuple index tables and scalars)."""
    for v in heap.values:
        if v.shape.startswith("("):
            continue
        if any(s.dims for s in parse_shapes(v.shape)):
            return True
    return False


def _trace_of(heap: Allocation, traces: dict[int, HeapTrace]) -> HeapTrace | None:
    """The heap simulator trace that placed this heap's values (matched by value ids: libtpu's proto numbers the
    allocations differently from its text)."""
    ids = {v.id for v in heap.values}
    best = max(traces.values(), key=lambda t: len(ids & {b for _, b in t.events}), default=None)
    return best if best is not None and ids & {b for _, b in best.events} else None


def no_fragmentation_peak(heap: Allocation, trace: HeapTrace | None) -> int:
    """The heap's peak of live bytes by XLA's no-fragmentation count: the trace's allocations until they are freed
    (a buffer placed by sharing another's space adds nothing and frees nothing), plus the places no simulation
    placed (held throughout)."""
    events = trace.events if trace is not None else ()
    shared = {b for kind, b in events if kind == 2}
    live = peak = 0
    for kind, b in events:
        if kind == 0:
            live += trace.sizes.get(b, 0)
        elif kind == 1 and b not in shared:
            live -= trace.sizes.get(b, 0)
        peak = max(peak, live)
    simulated = {b for _, b in events}
    placed = {(v.offset, v.size) for v in heap.values if v.id in simulated}
    preset = {(v.offset, v.size) for v in heap.values if v.id not in simulated} - placed
    return peak + sum(size for _, size in preset)


def read_heap(allocations: list[Allocation], traces: dict[int, HeapTrace], alignment: int, tpu: bool) -> Heap:
    """The default memory space's heap as ``memory_analysis()`` counts it (see the module's docstring)."""
    heaps = default_heaps(allocations)
    align = max(int(alignment), 1)
    if tpu and not any(_has_array(h) for h in heaps):
        return Heap(0.0, align, counted=False)
    size = float(sum(-(-h.size // align) * align for h in heaps))
    if not tpu or not traces:
        return Heap(size, align)
    peak = float(sum(no_fragmentation_peak(h, _trace_of(h, traces)) for h in heaps))
    return Heap(size, align, True, peak, size - peak)


__all__ = ["Heap", "default_heaps", "no_fragmentation_peak", "read_heap"]
