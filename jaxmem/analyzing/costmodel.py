"""The cost model the planners rank decisions with (third box of the data flow).

For a set ``D`` of values to recompute and a set ``O`` of values to offload, the model
predicts

- the **recompute cost**: FLOPs, bytes and time of the nodes that re-create the dropped
  values, region by region, as :mod:`jaxmem.rewriting.rewrite` re-emits them (chains start and end
  where :mod:`jaxmem.analyzing.chains` says: when a neighbour is dropped too, the chain grows
  through
  it; chains are re-emitted once per backward region, so a long segment is paid once per
  region);
- the **transfer cost** of offloading: ``2 x bytes / host link bandwidth`` for the round trip,
  overlapped with the step's compute (the part that cannot hide is charged);
- the **device peak**: a calibrated base plus, at the worst backward region, the bytes kept
  for that region or later ones (kept residuals, and the values chains start from) plus that
  region's recompute working set; at least everything kept across the forward/backward
  boundary.

Costs are in seconds on a :class:`DeviceProfile` (presets for CPU, A100, H100, H200 or your
own); FLOPs are reported too. The model ranks; the compiler decides: the budget loop in
:mod:`jaxmem.planning.budget` always checks XLA's compiled peak.
"""

from __future__ import annotations

import copy
import dataclasses
from collections import defaultdict
from collections.abc import Iterable
from typing import Any

import jax
import numpy as np

from jaxmem.analyzing import chains
from jaxmem.analyzing.analysis import Analysis
from jaxmem.analyzing.liveness import materialised
from jaxmem.tracing.program import region_of


@dataclasses.dataclass(frozen=True)
class DeviceProfile:
    """What the device can do, for turning FLOPs and bytes into seconds.

    Attributes:
      name: a label.
      flops_per_s: peak arithmetic throughput (dense, the dtype you train in).
      memory_bw: device memory bandwidth, bytes/s.
      host_bw: host link bandwidth (PCIe / NVLink-C2C), bytes/s, per direction.
      overlap: fraction of the step's compute time that host transfers can hide under
        (copies run on their own engine; 1.0 = perfectly overlapped).
      interconnect_bw: device-to-device bandwidth (NVLink, ICI), bytes/s per direction:
        what a collective re-run in the backward pass costs (an FSDP re-gather).
    """

    name: str
    flops_per_s: float
    memory_bw: float
    host_bw: float
    overlap: float = 0.8
    interconnect_bw: float = 1.0e10

    def node_time(self, flops: float, nbytes: float) -> float:
        """Roofline time of one node: the larger of compute and memory time."""
        return max(flops / self.flops_per_s, nbytes / self.memory_bw)

    def transfer_time(self, nbytes: float) -> float:
        return nbytes / self.host_bw

    def collective_time(self, nbytes: float) -> float:
        """Seconds to move ``nbytes`` into one device over the interconnect."""
        return nbytes / self.interconnect_bw

    @staticmethod
    def get(profile: DeviceProfile | str | None = None) -> DeviceProfile:
        """A preset by name (``"cpu"``, ``"a100"``, ``"h100"``, ``"h200"``), a profile
        as is, or (``None``) the preset matching ``jax.devices()[0]``."""
        if isinstance(profile, DeviceProfile):
            return profile
        if profile is None:
            return DeviceProfile.detect()
        key = str(profile).lower().replace("-", "").replace(" ", "")
        if key not in PROFILES:
            raise ValueError(f"unknown device profile {profile!r}; choose one of "
                             f"{sorted(PROFILES)} or pass a DeviceProfile(...)")
        return PROFILES[key]

    @staticmethod
    def detect() -> DeviceProfile:
        try:
            kind = jax.devices()[0].device_kind.lower()
        except Exception:  # noqa: BLE001 - no backend: assume CPU
            return PROFILES["cpu"]
        for key in ("h200", "h100", "a100"):
            if key in kind.replace(" ", ""):
                return PROFILES[key]
        return PROFILES["cpu"]


#: Presets. GPU figures are the vendors' dense bf16 peaks, HBM bandwidth and PCIe
#: (per direction): A100-80GB SXM 312 TFLOP/s, 2.04 TB/s, PCIe4 x16 ~25 GB/s;
#: H100 SXM 989 TFLOP/s, 3.35 TB/s, PCIe5 x16 ~55 GB/s; H200 989 TFLOP/s, 4.8 TB/s, ~55 GB/s.
#: CPU is a 2-core laptop-class guess: 100 GFLOP/s, 20 GB/s, host "link" = memcpy 10 GB/s.
#: Interconnect, per direction: NVLink 3 (A100) 300 GB/s, NVLink 4 (H100, H200) 450 GB/s;
#: CPU host devices share memory (memcpy, 10 GB/s).
PROFILES: dict[str, DeviceProfile] = {
    "cpu": DeviceProfile("cpu", 1.0e11, 2.0e10, 1.0e10, interconnect_bw=1.0e10),
    "a100": DeviceProfile("a100", 3.12e14, 2.04e12, 2.5e10, interconnect_bw=3.0e11),
    "h100": DeviceProfile("h100", 9.89e14, 3.35e12, 5.5e10, interconnect_bw=4.5e11),
    "h200": DeviceProfile("h200", 9.89e14, 4.8e12, 5.5e10, interconnect_bw=4.5e11),
}


@dataclasses.dataclass
class Region:
    """One backward region: a run of backward nodes of one layer that read residuals."""

    reads: frozenset[int]


@dataclasses.dataclass
class RegionState:
    """What one region replays under a (drop, offload) pair."""

    nodes: frozenset[int]    # the chain's nodes
    starts: frozenset[int]   # values the program makes that the chain starts from (stored)
    time: float
    flops: float
    transient: int           # the chain's materialised outputs: its working set


@dataclasses.dataclass(frozen=True)
class Evaluation:
    """The model's verdict on one (D, O)."""

    peak: int
    time: float           # predicted extra step time, seconds (recompute + exposed transfer)
    flops: float          # recompute FLOPs
    stored: int           # bytes kept across the forward/backward boundary
    transient: int        # largest per-region recompute working set
    offload_bytes: int
    transfer_time: float  # exposed (not overlapped) transfer time


class CostModel:
    """Cost and peak predictions for recompute/offload decisions on one :class:`Analysis`."""

    def __init__(self, analysis: Analysis, profile: DeviceProfile | str | None = None,
                 base_peak: int | None = None) -> None:
        self.analysis = analysis
        self.profile = DeviceProfile.get(profile)
        prog = self.program = analysis.program
        self.mat = materialised(prog, analysis.platform, fold_dots=False)
        self.residual_ids = frozenset(r.value for r in analysis.residuals)
        self.activations = frozenset(r.value for r in analysis.residuals if r.is_activation)
        # Stored values the planner may drop (residual activations and anchors the rewrite
        # can replay) and the fixed ones it may not (see jaxmem.analyzing.chains.stored_values).
        self.candidates, self.fixed = chains.stored_values(prog, self.residual_ids)
        # XLA keeps forward values that cross into the backward pass (fusion does not
        # duplicate across the barrier-kept phases), so a stored value costs its full size.
        self.bytes = {v: prog.values[v].nbytes for v in self.candidates | self.fixed}
        # node times and materialised output bytes (the recompute working set)
        p = self.profile
        self.node_out = [sum(prog.values[o].nbytes for o in n.outputs if self.mat[o])
                         for n in prog.nodes]
        self.node_time = [p.node_time(n.flops, 2 * self.node_out[n.index] + 1)
                          for n in prog.nodes]
        self._cut(None)
        # offload windows: compute time between production and first backward read
        cum = [0.0]
        for t in self.node_time:
            cum.append(cum[-1] + t)
        self.step_time = cum[-1]
        self._cum = cum
        self.window: dict[int, float] = {}
        for r in analysis.residuals:
            if r.value in self.activations and r.readers:
                self.window[r.value] = cum[min(r.readers)] - cum[r.produced_at + 1]
        # Calibration: peak = floor + kappa * (model bytes). The floor is what no plan can
        # remove (the arguments); kappa maps the model's bytes onto the plain-jit peak (XLA
        # does not keep every residual at once), so "keep everything" predicts that peak.
        self.base_stored = self._stored(frozenset(), frozenset(), {})
        predicted = analysis.peak_bytes if base_peak is None else base_peak
        self.floor = min(analysis.argument_bytes, predicted)
        self.kappa = float(np.clip((predicted - self.floor) / max(self.base_stored, 1),
                                   0.05, 1.0))
        self.base = predicted - self.kappa * self.base_stored  # == floor unless clipped

    def _cut(self, region_depth: int | None) -> None:
        """The backward regions (cut where residual activations are read, and at block
        boundaries of ``region_depth``; :func:`jaxmem.analyzing.chains.backward_regions`)
        and the regions that read each value."""
        prog, acts = self.program, self.activations
        self.regions = [
            Region(frozenset(v for i in nodes for v in prog.nodes[i].inputs if v in acts))
            for nodes in chains.backward_regions(
                prog, lambda n: any(v in acts for v in n.inputs), region_depth)]
        self.readers: dict[int, list[int]] = defaultdict(list)
        for i, r in enumerate(self.regions):
            for v in r.reads:
                self.readers[v].append(i)

    def blocks(self, region_depth: int | None, keep: frozenset[int] = frozenset()
               ) -> CostModel:
        """A copy whose backward regions are also cut at ``region_depth``'s block
        boundaries, with ``keep`` (a block plan's kept boundary values) as chain starts: the
        cost model of a block plan. This model is not changed."""
        m = copy.copy(self)
        m.residual_ids = self.residual_ids | keep
        m.bytes = dict(self.bytes)
        for v in keep:
            m.bytes.setdefault(v, self.program.values[v].nbytes)
        m._cut(region_depth)
        return m

    def scale(self, raw: float) -> int:
        """Model bytes -> predicted peak bytes."""
        return int(self.base + self.kappa * raw)

    def unscale(self, peak: float) -> float:
        """Predicted peak bytes -> model bytes (inverse of :meth:`scale`)."""
        return (peak - self.base) / self.kappa

    # --- the model ------------------------------------------------------------------------
    def walk(self, i: int, drop: Any, off: Any) -> RegionState:
        """The recompute chain of region ``i`` under (drop, off), as the rewrite replays it."""
        targets = [v for v in self.regions[i].reads if v in drop]
        prog = self.program
        starts = chains.chain_start(prog, dropped=drop, kept=self.residual_ids, offloaded=off)
        nodes, inputs = chains.replay_chain(prog, targets, starts)
        made = [v for v in inputs if prog.values[v].producer is not None]
        return RegionState(
            nodes=frozenset(nodes), starts=frozenset(made),
            time=sum(self.node_time[n] for n in nodes),
            flops=sum(prog.nodes[n].flops for n in nodes),
            transient=sum(self.node_out[n] for n in nodes))

    def last_region(self, v: int, start_in: Iterable[int]) -> int:
        """The last backward region that needs stored value ``v``: one that reads it, or
        one of the regions ``start_in`` whose chains start from it."""
        return max([*self.readers.get(v, ()), *start_in], default=0)

    def start_regions(self, states: dict[int, RegionState]) -> dict[int, set[int]]:
        """Value -> the regions whose chains start from it."""
        out: dict[int, set[int]] = defaultdict(set)
        for i, s in states.items():
            for a in s.starts:
                out[a].add(i)
        return out

    def alive_bytes(self, drop: Any, off: Any, states: dict[int, RegionState]
                    ) -> np.ndarray:
        """Per region i: bytes of stored values still needed at region i or later."""
        sregs = self.start_regions(states)
        by_last = np.zeros(max(1, len(self.regions)), dtype=np.int64)
        for v in self.activations | set(sregs):
            if v in drop or v in off:
                continue
            b = self.bytes.get(v, 0)
            if b:
                by_last[self.last_region(v, sregs.get(v, ()))] += b
        return np.cumsum(by_last[::-1])[::-1]

    def raw_peak(self, alive: np.ndarray, states: dict[int, RegionState]) -> int:
        """Model bytes at the worst backward region (unscaled): the stored values still
        needed there (``alive``, :meth:`alive_bytes`) and its recompute working set; at
        least everything stored across the forward/backward boundary."""
        trans = np.zeros_like(alive)
        for i, s in states.items():
            trans[i] = s.transient
        return max(int(alive[0]), int((alive + trans).max()))

    def peak_of(self, alive: np.ndarray, states: dict[int, RegionState]) -> int:
        return self.scale(self.raw_peak(alive, states))

    def _stored(self, drop: Any, off: Any, states: dict[int, RegionState]) -> int:
        return int(self.alive_bytes(drop, off, states)[0])

    def transfer(self, off: Iterable[int], region_depth: int | None = None) -> float:
        """Exposed transfer time of offloading ``off`` (seconds): the round trips beyond
        ``overlap`` of the step's compute, plus each copy's part that does not fit in its
        window (the compute between its production and its first backward use)."""
        p = self.profile
        off = list(off)
        if not off:
            return 0.0

        def nbytes(v: int) -> int:
            return self.bytes.get(v) or self.program.values[v].nbytes

        link = sum(2 * p.transfer_time(nbytes(v)) for v in off)
        exposed = max(0.0, link - p.overlap * self.step_time)
        for v in off:
            exposed += max(0.0, p.transfer_time(nbytes(v)) - self.window_of(v, region_depth))
        return exposed

    def window_of(self, v: int, region_depth: int | None = None) -> float:
        """Compute time (s) between the production of ``v`` and its first use in the
        backward pass: a backward read, or (block plans, ``region_depth``) the first backward
        equation of a block whose forward reads it."""
        if v in self.window:
            return self.window[v]
        prog = self.program
        p = prog.values[v].producer
        if p is None:
            return 0.0

        users = [prog.nodes[i] for i in prog.users.get(v, ())]
        blocks = {region_of(n, region_depth)[1] for n in users if n.phase == "forward"}
        first = next((n.index for n in prog.nodes if n.phase == "backward"
                      and (v in n.inputs or region_of(n, region_depth)[1] in blocks)), None)
        if first is None:
            return 0.0
        return max(0.0, self._cum[first] - self._cum[p + 1])

    def states(self, drop: Any, off: Any) -> dict[int, RegionState]:
        return {i: self.walk(i, drop, off) for i in range(len(self.regions))
                if any(v in drop for v in self.regions[i].reads)}

    def evaluate(self, drop: Iterable[int] = (), off: Iterable[int] = ()) -> Evaluation:
        drop, off = frozenset(drop), frozenset(off)
        st = self.states(drop, off)
        alive = self.alive_bytes(drop, off, st)
        trans = max((s.transient for s in st.values()), default=0)
        tt = self.transfer(off)
        return Evaluation(
            peak=self.peak_of(alive, st),
            time=sum(s.time for s in st.values()) + tt,
            flops=sum(s.flops for s in st.values()),
            stored=int(alive[0]), transient=trans,
            offload_bytes=sum(self.bytes.get(v, 0) for v in off), transfer_time=tt)

    def offloadable(self) -> frozenset[int]:
        return frozenset(v for v in self.activations
                         if v in self.candidates and self.bytes.get(v, 0) > 0)
