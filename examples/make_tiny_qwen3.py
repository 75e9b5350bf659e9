"""Write a tiny random Qwen3 checkpoint directory, tokenizer included, for trying the LLM path.

    python examples/make_tiny_qwen3.py --out /tmp/tiny-qwen3       # prints the directory
    python -m runtime.launch --model /tmp/tiny-qwen3

The directory holds what any Hugging Face Qwen3 folder holds: ``config.json``,
``generation_config.json``, ``model.safetensors`` and the tokenizer files
(``tokenizer.json``, ``tokenizer_config.json``, ``chat_template.jinja``). The weights are
random, so the text that comes out is gibberish; the tokenizer is a byte-level BPE (as
Qwen3's is) trained on the spot on the short text below, with Qwen3's special tokens and
a ChatML chat template, so text prompts and chat messages work. Seconds on a CPU.
"""

from __future__ import annotations

import argparse
from pathlib import Path

#: the training text: English, accents, CJK and emoji, so every script has a few merges
TEXT = """\
The robot arm picks up the red cube and places it in the box. Then it waits for the next order.
Le bras du robot saisit le cube rouge, le dépose dans la boîte et attend l'ordre suivant. Très bien, ça marche.
Der Roboterarm greift den roten Würfel und legt ihn in die Kiste. Größer, schöner, später.
El brazo robótico toma el cubo rojo y lo coloca en la caja. ¿Qué sigue? ¡Perfecto!
机器人手臂拿起红色的方块，把它放进盒子里，然后等待下一个指令。你好，世界！
ロボットアームが赤いキューブを箱に入れます。こんにちは。
로봇 팔이 빨간 큐브를 상자에 넣습니다. 안녕하세요.
Emoji too: 🤖 picks 🟥 into 📦, then 👍 and 🎉; a family 👨‍👩‍👧 and a flag 🇫🇷.
def serve(model): return engine.step({"prompt": "Hello", "max_tokens": 16})
"""
#: Qwen3's special tokens; <|im_end|> ends an assistant turn (the EOS of chat models)
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
#: the ChatML template Qwen models use, without tools or thinking
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def train_tokenizer(text: str = TEXT, vocab_size: int = 512, chat_template: str | None = CHAT_TEMPLATE):
    """A byte-level BPE (``transformers.PreTrainedTokenizerFast``) trained on ``text``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    bpe.train_from_iterator(text.splitlines(), trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                        clean_up_tokenization_spaces=False)
    tokenizer.chat_template = chat_template
    return tokenizer


def make_checkpoint(out: Path, tokenizer=None, seed: int = 0, layers: int = 2, max_positions: int = 512) -> Path:
    """Random Qwen3 weights sized to ``tokenizer``'s vocabulary, with the tokenizer saved beside
    them (``tokenizer=None``: weights only, a vocabulary of 512 ids and no tokenizer files)."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    vocab = len(tokenizer) if tokenizer is not None else 512
    eos = tokenizer.eos_token_id if tokenizer is not None else None
    torch.manual_seed(seed)
    config = Qwen3Config(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=32, tie_word_embeddings=True,
                         max_position_embeddings=max_positions, initializer_range=0.1, eos_token_id=eos,
                         bos_token_id=None, pad_token_id=None)
    Qwen3ForCausalLM(config).save_pretrained(out)
    if tokenizer is not None:
        tokenizer.save_pretrained(out)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="tiny-qwen3", help="the directory to write (created)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random weights")
    opts = parser.parse_args(argv)
    out = make_checkpoint(Path(opts.out), train_tokenizer(), seed=opts.seed)
    print(out.resolve())


if __name__ == "__main__":
    main()
