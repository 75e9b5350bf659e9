"""Text in and out of the ``qwen3`` plugin, with a byte-level BPE trained here and random weights.

Text prompts and chat messages give the greedy ids of ``transformers.generate`` on the
tokenizer's ids and the text of ``tokenizer.decode``, inline and on tp 2; a checkpoint
without tokenizer files serves ids only; bad text requests are refused in the caller, a
prompt too long after tokenization included, and the engine keeps serving;
``IncrementalDetokenizer`` adds up to ``tokenizer.decode`` however the ids are split.
"""

from __future__ import annotations

import random
import shutil

import pytest

from examples.make_tiny_qwen3 import make_checkpoint, train_tokenizer
from models.qwen3 import Qwen3Entry
from models.qwen3.text import IncrementalDetokenizer, load_tokenizer, tokenize
from runtime import DeploymentConfig, DeviceConfig, Engine, EngineArgs, EngineConfig, WorkerSupervisorConfig
from tests.test_qwen3_plugin import TP2, free_port, hf_greedy

pytestmark = pytest.mark.timeout(180)

TRAINING_TEXT = "\n".join([
    "The quick brown fox jumps over the lazy dog. Robots serve models, fast and safe.",
    "Crème brûlée, façade, naïve, Ærø, Øresund, São Paulo, Zürich, señor, déjà vu, Kraków.",
    "機械学習は楽しいです。我们的机器人会说中文。안녕하세요 세계. Привет, мир! Γειά σου κόσμε.",
    "Emoji: 🤖🦾 🚀✨ 😀😃😄 👍🏽 👨‍👩‍👧‍👦 🇯🇵🇫🇷 ❤️‍🔥 and a snake 🐍 in 中文 text.",
] * 4)
PROMPTS = ["Hello robot", "Crème brûlée 🤖 à Zürich", "机器人 👍🏽 says 안녕", "🚀"]
MESSAGES = [{"role": "system", "content": "You are a robot. 🤖"}, {"role": "user", "content": "Grüß dich, 世界!"}]
MAX_TOKENS = 16
MAX_POSITIONS = 128


@pytest.fixture(scope="module")
def tokenizer():
    return train_tokenizer(TRAINING_TEXT, vocab_size=400)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory, tokenizer):
    """"text": weights, tokenizer and chat template; "ids": no tokenizer files; "no_template":
    the same tokenizer without a chat template (for the caller's checks only, no weights read)."""
    root = tmp_path_factory.mktemp("llm")
    text = make_checkpoint(root / "text", tokenizer, seed=3, max_positions=MAX_POSITIONS)
    ids = make_checkpoint(root / "ids", None, seed=4, max_positions=MAX_POSITIONS)
    no_template = root / "no_template"
    no_template.mkdir()
    shutil.copy(text / "config.json", no_template / "config.json")
    plain = train_tokenizer(TRAINING_TEXT, vocab_size=400, chat_template=None)
    plain.save_pretrained(no_template)
    return {"text": text, "ids": ids, "no_template": no_template}


@pytest.fixture(scope="module")
def inline(ckpt):
    with Engine(EngineArgs("qwen3", {"model": str(ckpt["text"])})) as engine:
        yield engine


@pytest.fixture(scope="module")
def tp2(ckpt):
    args = EngineArgs("qwen3", {"model": str(ckpt["text"])}, EngineConfig(device=DeviceConfig(target="cpu"),
                                                                         parallel=TP2))
    deployment = DeploymentConfig.local(devices=(0, 1), process_config=WorkerSupervisorConfig(
        base_port=free_port(), heartbeat_timeout_s=10.0))
    with Engine(args, deployment) as engine:
        yield engine


@pytest.fixture(params=["inline", "tp2"])
def engine(request):
    return request.getfixturevalue(request.param)


def entry(path) -> Qwen3Entry:
    e = Qwen3Entry()
    e.configure({"model": str(path)})
    return e


def decode(tokenizer, ids: list[list[int]]) -> list[str]:
    return [tokenizer.decode(seq, skip_special_tokens=True) for seq in ids]


# --------------------------------------------------------------------------- text in, text out

def test_text_prompts_give_transformers_greedy_ids_and_the_decoded_text(engine, ckpt, tokenizer):
    result = engine.step({"prompt": PROMPTS, "max_tokens": MAX_TOKENS}, timeout=120)
    want = hf_greedy(ckpt["text"], [tokenizer(p)["input_ids"] for p in PROMPTS], MAX_TOKENS)
    assert result["token_ids"] == want
    assert result["text"] == decode(tokenizer, want)
    assert len(result["finish_reasons"]) == len(PROMPTS)


def test_messages_go_through_the_chat_template(engine, ckpt, tokenizer):
    result = engine.step({"messages": MESSAGES, "max_tokens": MAX_TOKENS}, timeout=120)
    rendered = tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    assert rendered.endswith("<|im_start|>assistant\n") and "Grüß dich, 世界!" in rendered
    want = hf_greedy(ckpt["text"], [tokenizer(rendered, add_special_tokens=False)["input_ids"]], MAX_TOKENS)
    assert result["token_ids"] == want and result["text"] == decode(tokenizer, want)


def test_one_string_is_one_prompt_and_token_id_requests_get_text_too(inline, tokenizer):
    by_text = inline.step({"prompt": PROMPTS[1], "max_tokens": MAX_TOKENS}, timeout=60)
    by_ids = inline.step({"prompt_token_ids": tokenizer(PROMPTS[1])["input_ids"], "max_tokens": MAX_TOKENS},
                         timeout=60)
    assert len(by_text["token_ids"]) == 1
    assert by_ids == by_text and by_ids["text"] == decode(tokenizer, by_ids["token_ids"])


def test_a_checkpoint_without_tokenizer_files_serves_ids_and_refuses_text(ckpt):
    with Engine(EngineArgs("qwen3", {"model": str(ckpt["ids"])})) as engine:
        result = engine.step({"prompt_token_ids": [[5, 6, 7]], "max_tokens": 4}, timeout=60)
        assert set(result) == {"token_ids", "finish_reasons"} and len(result["token_ids"][0]) == 4
        for request in ({"prompt": "hi", "max_tokens": 4}, {"messages": MESSAGES, "max_tokens": 4}):
            with pytest.raises(ValueError, match="no tokenizer files.*send 'prompt_token_ids'"):
                engine.step(request, timeout=60)
    assert load_tokenizer(str(ckpt["ids"])) is None


# --------------------------------------------------------------------------- refused in the caller

@pytest.mark.parametrize("request_, error, match", [
    ({"prompt": "hi", "prompt_token_ids": [1], "max_tokens": 4}, ValueError, "exactly one of"),
    ({"prompt": "hi", "messages": MESSAGES, "max_tokens": 4}, ValueError, "exactly one of"),
    ({"max_tokens": 4}, ValueError, "exactly one of"),
    ({"prompt": "", "max_tokens": 4}, ValueError, "prompt 0 is an empty string"),
    ({"prompt": ["hi", ""], "max_tokens": 4}, ValueError, "prompt 1 is an empty string"),
    ({"prompt": [], "max_tokens": 4}, ValueError, "empty list"),
    ({"prompt": ["hi", 3], "max_tokens": 4}, TypeError, "string or a list of strings"),
    ({"prompt": b"hi", "max_tokens": 4}, TypeError, "string or a list of strings"),
    ({"prompt": "hi"}, ValueError, "needs 'max_tokens'"),
    ({"prompt": "hi", "max_tokens": 4, "n": 2}, ValueError, "unknown keys \\['n'\\]"),
    ({"messages": [], "max_tokens": 4}, ValueError, "empty list"),
    ({"messages": {"role": "user", "content": "hi"}, "max_tokens": 4}, TypeError, "must be a list"),
    ({"messages": ["hi"], "max_tokens": 4}, TypeError, "message 0 must be a dict"),
    ({"messages": [{"role": "user"}], "max_tokens": 4}, ValueError, "exactly the keys"),
    ({"messages": [{"role": "user", "content": "hi", "name": "x"}], "max_tokens": 4}, ValueError, "exactly the keys"),
    ({"messages": [{"role": "user", "content": 5}], "max_tokens": 4}, TypeError, "must be strings"),
    ({"messages": [{"role": "", "content": "hi"}], "max_tokens": 4}, ValueError, "empty role"),
    ({"messages": [{"role": "user", "content": ""}], "max_tokens": 4}, ValueError, "content is empty"),
])
def test_bad_text_requests_are_refused_in_the_caller(ckpt, request_, error, match):
    with pytest.raises(error, match=match):
        entry(ckpt["text"]).validate_request(request_)


def test_messages_without_a_chat_template_are_refused_and_prompts_still_pass(ckpt):
    e = entry(ckpt["no_template"])
    with pytest.raises(ValueError, match="has no chat template: send 'prompt' text"):
        e.validate_request({"messages": MESSAGES, "max_tokens": 4})
    e.validate_request({"prompt": "hi", "max_tokens": 4})


def test_a_prompt_too_long_after_tokenization_is_refused_and_the_engine_keeps_serving(engine, tokenizer):
    long_text = TRAINING_TEXT.splitlines()[3]  # emoji: more UTF-8 bytes than positions, so the caller tokenizes
    tokens = len(tokenizer(long_text)["input_ids"])
    assert tokens < MAX_POSITIONS < len(long_text.encode())
    with pytest.raises(ValueError, match=f"prompt \\({tokens} tokens after tokenization\\).*max_position_embed"):
        engine.step({"prompt": long_text, "max_tokens": MAX_POSITIONS - tokens + 1}, timeout=60)
    fits = engine.step({"prompt": long_text, "max_tokens": MAX_POSITIONS - tokens, "ignore_eos": True}, timeout=120)
    assert len(fits["token_ids"][0]) == MAX_POSITIONS - tokens


def test_rank_zero_checks_the_tokenized_length_itself(ckpt, tokenizer):
    """What the runner runs on each text request it adds: the same refusal, for requests that
    reach a rank without the caller's check (an external engine, say)."""
    args = entry(ckpt["text"]).args
    from models.qwen3.request import parse_request

    prompts, params = parse_request({"prompt": ["ok", "Zürich 🤖 " * 30], "max_tokens": 100}, args)
    with pytest.raises(ValueError, match="after tokenization"):
        tokenize(tokenizer, prompts, params.max_tokens, args)
    prompts, params = parse_request({"prompt": ["ok"], "max_tokens": 100}, args)
    assert tokenize(tokenizer, prompts, params.max_tokens, args) == [tokenizer("ok")["input_ids"]]


# --------------------------------------------------------------------------- incremental detokenizer

def test_incremental_detokenizer_adds_up_to_decode_for_any_split(tokenizer):
    rng = random.Random(0)
    vocab = len(tokenizer)
    text_ids = tokenizer(TRAINING_TEXT)["input_ids"]
    cases = [[rng.randrange(vocab) for _ in range(rng.randrange(1, 40))] for _ in range(400)]  # bytes cut anywhere
    cases += [text_ids[i:i + 60] for i in range(0, len(text_ids), 7)]                          # real text
    cases += [tokenizer("👨‍👩‍👧‍👦🇯🇵 " * 3 + "<|im_end|>中文")["input_ids"]]                          # a special token
    detok = IncrementalDetokenizer(tokenizer)
    for ids in cases:
        pieces, i = [], 0
        while i < len(ids):
            n = rng.choice((1, 1, 1, 2, 3))
            pieces.append(detok.push(ids[i:i + n]))
            i += n
        pieces.append(detok.flush())  # also readies the detokenizer for the next case
        assert "".join(pieces) == tokenizer.decode(ids, skip_special_tokens=True), ids


def test_incremental_detokenizer_returns_each_character_once_it_is_whole(tokenizer):
    """Text comes as soon as it is final: fed one byte token at a time, each character comes
    whole with its last byte (a 4-byte emoji after its 4th id), and nothing waits for flush."""
    text = "Zürich 🤖!"
    ids = tokenizer.convert_tokens_to_ids([_BYTE_TOKENS[b] for b in text.encode()])
    detok = IncrementalDetokenizer(tokenizer)
    pieces = [detok.push([i]) for i in ids]
    assert detok.flush() == ""
    ends = [i for i, p in enumerate(pieces) if p]
    assert [pieces[i] for i in ends] == list(text)
    assert ends == [len(text[:k + 1].encode()) - 1 for k in range(len(text))]


def _byte_level_alphabet() -> dict[int, str]:
    """GPT-2's byte-level alphabet: the character that stands for each byte in a byte-level BPE."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1), *range(ord("\xae"), 256)]
    rest = [b for b in range(256) if b not in printable]
    return {**{b: chr(b) for b in printable}, **{b: chr(256 + n) for n, b in enumerate(rest)}}


_BYTE_TOKENS = _byte_level_alphabet()
