"""Text in and out of ``qwen3``: the checkpoint's own tokenizer, prompts to token ids, ids to text.

Rank 0 loads the tokenizer once, at build time (``load_tokenizer``), tokenizes each text
request where it is added (``tokenize``) and decodes each finished result (``add_text``).
The caller loads it only when a request needs it there (``Qwen3Entry.validate_request``):
a conversation to render, or a prompt whose UTF-8 length exceeds what the model takes, so
that a prompt too long after tokenization is refused before any rank sees it.
``IncrementalDetokenizer`` turns the ids of one sequence into text as they are generated.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from models.qwen3.request import Qwen3Args, TextPrompts, check_lengths, has_tokenizer_files

log = logging.getLogger("phyrt.qwen3")
_REPLACEMENT = "\ufffd"  # what decoding yields for bytes that are not (yet) a whole UTF-8 character


def load_tokenizer(model_dir: str):
    """The directory's tokenizer (``AutoTokenizer``, local files only), or None when it has none."""
    if not has_tokenizer_files(Path(model_dir)):
        log.info("qwen3: %s has no tokenizer files (tokenizer.json or tokenizer_config.json): "
                 "token-id requests only, no text in or out", model_dir)
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir, local_files_only=True)


def render(tokenizer: Any, prompts: TextPrompts) -> list[str]:
    """Each prompt as the text to tokenize: a conversation through the chat template."""
    if prompts.messages is None:
        return list(prompts.texts)
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("qwen3: this checkpoint's tokenizer has no chat template; send 'prompt' text instead "
                         "of 'messages'")
    return [tokenizer.apply_chat_template(prompts.messages, tokenize=False, add_generation_prompt=True)]


def tokenize(tokenizer: Any, prompts: list[list[int]] | TextPrompts, max_tokens: int,
             args: Qwen3Args) -> list[list[int]]:
    """The token ids of each prompt (ids pass through), checked against the model's limits.

    A conversation's template already holds its special tokens, so nothing is added to it."""
    if not isinstance(prompts, TextPrompts):
        return prompts
    if tokenizer is None:
        raise ValueError(f"qwen3: {args.model} has no tokenizer files; send 'prompt_token_ids'")
    special = prompts.messages is None
    ids = [tokenizer(text, add_special_tokens=special)["input_ids"] for text in render(tokenizer, prompts)]
    for i, prompt in enumerate(ids):
        if not prompt:
            raise ValueError(f"qwen3 prompt {i} is empty after tokenization")
        if not 0 <= min(prompt) <= max(prompt) < args.vocab_size:
            raise ValueError(f"qwen3 prompt {i} tokenizes to ids outside the model's vocabulary [0, "
                             f"{args.vocab_size}): the tokenizer does not match the checkpoint")
    check_lengths(ids, max_tokens, args, "after tokenization")
    return ids


def add_text(result: dict[str, Any], tokenizer: Any) -> dict[str, Any]:
    """``result`` with ``"text"``: each sequence's generated ids decoded, special tokens skipped."""
    if tokenizer is not None:
        result["text"] = [tokenizer.decode(ids, skip_special_tokens=True) for ids in result["token_ids"]]
    return result


class IncrementalDetokenizer:
    """The text of one sequence's generated ids, piece by piece, as the ids come.

    ``push(ids)`` returns only text that no later id can change; ``flush()`` returns the rest.
    For any split of the ids into pushes, ``"".join(pushes) + flush()`` equals
    ``tokenizer.decode(all_ids, skip_special_tokens=True)``.

    Each push decodes a window, not the whole sequence, as vLLM's detokenizer does: the
    context (ids up to the last point where the text ended on a whole character, already
    returned) and the ids after it. The new text is what the window's decoding adds to the
    context's; decoding the context with it absorbs what depends on the neighbouring ids
    (a decoder that strips the first token's leading space, a character split across ids).
    A window's last character stays back while it is U+FFFD: an incomplete UTF-8 character
    whose remaining bytes may come with the next id, or a real replacement character, which
    the next id confirms or ``flush`` returns. The window moves on once its text ends on a
    whole character, so it holds a few ids; only ids that keep ending in an incomplete
    character (no real text does) make it grow.
    """

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._ids: list[int] = []  # the window: the context, then the ids not yet settled
        self._context = 0          # how many of the window's ids are context
        self._context_text = ""    # their decoding
        self._sent = 0             # characters returned beyond the context's text

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def push(self, token_ids: list[int]) -> str:
        """The text that ``token_ids`` make final (maybe ""), appended after the earlier pushes."""
        self._ids.extend(token_ids)
        text = self._decode(self._ids)
        if not text.startswith(self._context_text):  # a decoder that is not a plain concatenation: wait
            return ""
        new = text[len(self._context_text):]
        whole = not new.endswith(_REPLACEMENT)
        final = new if whole else new[:-1]
        out = final[self._sent:]
        self._sent = max(self._sent, len(final))
        if whole and new:  # the text ends on a whole character: the ids after the context become it
            self._ids = self._ids[self._context:]
            self._context, self._context_text, self._sent = len(self._ids), self._decode(self._ids), 0
        return out

    def flush(self) -> str:
        """The text held back so far; the detokenizer is then empty, ready for another sequence."""
        text = self._decode(self._ids)
        rest = text[len(self._context_text) + self._sent:] if text.startswith(self._context_text) else ""
        self._ids, self._context, self._context_text, self._sent = [], 0, "", 0
        return rest
