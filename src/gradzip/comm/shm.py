"""Memory that every rank of one node maps: the intra-node stages without the network stack.

Inside a machine, gloo moves bytes through TCP over loopback: every byte is copied through the
kernel on both sides, on the same cores that encode. For the hierarchical exchange's plain
stages a shared mapping does the same work in plain memory passes, as NCCL's and MPI's
shared-memory transports do inside a node: each rank writes its values into its slot, and after
one barrier each rank sums its share straight from the slots; the averaged shares go into one
shared output, which every rank copies after a second barrier (:mod:`gradzip.comm.hierarchy`
says where the barriers are and why the buffers can be reused from call to call).

The mappings are files in ``/dev/shm`` that every rank of the node opens and maps, then removed
as soon as every rank holds its mapping, so nothing is left behind, also when a rank dies. The
ranks of a node agree on a random name first, and check once that they really see the same
memory (a node found from a launcher variable that put ranks on several hosts would not); where
they do not, or where ``/dev/shm`` is missing, :attr:`NodeSharedMemory.usable` is False and the
exchange keeps gloo's collectives.
"""
from __future__ import annotations

import os
import secrets
from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from .topology import Topology

ROOT = "/dev/shm"


def _map(path: str, numel: int, dtype: torch.dtype) -> torch.Tensor:
    """``numel`` values of ``dtype`` in file ``path`` (created, or opened, at that size), mapped shared."""
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o600)
    try:
        if os.fstat(fd).st_size < nbytes:
            os.ftruncate(fd, nbytes)
    finally:
        os.close(fd)
    return torch.from_file(path, shared=True, size=numel, dtype=dtype)


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


class NodeSharedMemory:
    """Slots and an output per exchanged tensor, in memory the ranks of one node share."""

    def __init__(self, node_group: Optional[dist.ProcessGroup], topology: Topology) -> None:
        self.group = node_group
        self.topology = topology
        self.local_rank, self.local_size = topology.local_rank, topology.local_size
        self._buffers: Dict[str, Tuple[torch.Tensor, torch.Tensor, int]] = {}  # key -> (slots, output, last step)
        self._made = 0  # mappings made so far: the same count on every rank of the node
        self._pending: Dict[str, List[str]] = {}  # key -> its files not yet removed (see mapped)
        self._step = 0
        self.usable = False
        if os.name == "posix" and os.path.isdir(ROOT) and os.access(ROOT, os.W_OK):
            self.tag = self._agree_on_tag()
            self.usable = self._check()
        else:
            self.tag = ""
            self._agree_on_tag()  # the other ranks of the node wait for it

    def _agree_on_tag(self) -> str:
        """A random name from the node's first rank (every rank of the node calls this once)."""
        box = [secrets.token_hex(8) if self.local_rank == 0 else None]
        dist.broadcast_object_list(box, src=self.topology.nodes[self.topology.node][0], group=self.group)
        return str(box[0])

    def _path(self, what: str) -> str:
        return os.path.join(ROOT, f"gradzip-{self.tag}-{what}")

    def _check(self) -> bool:
        """Whether every rank of the node sees the others' writes (one mapping, two barriers)."""
        ok = torch.zeros(1)
        try:
            path = self._path("check")
            seen = _map(path, self.local_size, torch.float64)
            seen[self.local_rank] = float(self.topology.rank + 1)
            ok[0] = 1.0
        except OSError:
            seen = None
        dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=self.group)  # every rank has written
        if seen is not None:
            expect = torch.tensor([r + 1 for r in self.topology.nodes[self.topology.node]], dtype=torch.float64)
            ok[0] = float(ok[0] > 0 and torch.equal(seen, expect))
        dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=self.group)  # every rank has read
        if self.local_rank == 0:
            _unlink(self._path("check"))
        return bool(ok[0] > 0)

    def buffers(
        self, key: str, numel: int, dtype: torch.dtype, step: int, out_dtype: Optional[torch.dtype] = None,
    ) -> Tuple[torch.Tensor, torch.Tensor]:
        """(slots: ``(L, numel)`` of ``dtype``, one per local rank; output: ``numel`` of
        ``out_dtype``, default ``dtype``) for tensor ``key``.

        Kept from call to call; dropped when no call used them in this step or the one before
        (every rank of the node drops and remakes them at the same calls). New ones stay files
        until every rank of the node has mapped them: call :meth:`mapped` after the call's
        first barrier (not before: another rank may not have opened them yet)."""
        if step > self._step:
            self._step = step
            for k in [k for k, (_, _, used) in self._buffers.items() if used < step - 1]:
                del self._buffers[k]
        out_dtype = dtype if out_dtype is None else out_dtype
        got = self._buffers.get(key)
        if got is None or got[1].numel() != numel or got[0].dtype != dtype or got[1].dtype != out_dtype:
            self._made += 1
            new = [self._path(f"{self._made}-in"), self._path(f"{self._made}-out")]
            self._pending[key] = self._pending.get(key, []) + new
            slots = _map(new[0], self.local_size * numel, dtype).view(self.local_size, numel)
            got = (slots, _map(new[1], numel, out_dtype), step)
        self._buffers[key] = (got[0], got[1], step)
        return got[0], got[1]

    def mapped(self, key: str) -> None:
        """Every rank of the node has mapped ``key``'s buffers (a barrier has passed since
        :meth:`buffers` made them): the node's first rank removes the files, so nothing outlives the job."""
        for path in self._pending.pop(key, []):
            if self.local_rank == 0:
                _unlink(path)

    def release(self) -> None:
        self._buffers.clear()
        for key in list(self._pending):  # a call that failed before its barrier
            self.mapped(key)
