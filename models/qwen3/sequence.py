"""One prompt being generated: its tokens, sampling parameters, state and KV blocks.

A request with several prompts becomes several ``Sequence``s that share one
``SamplingParams``; the request is answered when the last of them finishes.
"""

from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class SamplingParams:
    """Validated by ``Qwen3Entry.validate_request``; ``top_k`` 0 means off."""

    max_tokens: int
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    ignore_eos: bool = False
    stop_token_ids: tuple[int, ...] = ()


class SequenceStatus(enum.Enum):
    WAITING = enum.auto()
    RUNNING = enum.auto()
    FINISHED = enum.auto()


_ids = itertools.count()


@dataclass(eq=False)
class Sequence:
    """``token_ids`` = prompt then generated tokens; ``block_table`` = its KV blocks in order.

    ``num_computed``: the leading tokens whose KV is in the cache (served from the prefix
    cache, or written by a forward pass); a step computes ``num_new`` more, starting there
    (a chunk of the prompt, or the one newest token). A decoding sequence holds every token
    but the last (just sampled) one, the next step's input. ``block_hashes``: the chained
    hashes of its full blocks, computed as needed (``models/qwen3/block_manager.py``);
    ``num_committed`` of its blocks are registered for others to reuse. A preempted
    sequence loses its blocks and is prefilled again over all of ``token_ids`` (minus what
    the prefix cache still holds).
    """

    request_id: object
    index: int  # position of this prompt in its request
    token_ids: list[int]
    params: SamplingParams
    seq_id: int = field(default_factory=lambda: next(_ids))
    status: SequenceStatus = SequenceStatus.WAITING
    block_table: list[int] = field(default_factory=list)
    finish_reason: str | None = None  # "stop" or "length"
    num_computed: int = 0
    num_new: int = 0
    num_committed: int = 0
    block_hashes: list[bytes] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.token_ids = list(self.token_ids)
        self.num_prompt_tokens = len(self.token_ids)
        self._generator: torch.Generator | None = None

    def generator(self, device: torch.device) -> torch.Generator | None:
        """This sequence's random stream on ``device`` (None when unseeded: the global one).

        Each prompt of a seeded request draws from its own stream, made on first use, so
        its tokens depend neither on what else shares the batch nor on preemption.
        """
        if self.params.seed is None:
            return None
        if self._generator is None:
            seed = (self.params.seed * 1_000_003 + self.index) % 2**63
            self._generator = torch.Generator(device=device).manual_seed(seed)
        return self._generator

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def completes_step(self) -> bool:
        """Whether this step's ``num_new`` tokens reach its end: then it is sampled (not mid-prefill)."""
        return self.num_computed + self.num_new == len(self.token_ids)

    @property
    def num_outputs(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def append(self, token: int, eos_ids: frozenset[int]) -> None:
        """Add a sampled token and finish the sequence if it stops or reaches ``max_tokens``."""
        self.token_ids.append(token)
        params = self.params
        if token in params.stop_token_ids or (not params.ignore_eos and token in eos_ids):
            self.finish_reason = "stop"
        elif self.num_outputs >= params.max_tokens:
            self.finish_reason = "length"
        else:
            return
        self.status = SequenceStatus.FINISHED
