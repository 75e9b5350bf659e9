"""Named process groups of one replica, and the collectives plugins call on them.

Imported as ``from runtime import parallel as P``; model code says
``P.all_reduce(y, group="dense_tp")`` and never touches ``torch.distributed``.

The one rank layout (pipeline outermost, tp innermost)::

    world rank = (pp_idx * cfg_size + cfg_idx) * partition + local
    dense      local = dp_idx * tp + tp_idx
    attention  local = (dp_idx * cp + cp_idx) * tp + tp_idx
    moe        local = (dp_idx * ep + ep_idx) * tp + tp_idx

A group of a name holds the ranks that differ only in that name's index, listed by
ascending index, which is the group-rank order (so group rank = position in the
tuple, and tuples are ascending world ranks). Example: cfg 2 x dense tp 2::

                 tp_idx 0   tp_idx 1
    cfg_idx 0    rank 0     rank 1      dense_tp: (0, 1) (2, 3)
    cfg_idx 1    rank 2     rank 3      cfg:      (0, 2) (1, 3)
                                        dense_dp, pipeline: (0,) (1,) (2,) (3,)

Lifecycle on a rank (the worker owns the default group)::

    dist.init_process_group(...)   worker: the replica's world, nccl or gloo
    P.initialize(parallel, rank)   every rank calls new_group for every group of
                                   size > 1 (its own or not), in ``group_layout``
                                   order; names with the same rank set share one
                                   group, "world" is the default group, and over
                                   nccl a gloo world group is added (``cpu_group``);
                                   then each gloo group of one host gets its
                                   shared-memory segment (below)
    ... plugin build / forward passes call P.* ...
    P.destroy()                    forgets the groups (does not destroy them) and
                                   unmaps their shared memory
    dist.destroy_process_group()   worker: tears down the world and every subgroup

Shared memory. A gloo group whose ranks all run on this host (same boot, pid namespace
and uid; ``shm_setup``) runs its collectives on CPU tensors through one shared segment
(``shm_collectives``): microseconds where gloo's loopback TCP takes about a millisecond.
Results are bitwise the same on every rank; a dead peer raises instead of hanging.
gloo stays the path of other groups, of CUDA tensors, of reductions of other dtypes,
and of every group when ``initialize(..., shared_memory=False)``.

Not initialized (inline mode, one rank), every group is the single rank 0 and every
collective returns its input. A group of size 1 after ``initialize`` takes the same
no-op path without calling ``torch.distributed``. A multi-rank process that forgot
``initialize`` gets a ``RuntimeError``, never a silent fallback to one rank.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from runtime.core.config import ParallelConfig
from runtime.parallel.shm_collectives import REDUCE_DTYPES
from runtime.parallel.shm_setup import create as _create_shm
from runtime.transport.shm_names import new_run_id
from runtime.transport.spin import budget_ns

GROUP_NAMES = (
    "world", "pipeline", "cfg", "dense_tp", "dense_dp",
    "attention_tp", "attention_cp", "attention_dp", "moe_tp", "moe_ep", "moe_dp",
)
REDUCE_OPS = ("sum", "max", "min", "prod", "avg")
# gloo has no AVG: "avg" sums, then divides, which works on every backend.
_DIST_OPS = {"sum": "SUM", "max": "MAX", "min": "MIN", "prod": "PRODUCT", "avg": "SUM"}


# --------------------------------------------------------------------------- layout (pure)


def _along(shape: tuple[int, ...], axis: int) -> list[tuple[int, ...]]:
    """Rank tuples varying only ``axis`` of a row-major grid, outer indices ascending."""
    strides = [math.prod(shape[i + 1:]) for i in range(len(shape))]
    others = [range(s) if i != axis else range(1) for i, s in enumerate(shape)]
    groups = []
    for index in itertools.product(*others):
        base = sum(i * st for i, st in zip(index, strides))
        groups.append(tuple(base + k * strides[axis] for k in range(shape[axis])))
    return groups


def group_layout(parallel: ParallelConfig) -> dict[str, list[tuple[int, ...]]]:
    """Every group of every name in ``GROUP_NAMES``; each group in group-rank order."""
    if not isinstance(parallel, ParallelConfig):
        raise TypeError(f"group_layout needs a ParallelConfig, got {parallel!r}")
    pp, cfg = parallel.outer.pipeline_size, parallel.outer.cfg_size
    d, a, m = parallel.dense, parallel.attention, parallel.moe
    dense = (pp, cfg, d.dp_size, d.tp_size)
    attention = (pp, cfg, a.dp_size, a.cp_size, a.tp_size)
    moe = (pp, cfg, m.dp_size, m.ep_size, m.tp_size)
    outer = (pp, cfg, parallel.partition_size)
    return {
        "world": [tuple(range(parallel.infer_replica_world_size()))],
        "pipeline": _along(outer, 0),
        "cfg": _along(outer, 1),
        "dense_tp": _along(dense, 3),
        "dense_dp": _along(dense, 2),
        "attention_tp": _along(attention, 4),
        "attention_cp": _along(attention, 3),
        "attention_dp": _along(attention, 2),
        "moe_tp": _along(moe, 4),
        "moe_ep": _along(moe, 3),
        "moe_dp": _along(moe, 2),
    }


def rank_groups(parallel: ParallelConfig, rank: int) -> dict[str, tuple[int, ...]]:
    """The group of each name that contains world ``rank``."""
    layout = group_layout(parallel)
    world = len(layout["world"][0])
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world:
        raise ValueError(f"rank must be an int in [0, {world}) for this ParallelConfig, got {rank!r}")
    return {name: next(g for g in groups if rank in g) for name, groups in layout.items()}


# --------------------------------------------------------------------------- runtime state


@dataclass(frozen=True)
class _Group:
    ranks: tuple[int, ...]  # world ranks in group-rank order
    rank: int               # this process's group rank
    handle: Any             # a ProcessGroup, or None for a single-rank group
    shm: Any = None         # its ShmGroup where its ranks share memory, else None


@dataclass(frozen=True)
class _State:
    parallel: ParallelConfig
    world_rank: int
    groups: dict[str, _Group]
    cpu_group: Any
    cpu_shm: Any            # the ShmGroup of cpu_group, or None
    shm_groups: tuple[Any, ...]  # every ShmGroup this rank holds (closed by destroy)


_state: _State | None = None


def initialize(parallel: ParallelConfig, rank: int, *, backend: str | None = None, run_id: str | None = None,
               shared_memory: bool = True) -> None:
    """Create every named group on this rank (collective: every rank of the world calls it).

    Call after ``torch.distributed.init_process_group`` made the replica's world.
    ``backend`` is used for the new groups (default: the world's backend). Over nccl a
    gloo group over the world is also made for CPU control messages (``cpu_group``).
    A one-rank layout may be initialized without a process group at all.
    ``run_id`` names the shared-memory segments (``phyrt-<run_id>-...``: the supervisor's
    run, so that its sweeps know them; a fresh id when None); ``shared_memory=False``
    keeps every collective on the process groups' own backend.
    """
    global _state
    if _state is not None:
        raise RuntimeError("runtime.parallel is already initialized on this process; call P.destroy() first")
    layout = group_layout(parallel)
    world = len(layout["world"][0])
    mine = rank_groups(parallel, rank)
    dist_up = dist.is_available() and dist.is_initialized()
    if not dist_up and world > 1:
        raise RuntimeError(
            f"P.initialize: the layout needs {world} ranks but torch.distributed is not initialized; "
            "call dist.init_process_group first")
    if dist_up and (dist.get_world_size() != world or dist.get_rank() != rank):
        raise ValueError(
            f"P.initialize: ParallelConfig needs world size {world} and was given rank {rank}, but "
            f"torch.distributed has world size {dist.get_world_size()} and rank {dist.get_rank()}")

    handles: dict[tuple[int, ...], Any] = {}
    cpu_group = None
    if dist_up:
        handles[layout["world"][0]] = dist.group.WORLD
        # Every rank walks the same layout in the same order, so new_group calls match;
        # a rank set that two names share (dense_tp == attention_tp) gets one group.
        for name in GROUP_NAMES:
            for ranks in layout[name]:
                if len(ranks) > 1 and ranks not in handles:
                    handles[ranks] = dist.new_group(list(ranks), backend=backend)
        if dist.get_backend() == "gloo":
            cpu_group = dist.group.WORLD
        else:
            cpu_group = dist.new_group(list(layout["world"][0]), backend="gloo")
    shm = _make_shm(handles, cpu_group, rank, run_id or new_run_id()) if dist_up and shared_memory else {}
    groups = {
        name: _Group(ranks, ranks.index(rank), handles.get(ranks) if len(ranks) > 1 else None, shm.get(ranks))
        for name, ranks in mine.items()
    }
    cpu_shm = shm.get("cpu", shm.get(layout["world"][0]))
    _state = _State(parallel, rank, groups, cpu_group, cpu_shm, tuple(g for g in shm.values() if g is not None))


def _make_shm(handles: dict[tuple[int, ...], Any], cpu_group: Any, rank: int, run_id: str) -> dict[Any, Any]:
    """A ShmGroup (or None) for each gloo group of this rank, keyed like ``handles``; "cpu"
    for a gloo ``cpu_group`` over an nccl world. Every rank visits the groups in the same
    order, so each group's members make it together."""
    spin_ns = budget_ns("worker")
    made: dict[Any, Any] = {}
    try:
        for ranks, handle in handles.items():
            if rank in ranks and len(ranks) > 1 and dist.get_backend(handle) == "gloo":
                made[ranks] = _create_shm(handle, ranks, ranks.index(rank), run_id, spin_ns=spin_ns)
        if cpu_group is not None and cpu_group is not dist.group.WORLD:
            world = tuple(range(dist.get_world_size()))
            made["cpu"] = _create_shm(cpu_group, world, rank, run_id, spin_ns=spin_ns)
    except BaseException:
        for group in made.values():
            if group is not None:
                group.close()
        raise
    return made


def destroy() -> None:
    """Forget the groups and unmap their shared memory. The worker's
    ``dist.destroy_process_group()`` frees the process groups."""
    global _state
    state, _state = _state, None
    for group in state.shm_groups if state is not None else ():
        group.close()


def is_initialized() -> bool:
    return _state is not None


def cpu_group() -> Any:
    """The gloo group over the world for control messages (None when not initialized)."""
    return _state.cpu_group if _state is not None else None


def uses_shared_memory(group: str = "world") -> bool:
    """Whether ``group``'s collectives on CPU tensors go through shared memory."""
    return _group(group).shm is not None


def parallel_config() -> ParallelConfig | None:
    """The layout ``initialize`` was given (None when not initialized)."""
    return _state.parallel if _state is not None else None


def _group(name: str) -> _Group:
    if name not in GROUP_NAMES:
        raise ValueError(f"unknown group {name!r}; names: {', '.join(GROUP_NAMES)}")
    if _state is None:
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            raise RuntimeError(
                f"group {name!r} asked for on a {dist.get_world_size()}-rank world, but "
                "runtime.parallel.initialize() was not called on this process")
        return _Group((0,), 0, None)
    group = _state.groups.get(name)
    if group is None or (len(group.ranks) > 1 and group.handle is None):
        raise RuntimeError(f"process group {name!r} was never created on world rank {_state.world_rank}")
    return group


def rank(group: str = "world") -> int:
    """This process's rank inside ``group``."""
    return _group(group).rank


def size(group: str = "world") -> int:
    return len(_group(group).ranks)


def group_ranks(group: str = "world") -> tuple[int, ...]:
    """The world ranks of ``group`` in group-rank order."""
    return _group(group).ranks


def is_output_rank() -> bool:
    """True on world rank 0, the rank that answers for the replica."""
    return rank("world") == 0


def _in_place(x: Any, fn: Any) -> Any:
    # torch.distributed needs contiguous buffers; write back into a strided view.
    buf = x if x.is_contiguous() else x.contiguous()
    fn(buf)
    if buf is not x:
        x.copy_(buf)
    return x


def all_reduce(x: Any, group: str, op: str = "sum") -> Any:
    """Reduce ``x`` in place over ``group`` and return it; op in sum/max/min/prod/avg."""
    if op not in REDUCE_OPS:
        raise ValueError(f"unknown reduce op {op!r}; ops: {', '.join(REDUCE_OPS)}")
    g = _group(group)
    if g.handle is None:
        return x
    if op == "avg" and not x.is_floating_point():
        raise TypeError(f"all_reduce op 'avg' needs a floating tensor, got {x.dtype}")
    if g.shm is not None and x.device.type == "cpu" and x.dtype in REDUCE_DTYPES:
        shm_op = "sum" if op == "avg" else op
        _in_place(x, lambda buf: g.shm.all_reduce(buf, shm_op))
    else:
        reduce_op = getattr(dist.ReduceOp, _DIST_OPS[op])
        _in_place(x, lambda buf: dist.all_reduce(buf, op=reduce_op, group=g.handle))
    return x.div_(len(g.ranks)) if op == "avg" else x


def all_gather(x: Any, group: str, dim: int = 0) -> Any:
    """Every rank's ``x`` concatenated along ``dim`` in group-rank order (on every rank)."""
    g = _group(group)
    if g.handle is None:
        return x
    x = x.contiguous()
    if g.shm is not None and x.device.type == "cpu":
        return torch.cat([row.view(x.shape) for row in g.shm.all_gather(x)], dim=dim)
    parts = [torch.empty_like(x) for _ in g.ranks]
    dist.all_gather(parts, x, group=g.handle)
    return torch.cat(parts, dim=dim)


def gather(x: Any, group: str, dst: int = 0, dim: int = 0) -> Any:
    """``x`` of every rank concatenated along ``dim`` on group rank ``dst``; None elsewhere."""
    g = _group(group)
    if isinstance(dst, bool) or not isinstance(dst, int) or not 0 <= dst < len(g.ranks):
        raise ValueError(f"gather dst must be a group rank in [0, {len(g.ranks)}) of {group!r}, got {dst!r}")
    if g.handle is None:
        return x
    x = x.contiguous()
    if g.shm is not None and x.device.type == "cpu":
        rows = g.shm.all_gather(x, keep=g.rank == dst)
        return torch.cat([row.view(x.shape) for row in rows], dim=dim) if rows is not None else None
    parts = [torch.empty_like(x) for _ in g.ranks] if g.rank == dst else None
    dist.gather(x, parts, dst=g.ranks[dst], group=g.handle)
    return torch.cat(parts, dim=dim) if parts is not None else None


def broadcast(x: Any, group: str, src: int = 0) -> Any:
    """Overwrite ``x`` in place with group rank ``src``'s tensor and return it."""
    g = _group(group)
    if isinstance(src, bool) or not isinstance(src, int) or not 0 <= src < len(g.ranks):
        raise ValueError(f"broadcast src must be a group rank in [0, {len(g.ranks)}) of {group!r}, got {src!r}")
    if g.handle is None:
        return x
    if g.shm is not None and x.device.type == "cpu":
        return _in_place(x, lambda buf: g.shm.broadcast(buf, src))
    return _in_place(x, lambda buf: dist.broadcast(buf, src=g.ranks[src], group=g.handle))


def cpu_broadcast(x: Any, src: int = 0) -> Any:
    """Overwrite CPU tensor ``x`` in place with world rank ``src``'s over ``cpu_group()`` (by
    shared memory where the world is one host) and return it; for control data such as a
    step's plan, on any backend."""
    if _state is None or _state.cpu_group is None:
        _group("world")  # raises on a multi-rank world that was never initialized
        return x
    if _state.cpu_shm is not None:
        return _in_place(x, lambda buf: _state.cpu_shm.broadcast(buf, src))
    return _in_place(x, lambda buf: dist.broadcast(buf, src=src, group=_state.cpu_group))


def barrier(group: str = "world") -> None:
    g = _group(group)
    if g.shm is not None:
        g.shm.barrier()
    elif g.handle is not None:
        dist.barrier(group=g.handle)
