"""The built-in plugin ``qwen3``: a Hugging Face Qwen3 checkpoint, tensor parallel, batched.

``plugin_args``: ``{"model": DIR, "max_num_seqs": 64, "max_num_batched_tokens": 4096,
"block_size": 16, "kv_cache_blocks": None, "enforce_eager": False, "static_decode": False,
"max_seq_len_to_capture": 8192, "packed_weights": True, "prefix_caching": True,
"chunked_prefill": True}`` (``kv_cache_blocks`` None: sized from free memory, see
``rank_model``; the next three: the GPU path below; ``packed_weights``: on the CPU, fp32
linear layers multiply through oneDNN's prepacked weights, ``models.layers.packed``, about
1.5 to 2x faster a decode step than ``F.linear``; the last two: below). Each a bool, an int
>= 1 or None as shown; a wrong type is a ``TypeError``, an unknown key or a bad value a
``ValueError``.

Prefix caching and chunked prefill (``models/qwen3/block_manager.py``, ``scheduler.py``):

- ``prefix_caching``: a full KV block is known by a hash chained over its tokens and the
  blocks before it; a new sequence shares every full block of its prompt already cached and
  computes only the rest (at least its last token). A block is registered only once full and
  written by a forward pass, so a cancelled or failed sequence leaves nothing half-written
  for others; blocks of finished sequences stay reusable until needed (least recently used
  evicted first). Off: every prompt is computed whole.
- ``chunked_prefill``: a step carries at most ``max_num_batched_tokens`` tokens; running
  sequences take one token each (or their next prompt chunk) first, then waiting prompts take
  chunks of the rest, so that a long prompt is prefilled over several steps while running
  sequences decode one token every step; a sequence is sampled after its last chunk. Off: a
  step is a whole-prompt prefill (a prompt longer than the budget runs alone) or a decode.

The leader's ``runner.info()`` reports ``prefix_cache_hit_rate`` (prompt tokens served from
the cache / prompt tokens admitted), ``prompt_tokens``, ``cached_prompt_tokens``,
``computed_prompt_tokens``, ``cached_blocks``, ``cache_evictions``, ``prefill_chunks``,
``num_preemptions`` and the step counters.

Request, with exactly one of the
three prompt forms::

    {"prompt_token_ids": list[int] | list[list[int]],
     | "prompt": str | list[str],
     | "messages": [{"role": str, "content": str}, ...],
     "max_tokens": int (required, >= 1),
     "temperature": 0.0, "top_k": 0, "top_p": 1.0, "seed": None,
     "ignore_eos": False, "stop_token_ids": []}

``prompt`` is text, one prompt per string, tokenized with the checkpoint directory's own
tokenizer (``AutoTokenizer``, local files only; special tokens added as the tokenizer
adds them). ``messages`` is one conversation, one prompt: rendered by the tokenizer's
chat template with ``add_generation_prompt=True``, then tokenized as it stands. Both need
tokenizer files in the directory (``tokenizer.json`` or ``tokenizer_config.json``);
without them the checkpoint serves token ids only.

Result: ``{"token_ids": list[list[int]], "finish_reasons": list[str], "text": list[str]}``,
one entry per prompt (a flat prompt counts as one), generated tokens only; ``text`` (each
sequence's ids decoded with ``skip_special_tokens=True``) whenever the checkpoint has a
tokenizer, for every prompt form. A sequence stops at a ``stop_token_ids`` token or,
unless ``ignore_eos``, at the checkpoint's EOS token (the stopping token is included, as
in ``transformers.generate``): reason "stop"; or after ``max_tokens`` tokens: reason
"length". Temperature 0 is greedy.

Validation happens in the caller: ``TypeError`` for a value of the wrong type,
``ValueError`` for unknown keys, none or several prompt forms, empty prompts or text, ids
outside the vocabulary, text without tokenizer files, messages without a chat template,
a prompt plus ``max_tokens`` beyond ``max_position_embeddings``, or (when
``kv_cache_blocks`` is given) a sequence that could not fit the KV cache even alone.
Rank 0 loads the tokenizer once at build time and tokenizes each text request when it is
added (``models/qwen3/text.py``). The caller tokenizes only to check a length it cannot
bound otherwise (a conversation, or a text with more UTF-8 bytes than the model takes
tokens), loading its own copy of the tokenizer the first time, so that a prompt too long
after tokenization is refused there and never reaches a rank.

GPU path. A step with any prefill (a whole prompt, a chunk, or decodes beside a chunk) runs the
eager forward. Pure decode steps:

- CUDA graphs (``models/qwen3/static_decode.py``), on when ``cuda_graph_status`` allows:
  a CUDA device, ``enforce_eager`` False, and with tp > 1 NCCL >= 2.9.6 (collectives
  over gloo are never captured). At build time every rank captures one graph per
  (batch size, block-table width): sizes 1, 2, 4, ... up to ``max_num_seqs``; widths
  covering sequences of up to ``max_seq_len_to_capture`` tokens (one width with
  flash-attn; 256, 1024, 4096, ... tokens with torch SDPA, which attends over the whole
  width). A decode step pads its batch to the next size (padding rows store into a KV
  block no sequence owns) and replays; a step with more sequences or a longer sequence
  runs eagerly. Costs: capture time and a graph memory pool at build, one KV block, and
  with SDPA attention over up to 4 times the blocks a batch needs.
- ``static_decode=True`` runs the same static-buffer step eagerly where graphs are off
  (on CPU: to test and measure it), padded to the batch sizes but with block tables
  exactly as wide as the longest sequence needs; off by default, when decode runs the
  eager forward.
- flash-attn (``models/layers/attention.py``): used when ``flash_attn`` imports, the
  device is CUDA, the dtype fp16/bf16 and ``block_size`` a multiple of 256 (flash-attn's
  paged-KV rule); otherwise torch SDPA.

Rank 0 logs on "phyrt.qwen3" whether graphs are on and, when off, why (a WARNING on a
CUDA device unless ``enforce_eager``), and which attention runs and why.
"""

from __future__ import annotations

import threading
from typing import Any

from models.qwen3.request import Qwen3Args, TextPrompts, parse_request
from models.qwen3.text import load_tokenizer, tokenize
from runtime import BuildContext, Entry, ParallelConfig

__all__ = ["Qwen3Args", "Qwen3Entry", "parse_request"]


class Qwen3Entry(Entry):
    """Built-in plugin: a Qwen3 causal LM, tensor parallel over dense and attention tp."""

    name = "qwen3"
    parallel_domains = frozenset({"dense", "attention"})

    def __init__(self) -> None:
        self.args: Qwen3Args | None = None
        self._tokenizer: Any = None  # the caller's copy, loaded by the first request that needs it
        self._tokenizer_lock = threading.Lock()

    def configure(self, plugin_args: Any) -> None:
        """Check ``plugin_args`` and read the checkpoint's config.json (cheap: no weights)."""
        self.args = Qwen3Args.parse(plugin_args)

    def validate_parallel(self, parallel: ParallelConfig) -> None:
        super().validate_parallel(parallel)
        dense, attention = parallel.dense, parallel.attention
        if dense.tp_size != attention.tp_size or dense.dp_size != 1 or attention.dp_size != 1 \
                or attention.cp_size != 1:
            raise ValueError(
                "qwen3 splits dense and attention by the same tp and nothing else: it needs dense tp == "
                f"attention tp, dp 1 and cp 1, got dense tp {dense.tp_size} dp {dense.dp_size}, attention tp "
                f"{attention.tp_size} cp {attention.cp_size} dp {attention.dp_size}")
        tp, args = dense.tp_size, self.args
        if args is not None and (args.num_heads % tp or (args.num_kv_heads % tp and tp % args.num_kv_heads)):
            raise ValueError(
                f"qwen3 tp {tp} must divide num_attention_heads {args.num_heads}, and num_key_value_heads "
                f"{args.num_kv_heads} must divide by it or divide it")

    def validate_request(self, request: Any) -> None:
        """See the module docstring for the request and its errors."""
        if self.args is None:
            raise RuntimeError("qwen3: configure(plugin_args) was not called")
        prompts, params = parse_request(request, self.args)
        if isinstance(prompts, TextPrompts) and not prompts.surely_fit(params.max_tokens, self.args):
            tokenize(self._caller_tokenizer(), prompts, params.max_tokens, self.args)

    def _caller_tokenizer(self) -> Any:
        with self._tokenizer_lock:
            if self._tokenizer is None:
                self._tokenizer = load_tokenizer(self.args.model)
            return self._tokenizer

    def build(self, ctx: BuildContext, plugin_args: Any):
        from models.qwen3.runner import build_runner

        return build_runner(ctx, Qwen3Args.parse(plugin_args))
