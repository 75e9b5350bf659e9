"""Streamed ``qwen3`` requests on the leader: the chunks of each, and cancelling one.

A streamed request's chunks are ``{"token_ids": [[new ids], ...], "text": [new text, ...]}``,
one entry per prompt ("text" only when the checkpoint has a tokenizer, exactly when the full
result has it); the last chunk also holds ``"finish_reasons"``. Concatenated, the chunks
equal the full result: ids as they were sampled (a preempted sequence keeps its output), text
through one ``IncrementalDetokenizer`` per prompt, flushed in the last chunk.

    runner.add_stream(id, ...)  -> TokenStreams.open(id, seqs, tokenizer)
    runner._lead, each step     -> TokenStreams.partials(seqs): a Partial per request that got ids
                                   TokenStreams.last(id, seqs): the final chunk of one that finished
    runner.cancel(id)           -> drop_sequences(scheduler, seqs): out of the queues, blocks freed
"""

from __future__ import annotations

from typing import Any

from models.qwen3.scheduler import Scheduler
from models.qwen3.sequence import Sequence, SequenceStatus
from runtime import Partial


class _State:
    __slots__ = ("sent", "detokenizers")

    def __init__(self, count: int, detokenizers: list[Any] | None) -> None:
        self.sent = [0] * count  # generated ids already sent, per prompt
        self.detokenizers = detokenizers


class TokenStreams:
    """The streamed requests the leader holds, by request id."""

    def __init__(self) -> None:
        self._states: dict[Any, _State] = {}

    def __contains__(self, request_id: Any) -> bool:
        return request_id in self._states

    def __bool__(self) -> bool:
        return bool(self._states)

    def open(self, request_id: Any, seqs: list[Sequence], tokenizer: Any) -> None:
        detokenizers = None
        if tokenizer is not None:
            from models.qwen3.text import IncrementalDetokenizer

            detokenizers = [IncrementalDetokenizer(tokenizer) for _ in seqs]
        self._states[request_id] = _State(len(seqs), detokenizers)

    def drop(self, request_id: Any) -> None:
        self._states.pop(request_id, None)

    def partials(self, seqs: list[Sequence], requests: dict[Any, list[Sequence]]) -> list[tuple[Any, Partial]]:
        """A ``Partial`` for each streamed request of this step's ``seqs`` that is still running."""
        out = []
        for request_id in dict.fromkeys(seq.request_id for seq in seqs):
            state = self._states.get(request_id)
            siblings = requests.get(request_id)
            if state is None or siblings is None:
                continue
            chunk = _chunk(state, siblings, last=False)
            if chunk is not None:
                out.append((request_id, Partial(chunk)))
        return out

    def last(self, request_id: Any, siblings: list[Sequence]) -> dict[str, Any]:
        """The last chunk of a streamed request whose sequences all finished."""
        return _chunk(self._states.pop(request_id), siblings, last=True)


def _chunk(state: _State, siblings: list[Sequence], last: bool) -> dict[str, Any] | None:
    new = [seq.output_ids[sent:] for seq, sent in zip(siblings, state.sent)]
    if not last and not any(new):
        return None
    state.sent = [seq.num_outputs for seq in siblings]
    chunk: dict[str, Any] = {"token_ids": new}
    if state.detokenizers is not None:
        chunk["text"] = [d.push(ids) + (d.flush() if last else "") for d, ids in zip(state.detokenizers, new)]
    if last:
        chunk["finish_reasons"] = [seq.finish_reason for seq in siblings]
    return chunk


def drop_sequences(scheduler: Scheduler, seqs: list[Sequence]) -> None:
    """Take a cancelled request's sequences out of the scheduler and free their KV blocks."""
    for seq in seqs:
        if seq.is_finished:
            continue  # its blocks went back when it finished
        for queue in (scheduler.waiting, scheduler.running):
            if seq in queue:
                queue.remove(seq)
        scheduler.block_manager.free(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = "cancelled"
