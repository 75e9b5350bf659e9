"""The qwen3 plugin's arguments (``Qwen3Args``) and request parsing (``parse_request``),
shared by the entry (validation in the caller) and the runner (on every rank). Text prompts
come out of parsing as ``TextPrompts``; ``models/qwen3/text.py`` tokenizes them."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from models.qwen3.sequence import SamplingParams

#: files of which one makes a checkpoint directory's tokenizer loadable by ``AutoTokenizer``
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
#: tokens a tokenizer may add to a text beyond those covering its bytes (BOS, EOS, a prefix)
ADDED_TOKENS = 8


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
    packed_weights: bool = True
    prefix_caching: bool = True
    chunked_prefill: bool = True
    # read from the checkpoint's config.json (and generation_config.json for EOS)
    vocab_size: int = 0
    max_positions: int = 0
    eos_ids: frozenset[int] = frozenset()
    num_heads: int = 0
    num_kv_heads: int = 0
    # what the directory's tokenizer files offer (read without loading them)
    has_tokenizer: bool = False
    has_chat_template: bool = False

    @classmethod
    def parse(cls, plugin_args: Any) -> "Qwen3Args":
        if not isinstance(plugin_args, dict):
            raise TypeError(f"qwen3 plugin_args must be a dict with at least 'model', got {plugin_args!r}")
        known = ("model", "max_num_seqs", "max_num_batched_tokens", "block_size", "kv_cache_blocks",
                 "enforce_eager", "static_decode", "max_seq_len_to_capture", "packed_weights", "prefix_caching",
                 "chunked_prefill")
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
        for key in ("enforce_eager", "static_decode", "packed_weights", "prefix_caching", "chunked_prefill"):
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
                   eos_ids=frozenset(eos), num_heads=heads, num_kv_heads=config.get("num_key_value_heads") or heads,
                   has_tokenizer=has_tokenizer_files(path), has_chat_template=_has_chat_template(path))

    def max_prompt_tokens(self, max_tokens: int) -> int:
        """The longest prompt that ``max_tokens`` more tokens still fit (positions, and the KV cache when sized)."""
        longest = self.max_positions
        if self.kv_cache_blocks is not None:
            longest = min(longest, self.kv_cache_blocks * self.block_size + 1)
        return longest - max_tokens


def has_tokenizer_files(path: Path) -> bool:
    return any((path / name).is_file() for name in TOKENIZER_FILES)


def _has_chat_template(path: Path) -> bool:
    """Whether the tokenizer files hold a chat template (transformers writes it to either place)."""
    if (path / "chat_template.jinja").is_file():
        return True
    config = path / "tokenizer_config.json"
    try:
        return config.is_file() and bool(json.loads(config.read_text()).get("chat_template"))
    except (ValueError, AttributeError):  # not a JSON object: loading the tokenizer reports it
        return False


@dataclass(frozen=True)
class TextPrompts:
    """A text request's prompts, before tokenization: ``texts`` (one prompt each), or one
    conversation, ``messages``, for the chat template."""

    texts: tuple[str, ...] = ()
    messages: tuple[dict[str, str], ...] | None = None

    def __len__(self) -> int:
        return 1 if self.messages is not None else len(self.texts)

    def surely_fit(self, max_tokens: int, args: Qwen3Args) -> bool:
        """True when each text fits without tokenizing it: a token of a byte-level BPE covers at
        least one UTF-8 byte of the text, and ``ADDED_TOKENS`` spare the ones a tokenizer adds. A
        conversation is never known to fit before its template is rendered."""
        if self.messages is not None:
            return False
        longest = max(len(t.encode("utf-8")) for t in self.texts) + ADDED_TOKENS
        return longest <= args.max_prompt_tokens(max_tokens)


_PROMPT_KEYS = ("prompt_token_ids", "prompt", "messages")
_REQUEST_KEYS = (*_PROMPT_KEYS, *(f.name for f in fields(SamplingParams)))


def parse_request(request: Any, args: Qwen3Args) -> tuple[list[list[int]] | TextPrompts, SamplingParams]:
    """The prompts and sampling parameters of a request, or TypeError/ValueError.

    Token-id prompts are checked against the model's limits here; text prompts after
    tokenization (``models.qwen3.text.tokenize``)."""
    if not isinstance(request, dict):
        raise TypeError(f"qwen3 request must be a dict, got {type(request).__name__}")
    unknown = sorted(str(k) for k in request if k not in _REQUEST_KEYS)
    if unknown:
        raise ValueError(f"qwen3 request has unknown keys {unknown}; known: {list(_REQUEST_KEYS)}")
    forms = [key for key in _PROMPT_KEYS if key in request]
    if len(forms) != 1:
        raise ValueError(f"qwen3 request needs exactly one of {list(_PROMPT_KEYS)}, got "
                         f"{forms or 'none'}")
    if "max_tokens" not in request:
        raise ValueError("qwen3 request needs 'max_tokens'")
    max_tokens = _int("max_tokens", request["max_tokens"], 1)
    prompts: list[list[int]] | TextPrompts
    if forms[0] == "prompt_token_ids":
        prompts = _prompts(request["prompt_token_ids"], args.vocab_size)
        check_lengths(prompts, max_tokens, args)
    else:
        if not args.has_tokenizer:
            raise ValueError(f"qwen3 {args.model} has no tokenizer files ({' or '.join(TOKENIZER_FILES)}): "
                             f"send 'prompt_token_ids' instead of {forms[0]!r}")
        prompts = _texts(request["prompt"]) if forms[0] == "prompt" else _messages(request["messages"], args)
    return prompts, _sampling(request, max_tokens, args.vocab_size)


def check_lengths(prompts: list[list[int]], max_tokens: int, args: Qwen3Args, when: str = "") -> None:
    """ValueError when the longest prompt plus ``max_tokens`` exceeds the model or the KV cache."""
    length = max(map(len, prompts))
    longest, tokens = length + max_tokens, f"{length} tokens{' ' + when if when else ''}"
    if longest > args.max_positions:
        raise ValueError(f"qwen3 prompt ({tokens}) + max_tokens ({max_tokens}) exceeds the "
                         f"model's max_position_embeddings {args.max_positions}")
    if args.kv_cache_blocks is not None and math.ceil((longest - 1) / args.block_size) > args.kv_cache_blocks:
        raise ValueError(f"qwen3 prompt ({tokens}) + max_tokens ({max_tokens}) cannot fit "
                         f"kv_cache_blocks={args.kv_cache_blocks} blocks of {args.block_size} tokens")


def _texts(prompts: Any) -> TextPrompts:
    """``prompt``: a string or a non-empty list of strings, none empty."""
    texts = [prompts] if isinstance(prompts, str) else prompts
    if not isinstance(texts, (list, tuple)) or not all(isinstance(t, str) for t in texts):
        raise TypeError(f"qwen3 prompt must be a string or a list of strings, got {prompts!r:.200}")
    if not texts:
        raise ValueError("qwen3 prompt is an empty list")
    empty = [i for i, t in enumerate(texts) if not t]
    if empty:
        raise ValueError(f"qwen3 prompt {empty[0]} is an empty string")
    return TextPrompts(texts=tuple(texts))


def _messages(messages: Any, args: Qwen3Args) -> TextPrompts:
    """``messages``: one conversation, a non-empty list of {"role": str, "content": str}."""
    if not isinstance(messages, (list, tuple)):
        raise TypeError(f"qwen3 messages must be a list of {{'role': str, 'content': str}}, got {messages!r:.200}")
    if not messages:
        raise ValueError("qwen3 messages is an empty list")
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise TypeError(f"qwen3 message {i} must be a dict with 'role' and 'content', got {message!r:.200}")
        if sorted(message) != ["content", "role"]:
            raise ValueError(f"qwen3 message {i} must have exactly the keys 'role' and 'content', got "
                             f"{sorted(map(str, message))}")
        if not isinstance(message["role"], str) or not isinstance(message["content"], str):
            raise TypeError(f"qwen3 message {i}: 'role' and 'content' must be strings, got {message!r:.200}")
        if not message["role"]:
            raise ValueError(f"qwen3 message {i} has an empty role")
    if not any(message["content"] for message in messages):
        raise ValueError("qwen3 messages: every message's content is empty")
    if not args.has_chat_template:
        raise ValueError(f"qwen3 {args.model}'s tokenizer has no chat template: send 'prompt' text instead of "
                         "'messages'")
    return TextPrompts(messages=tuple(dict(m) for m in messages))


def _prompts(prompts: Any, vocab: int) -> list[list[int]]:
    """``prompt_token_ids`` as a list of prompts (a flat list is one), each checked."""
    if not isinstance(prompts, (list, tuple)) or not prompts:
        raise (ValueError if isinstance(prompts, (list, tuple)) else TypeError)(
            f"qwen3 prompt_token_ids must be a non-empty list of ints or of lists of ints, got {prompts!r}")
    if not isinstance(prompts[0], (list, tuple)):
        prompts = [prompts]
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
    return [list(p) for p in prompts]


def _sampling(request: dict[str, Any], max_tokens: int, vocab: int) -> SamplingParams:
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
    return SamplingParams(max_tokens=max_tokens, temperature=float(temperature), top_k=top_k,
                            top_p=float(top_p), seed=seed, ignore_eos=ignore_eos, stop_token_ids=tuple(stop))
