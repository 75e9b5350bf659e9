"""The stepped runner of ``qwen3`` on one rank: rank 0 leads (``Qwen3Runner``), the other
ranks follow (``Qwen3Follower``); ``build_runner`` picks by rank.

    leader (world rank 0)                                  follower (world rank r > 0)
    add(id, request): parse, queue sequences; added += 1   add(id, request): added += 1
    step():                                                step():  (while more or added > count)
      schedule -> batch (tokens, positions, slots, ...)
      plan = msgpack{count, more, batch} --P.cpu_broadcast-->  plan: count, more
      forward(batch)            <------ tp collectives ------>     forward(batch)
      compute_logits -> sample -> finished requests                returns [] (the leader answers)

Agreement (what keeps the ranks in lock step although each rank's serve loop admits
requests when its own copy of them arrives, and a follower keeps no request of its own):

- Only the leader schedules and samples. Every leader step broadcasts exactly one plan
  with ``P.cpu_broadcast`` and every follower step receives exactly one. The plan carries
  the model inputs themselves (int64 arrays), so a follower needs no scheduler, no payload
  and no copy of any request to run the forward pass.
- Every rank receives every request of its replica exactly once, in the same order, so
  each rank counts the requests it added (refused ones included). A plan carries
  ``count``, how many the leader had added when it stepped, and ``more``: whether the
  leader will step again without new input (a batch ran, or its scheduler holds work).
- The leader steps while its scheduler holds work, a refusal is to report, ``more`` was
  promised, or it added requests no plan has counted yet. A follower steps while ``more``
  was promised or it added requests the last plan had not counted: each such request
  reaches the leader too, which then steps for it. So both sides step the same number of
  times: after the last batch the leader owes one model-free step (``more`` False).
- A request that reaches the leader first is scheduled at once; a follower that has not
  received it yet blocks in its serve loop until its copy arrives and then receives the
  waiting plan. A request that reaches a follower first makes it wait in ``step`` until
  the leader gets its copy and steps. A cancel changes nothing on a follower: the leader
  drops the stream and its next plan simply leaves it out.
- A plan is one broadcast of a fixed ``PLAN_BYTES`` buffer (an 8-byte length, then
  msgpack), plus a second broadcast of the remainder only when a plan is longer.
  No pickle. In inline mode (``runtime.parallel`` not initialized) nothing is sent.

The model, its KV cache and the decode paths are ``models/qwen3/rank_model.py``'s.
"""

from __future__ import annotations

from typing import Any

import msgpack
import numpy as np

from models.qwen3.block_manager import BlockManager
from models.qwen3.rank_model import Batch, RankModel, broadcast_plan
from models.qwen3.request import Qwen3Args, parse_request
from models.qwen3.sampler import sample
from models.qwen3.scheduler import Scheduler
from models.qwen3.sequence import Sequence
from models.qwen3.text import add_text, load_tokenizer, tokenize
from models.qwen3.token_streams import TokenStreams, drop_sequences
from runtime import BuildContext
from runtime import parallel as P


def build_runner(ctx: BuildContext, args: Qwen3Args) -> "Qwen3Runner | Qwen3Follower":
    """The leader's runner on world rank 0 (and inline), a follower's on every other rank."""
    return Qwen3Runner(ctx, args) if P.rank("world") == 0 else Qwen3Follower(ctx, args)


class Qwen3Runner(RankModel):
    """The leader: add/add_stream/cancel/step/has_unfinished (see the module docstring)."""

    def __init__(self, ctx: BuildContext, args: Qwen3Args) -> None:
        super().__init__(ctx, args)
        self.tokenizer = load_tokenizer(args.model)  # None: token ids only
        bm = BlockManager(self.num_blocks, args.block_size, prefix_caching=args.prefix_caching)
        self.scheduler = Scheduler(bm, args.max_num_seqs, args.max_num_batched_tokens, args.eos_ids,
                                   chunked_prefill=args.chunked_prefill)
        self._requests: dict[Any, list[Sequence]] = {}
        self._refused: list[tuple[Any, BaseException | None]] = []
        self._streams = TokenStreams()  # requests submitted as streams (models/qwen3/token_streams.py)
        self._added = 0  # requests added (refused ones too): the followers count the same
        self._counted = 0  # ``_added`` when the last plan went out
        self._owes = False  # the last plan promised another step ("more")

    @property
    def num_preemptions(self) -> int:
        return self.scheduler.num_preemptions

    def info(self) -> dict[str, Any]:
        """Counters for inspection: the prefix cache, chunked prefill, preemptions, steps."""
        s, bm = self.scheduler, self.scheduler.block_manager
        return {"prefix_caching": bm.prefix_caching, "chunked_prefill": s.chunked_prefill,
                "max_num_batched_tokens": s.max_num_batched_tokens,
                "prefix_cache_hit_rate": s.prefix_cache_hit_rate, "prompt_tokens": s.prompt_tokens,
                "cached_prompt_tokens": s.cached_prompt_tokens,
                "computed_prompt_tokens": s.prompt_tokens - s.cached_prompt_tokens,
                "cached_blocks": bm.num_cached_blocks, "cache_evictions": bm.num_evictions,
                "prefill_chunks": s.prefill_chunks, "num_preemptions": s.num_preemptions,
                "kv_cache_blocks": bm.num_blocks, "free_blocks": bm.num_free, "num_steps": self.num_steps,
                "num_static_steps": self.num_static_steps, "cuda_graphs": self.cuda_graphs,
                "attention_backend": self.attention_backend}

    def add(self, request_id: Any, request: Any) -> None:
        self._added += 1
        try:
            prompts, params = parse_request(request, self.args)
            prompts = tokenize(self.tokenizer, prompts, params.max_tokens, self.args)
            seqs = [Sequence(request_id, i, prompt, params) for i, prompt in enumerate(prompts)]
            self.scheduler.add(seqs)
        except Exception as exc:  # refused: reported by the next step
            self._refused.append((request_id, exc))
            return
        self._requests[request_id] = seqs

    def add_stream(self, request_id: Any, request: Any) -> None:
        """``add``, and each step's new ids (and text) go out as a chunk (``models/qwen3/token_streams.py``)."""
        self.add(request_id, request)
        if request_id in self._requests:
            self._streams.open(request_id, self._requests[request_id], self.tokenizer)

    def cancel(self, request_id: Any) -> None:
        """Drop a stream the caller left: its KV blocks are freed now, and the next step reports
        it (with no result), as a refusal."""
        if request_id not in self._requests:
            return
        drop_sequences(self.scheduler, self._requests.pop(request_id))
        self._streams.drop(request_id)
        self._refused.append((request_id, None))

    def has_unfinished(self) -> bool:
        busy = self.scheduler.has_unfinished() or bool(self._refused)
        return busy or self.distributed and (self._owes or self._added > self._counted)

    def step(self) -> list[tuple[Any, Any]]:
        done: list[tuple[Any, Any]] = self._refused
        self._refused = []
        seqs, is_prefill = self.scheduler.schedule()
        batch = self._prepare(seqs, is_prefill) if seqs else None
        if self.distributed:
            more = batch is not None or self.scheduler.has_unfinished()
            plan = {"count": self._added, "more": more, "batch": batch and batch.pack()}
            broadcast_plan(msgpack.packb(plan, use_bin_type=True))
            self._counted, self._owes = self._added, more
        if batch is None:
            return done
        logits = self.forward(batch)
        sampled = [i for i, seq in enumerate(seqs) if seq.completes_step]  # not mid-prefill
        rows = logits if len(sampled) == len(seqs) else logits[sampled]
        tokens = sample(rows, [seqs[i] for i in sampled]) if sampled else []
        for seq in self.scheduler.postprocess(seqs, tokens):
            siblings = self._requests.get(seq.request_id)  # None: a sibling finished it this step
            if siblings is None or not all(s.is_finished for s in siblings):
                continue
            del self._requests[seq.request_id]
            if seq.request_id in self._streams:  # its last chunk, not the whole result
                done.append((seq.request_id, self._streams.last(seq.request_id, siblings)))
            else:
                done.append((seq.request_id, add_text({"token_ids": [s.output_ids for s in siblings],
                                                       "finish_reasons": [s.finish_reason for s in siblings]},
                                                      self.tokenizer)))
        if self._streams:
            done += self._streams.partials([seqs[i] for i in sampled], self._requests)
        return done

    def _prepare(self, seqs: list[Sequence], is_prefill: bool) -> Batch:
        """The step's inputs: tokens ``num_computed .. num_computed + num_new - 1`` of each sequence."""
        bm = self.scheduler.block_manager
        ids, positions, slots, cu_seqlens, context_lens = [], [], [], [0], []
        for seq in seqs:
            start, end = seq.num_computed, seq.num_computed + seq.num_new
            ids += seq.token_ids[start:end]
            positions += range(start, end)
            slots += bm.slots(seq, start, end)
            cu_seqlens.append(len(ids))
            context_lens.append(end)
        tables = np.full((len(seqs), max(len(s.block_table) for s in seqs)), -1, dtype=np.int64)
        for row, seq in zip(tables, seqs):
            row[:len(seq.block_table)] = seq.block_table

        def arr(values: list[int]) -> np.ndarray:
            return np.asarray(values, dtype=np.int64)

        return Batch(is_prefill, arr(ids), arr(positions), arr(slots), arr(cu_seqlens), arr(context_lens), tables)


class Qwen3Follower(RankModel):
    """A follower: runs the forward pass of each plan the leader broadcasts; it holds no request
    and reports none (the leader's rank answers), so it has no ``cancel``: the engine then keeps
    no stream ids for it either."""

    def __init__(self, ctx: BuildContext, args: Qwen3Args) -> None:
        super().__init__(ctx, args)
        self._added = 0  # requests this rank's serve loop added
        self._counted = 0  # requests the leader had added at its last plan
        self._more = False  # the last plan promised another one without new input

    def add(self, request_id: Any, request: Any) -> None:
        self._added += 1

    def has_unfinished(self) -> bool:
        return self._more or self._added > self._counted

    def step(self) -> list[tuple[Any, Any]]:
        plan = msgpack.unpackb(broadcast_plan(None), raw=False)
        self._counted, self._more = plan["count"], plan["more"]
        if plan["batch"] is not None:
            self.forward(Batch.unpack(plan["batch"]))
        return []
