"""ExternalExecutor: this process is one rank that torchrun (or another launcher) started.

    every rank runs the same program (torchrun --nnodes N --nproc-per-node M ...)

    Engine(args, DeploymentConfig.external())
      RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT    from the launcher's environment;
      WORLD_SIZE == parallel.infer_replica_world_size()         checked before anything is built
      cuda: torch.cuda.set_device(LOCAL_RANK), nccl | cpu: gloo
      init_process_group(env://) -> P.initialize -> build the plugin -> barrier
      every process group's timeout := collective_timeout_s

    engine.step(request)             on every rank, the same request, in the same order
      (seq, fingerprint(request)) --all_gather on P.cpu_group()--> every rank's pair
        fingerprints differ      -> RequestMismatchError on every rank; the engine stays usable
        request counters differ  -> EngineUnavailableError on every rank (ids disagree for good)
      core.add(id, request); core.step() until id completed and the core holds nothing
      (a non-output rank: until the core holds nothing; its runner may report nothing)
      output rank (world rank 0) -> the result; every other rank -> None

Invariants:
- Nothing is broadcast: each rank runs its own copy of the request. The agreement
  turns "a request that differs between ranks" from a hang (or a silently wrong
  answer) into an error that every rank raises at the same point, so the ranks stay
  in step and the next request runs normally.
- A request runs to completion inside ``submit`` (in the caller's thread, under a
  lock): one request at a time, in the order this rank calls ``submit``/``step``.
  Call the engine from one thread per rank, or the order may differ between ranks.
- Request ids are a per-engine counter; they agree across ranks because every
  agreement is one collective that every rank joins (the agreement checks them too).
  A stepped runner whose ranks talk through a broadcast plan (qwen3) therefore sees
  the same ids everywhere.
- ``Entry.validate_request`` runs in ``Engine.submit``, before this executor. A
  request that fails it on some ranks only never reaches their agreement: the other
  ranks pair it with those ranks' next request (RequestMismatchError, and the ranks
  stay one request apart), or, with no next request, fail at the timeout. Validate
  the same request on every rank and it passes or fails everywhere.
- A plugin exception fails that request with the plugin's own type and the engine
  stays usable, as on the inline executor, provided every rank raised it: a rank
  that raises while its peers enter a collective leaves them waiting, and they fail
  as below.
- A collective that fails (a peer closed its connection: it died; or nothing came
  within ``collective_timeout_s``: a peer hung, died without closing, or is slower
  than the timeout) raises ``EngineUnavailableError`` naming the cause; the engine
  is then unhealthy for good. On CUDA, a failure inside an NCCL collective is
  handled by torch's NCCL watchdog, which ends the process after the timeout.
- Startup (rendezvous, group creation, the plugin's build and its collectives)
  has ``DeploymentConfig.process_config.startup_timeout_s``, since ranks load
  weights at different speeds; serving has ``collective_timeout_s``.

Cost (best of 5 runs of 100 on a loaded 2-core CPU machine; what the fingerprint covers, and
its table on your machine: ``python -m runtime.execution.fingerprint``): it is linear in the
request's Python objects and constant per large tensor (19 us for a small dict, 130 us for
1,000 token ids, about 45 us per tensor over ``FULL_BYTES``; a CUDA tensor adds one
device-to-host copy of 64 samples); the agreement is one all_gather of 16 bytes per rank
(0.2-1.3 ms on loopback gloo); a whole external step of a trivial request took 0.6-1.4 ms.
"""

from __future__ import annotations

import datetime
import itertools
import re
import threading
from concurrent.futures import Future
from typing import Any

from runtime.core.config import DeploymentConfig, EngineArgs
from runtime.core.errors import EngineUnavailableError, PhyrtError, RequestMismatchError
from runtime.execution.executor import ReplicaExecutor
from runtime.execution.fingerprint import request_fingerprint
from runtime.execution.launcher import launch_checked, launcher_env
from runtime.core.futures import resolve
from runtime.core.plugins import Entry

__all__ = ["ExternalExecutor", "RequestMismatchError", "request_fingerprint", "launcher_env"]

# What gloo's RuntimeErrors say when a peer is gone or silent (gloo raises plain
# RuntimeError, not torch.distributed.DistError, for both).
_LINK_TEXT = re.compile(r"gloo|nccl|Connection (closed|reset) by peer|Timed out waiting|Broken pipe", re.I)


def _seconds(value: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=value)


def _link_failure(exc: BaseException | None) -> str | None:
    """How a collective failed ("died", "timeout", "failed"), or None for a plugin's own error."""
    import torch.distributed as dist

    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        text = str(exc)
        if isinstance(exc, dist.DistError) or (type(exc) is RuntimeError and _LINK_TEXT.search(text)):
            if re.search(r"closed by peer|reset by peer|Broken pipe", text, re.I):
                return "died"
            if re.search(r"timed out|timeout", text, re.I):
                return "timeout"
            return "failed"
        exc = exc.__cause__ or exc.__context__
    return None


class ExternalExecutor(ReplicaExecutor):
    """The one replica of an engine under torchrun; this process is one of its ranks."""

    mode = "external"

    @classmethod
    def start(cls, entry: Entry, args: EngineArgs, deployment: DeploymentConfig) -> "ExternalExecutor":
        """Join the launcher's world and build the plugin on this rank (collective: every rank calls it).

        Raises ``ValueError`` before anything is built when the process was not
        started by a launcher or its WORLD_SIZE is not the replica's rank count.
        """
        import torch
        import torch.distributed as dist

        from runtime import parallel as P
        from runtime.execution.engine_core import EngineCore, make_context

        parallel = args.config.parallel
        env = launch_checked(args, deployment)
        if P.is_initialized():
            raise RuntimeError("runtime.parallel is already initialized in this process: an external engine "
                               "is one per process; close the other one first")
        rank, world, local_rank = env["RANK"], env["WORLD_SIZE"], env["LOCAL_RANK"]
        target = args.config.device.resolve_target()
        if target == "cuda":
            if local_rank >= torch.cuda.device_count():
                raise ValueError(f"LOCAL_RANK={local_rank} but this process sees {torch.cuda.device_count()} "
                                 "CUDA device(s) (CUDA_VISIBLE_DEVICES applies); start fewer ranks per node")
            torch.cuda.set_device(local_rank)
        backend = "nccl" if target == "cuda" else "gloo"
        startup = _seconds(deployment.process_config.startup_timeout_s)

        owns_group = not dist.is_initialized()
        success = False
        core = None
        try:
            if owns_group:
                dist.init_process_group(backend, init_method="env://", rank=rank, world_size=world,
                                        timeout=startup)
            elif dist.get_world_size() != world or dist.get_rank() != rank:
                raise ValueError(f"torch.distributed is already initialized with rank {dist.get_rank()} of "
                                 f"{dist.get_world_size()}, but the launcher says RANK={rank} of {world}")
            # gloo, not shared memory: failures here are gloo's collective timeout and closed connections
            P.initialize(parallel, rank, backend=backend, shared_memory=False)
            _set_timeout(startup)  # P's subgroups start with torch's default, not init's timeout
            ctx = make_context(args.config, rank=rank, world_size=world, replica_index=0,
                               device_index=local_rank if target == "cuda" else None)
            core = EngineCore(entry, args.plugin_args, ctx, args.config.batching.max_batch_size)
            if world > 1:  # every rank built (and ran its build-time collectives) in the startup window
                dist.barrier(group=P.cpu_group())
            _set_timeout(_seconds(deployment.collective_timeout_s))
            executor = cls(core, rank, world, local_rank if target == "cuda" else None, owns_group,
                           deployment.collective_timeout_s)
            success = True
            return executor
        finally:
            if not success:
                _release(core, owns_group)

    def __init__(self, core: Any, rank: int, world: int, device: int | None, owns_group: bool,
                 collective_timeout_s: float) -> None:
        super().__init__(0, () if device is None else (device,))
        self.rank = rank
        self.world_size = world
        self.collective_timeout_s = collective_timeout_s
        self._core = core
        self._owns_group = owns_group
        self._ids = itertools.count()
        self._run_lock = threading.Lock()  # one request at a time, in call order
        self._closed = False
        self._released = False

    def plugin_info(self) -> dict | None:
        """The runner's info on the output rank (world rank 0); None on the others."""
        return self._core.info_snapshot if self.rank == 0 and self._core is not None else None

    def submit(self, request: Any, stream: Any = None) -> Future:
        """Run ``request`` now, in this thread, and return its completed future.

        Requests run in order, one at a time: this call returns once the request has finished
        on this rank. Every rank must submit the same requests in the same order. The future
        holds the result on the output rank (world rank 0) and ``None`` on every other rank; or
        the plugin's own exception, a ``RequestMismatchError`` (the ranks' requests differ; the
        engine stays usable) or ``EngineUnavailableError`` (a collective failed; for good).
        A streamed request (``stream``) runs as any other: its one chunk is the result."""
        return super().submit(request, stream)

    def _submit(self, request: Any, future: Future, stream: Any = None, priority: int = 0) -> None:
        future.set_running_or_notify_cancel()
        with self._run_lock:
            seq = -1
            try:
                if self._closed or self._error is not None:
                    raise EngineUnavailableError(
                        f"rank {self.rank}: the external engine is not serving: {self._error or 'closed'}")
                seq = next(self._ids)
                self._agree(seq, request)
                result = self._run(seq, request)
            except Exception as exc:
                resolve(future, error=exc if isinstance(exc, PhyrtError) else self._classify(exc, seq))
            else:
                resolve(future, result=result if self.rank == 0 else None)
            finally:
                if self._closed:  # close() gave up waiting for this request: release now
                    self._release()

    # -- one request -------------------------------------------------------------------

    def _agree(self, seq: int, request: Any) -> None:
        """Compare (seq, fingerprint) with every rank; raise the same error on every rank."""
        if self.world_size == 1:
            return
        import torch
        import torch.distributed as dist

        from runtime import parallel as P

        try:
            fingerprint = request_fingerprint(request)
        except Exception as exc:  # never leave the peers alone in the all_gather: disagree instead
            fingerprint = request_fingerprint(f"unfingerprintable: {type(exc).__qualname__}: {exc}")
        mine = torch.tensor([seq, fingerprint - (1 << 64) if fingerprint >= 1 << 63 else fingerprint],
                            dtype=torch.int64)
        gathered = torch.empty(self.world_size, 2, dtype=torch.int64)
        try:
            dist.all_gather(list(gathered.unbind(0)), mine, group=P.cpu_group())
        except Exception as exc:
            raise self._classify(exc, seq, "the agreement on request", always=True) from exc
        rows = gathered.tolist()
        seqs = [row[0] for row in rows]
        prints = {r: row[1] % (1 << 64) for r, row in enumerate(rows)}
        if len(set(seqs)) > 1:  # only if a collective of some rank got paired with another kind
            reason = (f"the ranks' request counters differ ({dict(enumerate(seqs))}), so request ids no longer agree "
                      "between ranks; every rank must call step() with the same requests in the same order")
            self.mark_failed(reason)
            raise EngineUnavailableError(f"rank {self.rank}: {reason}")
        if len(set(prints.values())) > 1:
            differ = sorted(r for r, fp in prints.items() if fp != prints[0])
            raise RequestMismatchError(
                f"rank {self.rank}: request #{seq} differs between ranks: ranks {differ} have a different "
                f"request fingerprint than rank 0 ({', '.join(f'rank {r}: {fp:016x}' for r, fp in prints.items())}); "
                "nothing ran and the engine stays usable. Every rank must call step() with the same request: read "
                "the same input on every rank, or receive it on one rank and broadcast it with torch.distributed",
                prints)

    def _run(self, seq: int, request: Any) -> Any:
        """Drive the core until request ``seq`` finished and the core holds nothing more. A rank other
        than the output rank may never hear of ``seq``'s end (a runner whose followers report
        nothing, as qwen3's): there it is done once the core holds nothing unfinished."""
        core = self._core
        core.add(seq, request)  # raises for this request only (the inline executor's rule)
        finished, result, error = self.rank != 0, None, None
        while not finished or core.has_unfinished():
            if not finished and not core.has_unfinished():
                reason = (f"the plugin's runner has nothing unfinished but never completed request #{seq}; "
                          "its ranks may be out of step")
                self.mark_failed(reason)
                raise EngineUnavailableError(f"rank {self.rank}: {reason}")
            try:
                completions = core.step()
            except Exception as exc:  # the runner itself broke (the inline executor's rule)
                if _link_failure(exc) is None:
                    reason = f"the plugin's runner failed: {type(exc).__name__}: {exc}"
                    self.mark_failed(reason)
                    raise EngineUnavailableError(f"rank {self.rank}: {reason}") from exc
                raise
            for request_id, value, exc in completions:
                if request_id == seq:
                    finished, result, error = True, value, exc
        if error is not None:
            raise error
        return result

    def _classify(self, exc: BaseException, seq: int, where: str = "request",
                  always: bool = False) -> BaseException:
        """The plugin's own exception, or EngineUnavailableError when a collective failed
        (``always``: the exception came from a collective of the executor's own)."""
        how = _link_failure(exc) or ("failed" if always else None)
        if how is None:
            return exc
        cause = {
            "died": "a peer rank closed its connection (it died)",
            "timeout": f"no answer within collective_timeout_s={self.collective_timeout_s:g} s (a peer rank hung, "
                       "died without closing its connection, or is slower than the timeout)",
            "failed": "the collective failed",
        }[how]
        reason = f"{where} #{seq} failed on rank {self.rank}: {cause}: {type(exc).__name__}: {exc}"
        self.mark_failed(reason)
        error = EngineUnavailableError(f"{reason}; this engine can no longer serve: restart every rank")
        error.__cause__ = exc
        return error

    # -- shutdown ----------------------------------------------------------------------

    def close(self, timeout: float | None = None) -> None:
        """Release the plugin, the named groups and (if this engine made it) the process group.

        Local to this rank (no collective); idempotent. A request running in another
        thread is waited for up to ``timeout`` seconds (None: until it ends); past
        that, the engine is marked closed and that thread releases it when its
        request ends.
        """
        self._closed = True
        self.mark_failed("the engine is closed")
        if self._run_lock.acquire(timeout=-1 if timeout is None else timeout):
            try:
                self._release()
            finally:
                self._run_lock.release()

    def _release(self) -> None:
        """Once, under ``_run_lock``."""
        if self._released:
            return
        self._released = True
        _release(self._core, self._owns_group)


def _set_timeout(timeout: datetime.timedelta) -> None:
    """Give every process group of this process ``timeout``.

    ``P.initialize`` makes its groups with torch's default (30 minutes for gloo), and
    torch has no public per-group setter. ``_set_pg_timeout`` is its private one;
    torchtitan uses it the same way (a long timeout to start, a short one after).
    Over gloo it bounds every collective; over nccl it arms the watchdog that ends
    the process.
    """
    import warnings

    import torch
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    setter = getattr(c10d, "_set_pg_timeout", None)
    world = getattr(c10d, "_world", None)
    if setter is None or world is None:
        warnings.warn(f"torch {torch.__version__} has no distributed_c10d._set_pg_timeout: the process groups "
                      "keep torch's default timeout (30 minutes for gloo)", RuntimeWarning, stacklevel=2)
        return
    for group in list(world.pg_map):
        if group is not None and dist.get_rank(group) >= 0:
            setter(timeout, group)


def _release(core: Any, owns_group: bool) -> None:
    from runtime import parallel as P

    try:
        if core is not None:
            core.close()
    finally:
        P.destroy()
        if owns_group:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()
