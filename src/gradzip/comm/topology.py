"""Which ranks share a node: found once from the launcher's environment, the same on every rank.

torchrun gives every rank ``GROUP_RANK`` (the node's index among the nodes), ``LOCAL_RANK`` and
``LOCAL_WORLD_SIZE``; SLURM gives ``SLURM_NODEID``. Without either, the host name stands for the
node. Every rank's node key and local rank are all-gathered once (one small collective), so the
layout is derived from the same list on every rank and cannot disagree.

A layout is *hierarchical* when it has more than one node and the same number ``L > 1`` of
ranks on every node: then the exchange can be split into a fast intra-node stage and a slow
inter-node stage in which local rank i of every node handles the i-th 1/L share (as in CGX's
and Horovod's hierarchical all-reduce). Otherwise the exchange stays flat and
:attr:`Topology.reason` says why.
"""
from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from datetime import timedelta
from typing import Dict, List, Optional, Sequence, Tuple

import torch.distributed as dist

NODE_VARIABLES = ("GROUP_RANK", "SLURM_NODEID")  # torchrun's node index, SLURM's


def node_key(environ: Optional[Dict[str, str]] = None) -> Tuple[str, str]:
    """(what names this rank's node, where that came from): the launcher's node index, else the host name."""
    environ = os.environ if environ is None else environ
    for var in NODE_VARIABLES:
        if environ.get(var, "").strip():
            return f"{var}={environ[var].strip()}", var
    return f"host={socket.gethostname()}", "host name"


@dataclass(frozen=True)
class Topology:
    """The ranks of a process group by node: ``nodes[k]`` lists node k's global ranks, local rank order.

    ``rank`` is this process's global rank; ``source`` says how the nodes were found.
    """

    nodes: Tuple[Tuple[int, ...], ...]
    rank: int
    source: str = "given"

    @property
    def node(self) -> int:
        """The index of this rank's node."""
        return next(k for k, ranks in enumerate(self.nodes) if self.rank in ranks)

    @property
    def local_rank(self) -> int:
        return self.nodes[self.node].index(self.rank)

    @property
    def local_size(self) -> int:
        return len(self.nodes[self.node])

    @property
    def reason(self) -> Optional[str]:
        """None when the layout is hierarchical, else why the exchange stays flat."""
        sizes = sorted({len(r) for r in self.nodes})
        if len(self.nodes) < 2:
            return "one node"
        if len(sizes) > 1:
            return f"nodes hold different numbers of ranks ({', '.join(map(str, sizes))})"
        if sizes[0] < 2:
            return "one rank per node"
        return None

    @property
    def hierarchical(self) -> bool:
        return self.reason is None

    def cross(self, local_rank: Optional[int] = None) -> Tuple[int, ...]:
        """The ranks with local rank ``local_rank`` (default: this rank's) on every node: its peers across nodes."""
        i = self.local_rank if local_rank is None else local_rank
        return tuple(ranks[i] for ranks in self.nodes)

    def describe(self) -> Dict[str, object]:
        return {
            "nodes": len(self.nodes), "ranks_per_node": sorted({len(r) for r in self.nodes}),
            "hierarchical": self.hierarchical, "found_from": self.source,
            **({} if self.hierarchical else {"flat_because": self.reason}),
        }


def layout(keys: Sequence[Tuple[str, int]], ranks: Sequence[int]) -> Tuple[Tuple[int, ...], ...]:
    """Nodes from every rank's (node key, local rank): nodes in order of their lowest rank, each
    node's ranks by local rank (then global rank)."""
    by_node: Dict[str, List[Tuple[int, int]]] = {}
    for (key, local), rank in zip(keys, ranks):
        by_node.setdefault(key, []).append((local, rank))
    nodes = [tuple(r for _, r in sorted(members)) for members in by_node.values()]
    return tuple(sorted(nodes, key=min))


def detect(group: Optional[dist.ProcessGroup] = None) -> Topology:
    """The topology of ``group`` (default: the whole job), from every rank's environment."""
    key, source = node_key()
    local = int(os.environ.get("LOCAL_RANK") or os.environ.get("SLURM_LOCALID") or -1)  # torchrun's, else srun's
    if not dist.is_available() or not dist.is_initialized():
        return Topology(((0,),), 0, source)
    ranks = dist.get_process_group_ranks(group) if group is not None and group is not dist.group.WORLD else list(
        range(dist.get_world_size())
    )
    gathered: List[Optional[Tuple[str, int]]] = [None] * len(ranks)
    dist.all_gather_object(gathered, (key, local), group=group)
    return Topology(layout(gathered, ranks), dist.get_rank(), source)  # type: ignore[arg-type]


def node_groups(
    topology: Topology, backend: str, timeout: Optional[timedelta], whole_world: bool,
) -> Tuple[dist.ProcessGroup, dist.ProcessGroup]:
    """(this rank's node group, its group across nodes), new process groups with ``timeout``.

    On the whole job every rank creates every group in the same order (torch requires it); on a
    subgroup only its members take part, each creating the two groups it belongs to."""
    if not whole_world:
        local = dict(backend=backend, timeout=timeout, use_local_synchronization=True)
        return (
            dist.new_group(ranks=list(topology.nodes[topology.node]), **local),
            dist.new_group(ranks=list(topology.cross()), **local),
        )
    mine: List[dist.ProcessGroup] = []
    for ranks in topology.nodes:
        g = dist.new_group(ranks=list(ranks), backend=backend, timeout=timeout)
        if topology.rank in ranks:
            mine.append(g)
    for i in range(topology.local_size):
        ranks = topology.cross(i)
        g = dist.new_group(ranks=list(ranks), backend=backend, timeout=timeout)
        if topology.rank in ranks:
            mine.append(g)
    return mine[0], mine[1]
