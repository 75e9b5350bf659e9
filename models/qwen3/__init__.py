"""The built-in plugin ``qwen3``: a Hugging Face Qwen3 checkpoint, tensor parallel, batched.

``plugin_args``: ``{"model": DIR, "max_num_seqs": 64, "max_num_batched_tokens": 4096,
"block_size": 16, "kv_cache_blocks": None, "enforce_eager": False, "static_decode": False,
"max_seq_len_to_capture": 8192}`` (``kv_cache_blocks`` None: sized from free memory,
see ``runner``; the last three: the GPU path below). Request::

    {"prompt_token_ids": list[int] | list[list[int]], "max_tokens": int (required, >= 1),
     "temperature": 0.0, "top_k": 0, "top_p": 1.0, "seed": None,
     "ignore_eos": False, "stop_token_ids": []}

Result: ``{"token_ids": list[list[int]], "finish_reasons": list[str]}``, one entry per
prompt (a flat prompt counts as one), generated tokens only. A sequence stops at a
``stop_token_ids`` token or, unless ``ignore_eos``, at the checkpoint's EOS token
(the stopping token is included, as in ``transformers.generate``): reason "stop";
or after ``max_tokens`` tokens: reason "length". Temperature 0 is greedy.

Validation happens in the caller: ``TypeError`` for a value of the wrong type,
``ValueError`` for unknown keys, empty prompts, ids outside the vocabulary, a prompt
plus ``max_tokens`` beyond ``max_position_embeddings``, or (when ``kv_cache_blocks``
is given) a sequence that could not fit the KV cache even alone.

GPU path. Prefill always runs the eager forward. Decode steps:

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

import json
import math
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from models.qwen3.sequence import SamplingParams
from runtime.config import ParallelConfig
from runtime.plugins import BuildContext, Entry

__all__ = ["Qwen3Args", "Qwen3Entry", "parse_request"]


def _int(where: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"qwen3 {where} must be an int, got {value!r}")
    if value < minimum:
        raise ValueError(f"qwen3 {where} must be >= {minimum}, got {value}")
    return value


@dataclass(frozen=True)
class Qwen3Args:
    model: str
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 4096
    block_size: int = 16
    kv_cache_blocks: int | None = None
    enforce_eager: bool = False
    static_decode: bool = False
    max_seq_len_to_capture: int = 8192
    # read from the checkpoint's config.json (and generation_config.json for EOS)
    vocab_size: int = 0
    max_positions: int = 0
    eos_ids: frozenset[int] = frozenset()
    num_heads: int = 0
    num_kv_heads: int = 0

    @classmethod
    def parse(cls, plugin_args: Any) -> "Qwen3Args":
        if not isinstance(plugin_args, dict):
            raise TypeError(f"qwen3 plugin_args must be a dict with at least 'model', got {plugin_args!r}")
        known = ("model", "max_num_seqs", "max_num_batched_tokens", "block_size", "kv_cache_blocks",
                 "enforce_eager", "static_decode", "max_seq_len_to_capture")
        unknown = sorted(str(k) for k in plugin_args if k not in known)
        if unknown:
            raise ValueError(f"qwen3 plugin_args has unknown keys {unknown}; known: {list(known)}")
        if "model" not in plugin_args:
            raise ValueError("qwen3 plugin_args needs 'model', a Hugging Face checkpoint directory")
        args = dict(plugin_args)
        if not isinstance(args["model"], str):
            raise TypeError(f"qwen3 plugin_args['model'] must be a directory path string, got {args['model']!r}")
        for key in ("max_num_seqs", "max_num_batched_tokens", "block_size", "max_seq_len_to_capture"):
            if key in args:
                _int(f"plugin_args[{key!r}]", args[key], 1)
        if args.get("kv_cache_blocks") is not None:
            _int("plugin_args['kv_cache_blocks']", args["kv_cache_blocks"], 1)
        for key in ("enforce_eager", "static_decode"):
            if key in args and not isinstance(args[key], bool):
                raise TypeError(f"qwen3 plugin_args[{key!r}] must be a bool, got {args[key]!r}")
        path = Path(args["model"])
        if not (path / "config.json").is_file():
            raise ValueError(f"qwen3 plugin_args['model']={args['model']!r} is not a checkpoint directory "
                             "(no config.json there)")
        config = json.loads((path / "config.json").read_text())
        eos = config.get("eos_token_id")
        generation = path / "generation_config.json"
        if generation.is_file():  # transformers.generate stops on this one when it is set
            eos = json.loads(generation.read_text()).get("eos_token_id", eos)
        eos = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
        missing = [k for k in ("vocab_size", "max_position_embeddings", "num_attention_heads") if k not in config]
        if missing:
            raise ValueError(f"qwen3: {path / 'config.json'} lacks {missing}")
        heads = config["num_attention_heads"]
        return cls(**args, vocab_size=config["vocab_size"], max_positions=config["max_position_embeddings"],
                   eos_ids=frozenset(eos), num_heads=heads, num_kv_heads=config.get("num_key_value_heads") or heads)


_REQUEST_KEYS = ("prompt_token_ids", *(f.name for f in fields(SamplingParams)))


def parse_request(request: Any, args: Qwen3Args) -> tuple[list[list[int]], SamplingParams]:
    """The prompts and sampling parameters of a request, or TypeError/ValueError."""
    if not isinstance(request, dict):
        raise TypeError(f"qwen3 request must be a dict, got {type(request).__name__}")
    unknown = sorted(str(k) for k in request if k not in _REQUEST_KEYS)
    if unknown:
        raise ValueError(f"qwen3 request has unknown keys {unknown}; known: {list(_REQUEST_KEYS)}")
    for key in ("prompt_token_ids", "max_tokens"):
        if key not in request:
            raise ValueError(f"qwen3 request needs {key!r}")
    prompts = request["prompt_token_ids"]
    if not isinstance(prompts, (list, tuple)) or not prompts:
        raise (ValueError if isinstance(prompts, (list, tuple)) else TypeError)(
            f"qwen3 prompt_token_ids must be a non-empty list of ints or of lists of ints, got {prompts!r}")
    if not isinstance(prompts[0], (list, tuple)):
        prompts = [prompts]
    vocab = args.vocab_size
    for i, prompt in enumerate(prompts):
        if not isinstance(prompt, (list, tuple)):
            raise TypeError(f"qwen3 prompt {i} must be a list of ints, got {prompt!r}")
        if not prompt:
            raise ValueError(f"qwen3 prompt {i} is empty")
        for token in prompt:
            if isinstance(token, bool) or not isinstance(token, int):
                raise TypeError(f"qwen3 prompt {i} holds {token!r}, not an int token id")
            if not 0 <= token < vocab:
                raise ValueError(f"qwen3 prompt {i} holds token id {token}, outside the vocabulary [0, {vocab})")
    max_tokens = _int("max_tokens", request["max_tokens"], 1)
    longest = max(map(len, prompts)) + max_tokens
    if longest > args.max_positions:
        raise ValueError(f"qwen3 prompt ({longest - max_tokens} tokens) + max_tokens ({max_tokens}) exceeds the "
                         f"model's max_position_embeddings {args.max_positions}")
    if args.kv_cache_blocks is not None and math.ceil((longest - 1) / args.block_size) > args.kv_cache_blocks:
        raise ValueError(f"qwen3 prompt + max_tokens ({longest}) cannot fit kv_cache_blocks={args.kv_cache_blocks} "
                         f"blocks of {args.block_size} tokens")
    temperature = request.get("temperature", 0.0)
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)):
        raise TypeError(f"qwen3 temperature must be a number, got {temperature!r}")
    if not (math.isfinite(temperature) and temperature >= 0):
        raise ValueError(f"qwen3 temperature must be finite and >= 0, got {temperature}")
    top_k = _int("top_k", request.get("top_k", 0), 0)
    top_p = request.get("top_p", 1.0)
    if isinstance(top_p, bool) or not isinstance(top_p, (int, float)):
        raise TypeError(f"qwen3 top_p must be a number, got {top_p!r}")
    if not 0 < top_p <= 1:
        raise ValueError(f"qwen3 top_p must be in (0, 1], got {top_p}")
    seed = request.get("seed")
    if seed is not None and not 0 <= _int("seed", seed, 0) < 2**63:
        raise ValueError(f"qwen3 seed must be None or an int in [0, 2**63), got {seed}")
    ignore_eos = request.get("ignore_eos", False)
    if not isinstance(ignore_eos, bool):
        raise TypeError(f"qwen3 ignore_eos must be a bool, got {ignore_eos!r}")
    stop = request.get("stop_token_ids", [])
    if not isinstance(stop, (list, tuple)):
        raise TypeError(f"qwen3 stop_token_ids must be a list of ints, got {stop!r}")
    for token in stop:
        if not 0 <= _int("stop_token_ids entry", token, 0) < vocab:
            raise ValueError(f"qwen3 stop token id {token} is outside the vocabulary [0, {vocab})")
    params = SamplingParams(max_tokens=max_tokens, temperature=float(temperature), top_k=top_k,
                            top_p=float(top_p), seed=seed, ignore_eos=ignore_eos, stop_token_ids=tuple(stop))
    return [list(p) for p in prompts], params


class Qwen3Entry(Entry):
    """Built-in plugin: a Qwen3 causal LM, tensor parallel over dense and attention tp."""

    name = "qwen3"
    parallel_domains = frozenset({"dense", "attention"})

    def __init__(self) -> None:
        self.args: Qwen3Args | None = None

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
        parse_request(request, self.args)

    def build(self, ctx: BuildContext, plugin_args: Any):
        from models.qwen3.runner import Qwen3Runner

        return Qwen3Runner(ctx, Qwen3Args.parse(plugin_args))
