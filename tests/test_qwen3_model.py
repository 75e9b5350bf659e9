"""models.qwen3.model + models.loader against transformers' Qwen3ForCausalLM on tiny random checkpoints.

Checkpoints (random weights, norms near 1, saved with ``save_pretrained``):
    gqa     4 q / 2 kv heads, head_dim 24 != 64/4, untied, 2 layers
    tied    4 / 4 heads, head_dim 16, tied embeddings, attention bias, 3 layers, sharded in 60 KB files
    mqa     4 / 1 heads (kv replicated at tp 2), odd vocab 257 (padded at tp 2), rope_theta 1e6

The tp=2 test runs this file as 2 gloo rank processes (``python this_file SPEC RANK WORLD
PORT OUT_DIR``); rank 0 writes its logits, every rank the bytes it read while loading.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import transformers
from safetensors.torch import load_file, save_file

from models.layers.attention import AttentionMetadata
from models.layers.embedding import VocabParallelEmbedding
from models.loader import CheckpointError, LoadProgress, load_checkpoint, load_config
from models.qwen3.model import Qwen3ForCausalLM
from runtime import parallel as P
from runtime.core.config import AttentionParallelConfig, DenseParallelConfig, ParallelConfig
from tests.ranks import finish, init_gloo, launch, rank_args

pytestmark = pytest.mark.timeout(180)

SHAPES = {
    "gqa": dict(vocab_size=320, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=24, tie_word_embeddings=False),
    "tied": dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
                 num_key_value_heads=4, head_dim=16, tie_word_embeddings=True, attention_bias=True),
    "mqa": dict(vocab_size=257, hidden_size=96, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=1, head_dim=32, tie_word_embeddings=False,
                rope_parameters={"rope_type": "default", "rope_theta": 1e6}),
}
PROMPTS = [[3, 1, 4, 1, 5, 9, 2], list(range(40, 51)), [17]]  # 7, 11, 1 tokens
BLOCK = 4


def make_checkpoint(directory: Path, name: str) -> transformers.Qwen3ForCausalLM:
    torch.manual_seed(len(name))
    cfg = transformers.Qwen3Config(max_position_embeddings=128, rms_norm_eps=1e-6, **SHAPES[name])
    model = transformers.Qwen3ForCausalLM(cfg).eval()
    with torch.no_grad():
        for pname, p in model.named_parameters():
            p.copy_(1 + 0.2 * torch.randn_like(p) if "norm" in pname else 0.15 * torch.randn_like(p))
    model.save_pretrained(directory, max_shard_size="60KB" if name == "tied" else "1GB")
    return model


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, tuple[Path, transformers.Qwen3ForCausalLM]]:
    root = tmp_path_factory.mktemp("ckpt")
    return {name: (root / name, make_checkpoint(root / name, name)) for name in SHAPES}


def load(directory: Path, dtype: torch.dtype = torch.float32, **kw) -> Qwen3ForCausalLM:
    model = Qwen3ForCausalLM(load_config(directory), dtype, torch.device("cpu"))
    load_checkpoint(model, directory, **kw)
    return model.eval()


class Pages:
    """What the runner does: shuffled blocks per sequence, AttentionMetadata for each step."""

    def __init__(self, model: Qwen3ForCausalLM, num_blocks: int = 64, spare: int = 0):
        """``num_blocks`` blocks to hand out, and ``spare`` more in the cache that are never handed out."""
        shape = model.kv_cache_shape(num_blocks + spare, BLOCK)
        for layer in model.attention_layers():
            layer.k_cache = torch.zeros(shape, dtype=model.params_dtype)
            layer.v_cache = torch.zeros(shape, dtype=model.params_dtype)
        self.free = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(3)).tolist()
        self.tables, self.lens = {}, {}

    def step(self, new: dict[int, list[int]], is_prefill: bool) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        ids, positions, slots, cu = [], [], [], [0]
        for seq, tokens in new.items():
            start, table = self.lens.get(seq, 0), self.tables.setdefault(seq, [])
            while len(table) * BLOCK < start + len(tokens):
                table.append(self.free.pop())
            ids += tokens
            positions += range(start, start + len(tokens))
            slots += [table[p // BLOCK] * BLOCK + p % BLOCK for p in range(start, start + len(tokens))]
            self.lens[seq] = start + len(tokens)
            cu.append(len(ids))
        width = max(len(self.tables[s]) for s in new)
        meta = AttentionMetadata(
            is_prefill=is_prefill, slot_mapping=torch.tensor(slots),
            context_lens=torch.tensor([self.lens[s] for s in new], dtype=torch.int32),  # int32 as flash-attn
            block_tables=torch.tensor([self.tables[s] + [-1] * (width - len(self.tables[s])) for s in new],
                                      dtype=torch.int32),
            cu_seqlens_q=torch.tensor(cu))
        return torch.tensor(ids), torch.tensor(positions), meta


def run_steps(model: Qwen3ForCausalLM, decode_tokens: list[list[int]] | None = None, steps: int = 3) -> list:
    """Prefill PROMPTS in one batch, then ``steps`` decode steps.

    Each decode step feeds ``decode_tokens[step]`` (one per sequence) or, when None, the
    argmax of the previous logits. Returns [all prefill logits, then each step's logits].
    """
    pages, out = Pages(model), []
    with torch.inference_mode():
        ids, pos, meta = pages.step(dict(enumerate(PROMPTS)), True)
        logits = model.compute_logits(model(ids, pos, meta))
        out.append(logits)
        last = None if logits is None else logits[meta.cu_seqlens_q[1:] - 1]
        for step in range(steps):
            tokens = decode_tokens[step] if decode_tokens else last.argmax(-1).tolist()
            ids, pos, meta = pages.step({s: [t] for s, t in enumerate(tokens)}, False)
            last = model.compute_logits(model(ids, pos, meta))
            out.append(last)
    return out


def hf_logits(hf: transformers.Qwen3ForCausalLM, tokens: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return hf(torch.tensor([tokens])).logits[0]


# --------------------------------------------------------------------------- tp = 1 vs transformers


@pytest.mark.parametrize("name", list(SHAPES))
def test_batched_prefill_logits_match_transformers(checkpoints, name):
    directory, hf = checkpoints[name]
    logits = run_steps(load(directory), steps=0)[0]
    assert logits.shape == (sum(map(len, PROMPTS)), SHAPES[name]["vocab_size"])
    start = 0
    for prompt in PROMPTS:
        want = hf_logits(hf, prompt)
        assert (logits[start:start + len(prompt)] - want).abs().max() < 1e-4
        start += len(prompt)


@pytest.mark.parametrize("name", list(SHAPES))
def test_greedy_decode_through_the_paged_cache_matches_transformers(checkpoints, name):
    directory, hf = checkpoints[name]
    steps = run_steps(load(directory), steps=4)
    seqs = [list(p) for p in PROMPTS]
    last = torch.stack([hf_logits(hf, p)[-1] for p in seqs])
    for decoded in steps[1:]:
        for s, token in enumerate(last.argmax(-1).tolist()):
            seqs[s].append(token)
        last = torch.stack([hf_logits(hf, p)[-1] for p in seqs])
        assert (decoded - last).abs().max() < 1e-4
    with torch.inference_mode():  # and the same tokens as transformers' greedy generate
        for prompt, seq in zip(PROMPTS, seqs):
            gen = hf.generate(torch.tensor([prompt]), max_new_tokens=3, do_sample=False, pad_token_id=0)
            assert gen[0].tolist() == seq[:len(prompt) + 3]


def test_prefill_after_a_cached_prefix_matches_transformers(checkpoints):
    """Prefill may start mid-sequence: new tokens attend to the cached prefix and to each other."""
    directory, hf = checkpoints["gqa"]
    model, long = load(directory), list(range(60, 73))
    pages = Pages(model)
    with torch.inference_mode():
        model(*pages.step({0: long[:6]}, True))
        ids, pos, meta = pages.step({0: long[6:], 1: PROMPTS[0]}, True)
        logits = model.compute_logits(model(ids, pos, meta))
    assert (logits[:7] - hf_logits(hf, long)[6:]).abs().max() < 1e-4
    assert (logits[7:] - hf_logits(hf, PROMPTS[0])).abs().max() < 1e-4


def test_bfloat16_runs_close_to_transformers(checkpoints):
    """bf16 parameters and cache (fused matmuls round differently: a loose bound only)."""
    directory, _ = checkpoints["gqa"]
    hf = transformers.Qwen3ForCausalLM.from_pretrained(directory, dtype=torch.bfloat16).eval()
    steps = run_steps(load(directory, torch.bfloat16), decode_tokens(320), steps=2)
    assert steps[0].dtype == torch.bfloat16
    want = torch.cat([hf_logits(hf, p) for p in PROMPTS])
    assert (steps[0].float() - want.float()).abs().max() < 0.1


def test_model_shapes_and_cache_interface(checkpoints):
    model = load(checkpoints["mqa"][0])
    assert model.kv_cache_shape(10, 16) == (10, 16, 1, 32)
    assert len(model.attention_layers()) == 2
    assert len({id(layer.self_attn.rotary_emb) for layer in model.model.layers}) == 1  # one shared table
    assert model.lm_head.weight is not model.model.embed_tokens.weight
    tied = load(checkpoints["tied"][0])
    assert tied.lm_head.weight is tied.model.embed_tokens.weight


def test_unsupported_configs_are_refused():
    base = dict(SHAPES["gqa"], max_position_embeddings=64)
    sliding = transformers.Qwen3Config(**base, use_sliding_window=True, sliding_window=8, max_window_layers=1)
    with pytest.raises(ValueError, match="only full attention"):
        Qwen3ForCausalLM(sliding, torch.float32, torch.device("cpu"))
    scaled = transformers.Qwen3Config(**dict(base, rope_parameters={"rope_type": "dynamic", "factor": 2.0,
                                                                     "rope_theta": 1e4}))
    with pytest.raises(ValueError, match="rope type 'dynamic'"):
        Qwen3ForCausalLM(scaled, torch.float32, torch.device("cpu"))


# --------------------------------------------------------------------------- loader


def test_sharded_index_loads_with_progress_per_file(checkpoints, capfd):
    directory = checkpoints["tied"][0]
    index = json.loads((directory / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) >= 3 and "lm_head.weight" not in index["weight_map"]
    seen: list[LoadProgress] = []
    load(directory, progress=seen.append)
    assert [p.file for p in seen] == files and [p.files_done for p in seen] == list(range(1, len(files) + 1))
    assert seen[-1].tensors_done == seen[-1].tensors_total == len(index["weight_map"])
    assert seen[-1].bytes_read == seen[-1].bytes_total  # tp 1 reads everything, once
    load(directory, progress=True)
    lines = [line for line in capfd.readouterr().err.splitlines() if line.startswith("phyrt loader:")]
    assert len(lines) == len(files) and f"[{len(files)}/{len(files)}]" in lines[-1]


def edited_copy(src: Path, dst: Path, edit) -> Path:
    shutil.copytree(src, dst)
    tensors = load_file(dst / "model.safetensors")
    edit(tensors)
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


def test_missing_unexpected_and_misshaped_tensors_are_named(checkpoints, tmp_path):
    src = checkpoints["gqa"][0]

    def damage(t):
        del t["model.layers.1.self_attn.k_proj.weight"], t["lm_head.weight"], t["model.norm.weight"]
        t["model.layers.0.mlp.up_proj.weight"] = torch.zeros(95, 64)
        t["model.layers.0.self_attn.q_norm.weight"] = torch.ones(25)
        t["model.layers.0.extra.weight"] = torch.zeros(3)

    with pytest.raises(CheckpointError) as info:
        load(edited_copy(src, tmp_path / "bad", damage))
    err = info.value
    assert err.missing == ["lm_head.weight", "model.layers.1.self_attn.k_proj.weight", "model.norm.weight"]
    assert err.unexpected == ["model.layers.0.extra.weight"]
    assert sorted(m.split(" ")[0] for m in err.mismatched) == [
        "model.layers.0.mlp.up_proj.weight", "model.layers.0.self_attn.q_norm.weight"]
    text = str(err)
    for name in ("3 missing tensors", "model.layers.1.self_attn.k_proj.weight", "1 unexpected tensors",
                 "2 mis-shaped tensors", "shape (96, 64)", "got (95, 64)", "expected shape (24,), got (25,)"):
        assert name in text


def test_missing_files_and_foreign_configs(checkpoints, tmp_path):
    with pytest.raises(FileNotFoundError, match="no config.json"):
        load_config(tmp_path)
    transformers.LlamaConfig(hidden_size=64, num_attention_heads=4).save_pretrained(tmp_path / "llama")
    with pytest.raises(ValueError, match="model_type 'llama' is not 'qwen3'"):
        load_config(tmp_path / "llama")
    model = Qwen3ForCausalLM(load_config(checkpoints["gqa"][0]), torch.float32, torch.device("cpu"))
    with pytest.raises(FileNotFoundError, match="no model.safetensors or model.safetensors.index.json"):
        load_checkpoint(model, tmp_path)
    sharded = tmp_path / "sharded"
    shutil.copytree(checkpoints["tied"][0], sharded)
    first = sorted(sharded.glob("model-*.safetensors"))[0]
    first.unlink()
    with pytest.raises(FileNotFoundError, match=first.name):
        load_checkpoint(model, sharded)


# --------------------------------------------------------------------------- tp = 2 (2 gloo ranks)


def decode_tokens(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(vocab)
    return torch.randint(0, vocab, (3, len(PROMPTS)), generator=g).tolist()


def rank_main() -> None:
    (spec,), rank, world, port, out = rank_args(1)
    init_gloo(rank, world, port)
    result = {}
    try:
        P.initialize(ParallelConfig(dense=DenseParallelConfig(tp_size=world),
                                    attention=AttentionParallelConfig(tp_size=world)), rank)
        for name, directory in json.loads(spec).items():
            model = Qwen3ForCausalLM(load_config(directory), torch.float32, torch.device("cpu")).eval()
            seen = []
            load_checkpoint(model, directory, progress=seen.append)
            steps = run_steps(model, decode_tokens(model.config.vocab_size))
            # the bytes this rank keeps: its parameters (tied ones once) less the vocab padding rows
            kept = sum(p.numel() * p.element_size() for p in model.parameters())
            heads = {id(m.weight): m for m in model.modules() if isinstance(m, VocabParallelEmbedding)}
            for m in heads.values():
                kept -= (m.shard_size - (m.vocab_end - m.vocab_start)) * m.embedding_dim * m.weight.element_size()
            result[name] = {
                "logits": [None if x is None else x.tolist() for x in steps],
                "bytes_read": seen[-1].bytes_read, "bytes_total": seen[-1].bytes_total, "kept": kept,
            }
        dist.barrier()
    finally:
        P.destroy()
        dist.destroy_process_group()
    finish(out, rank, result)


def test_tp2_logits_equal_tp1_and_ranks_read_only_their_slices(checkpoints, tmp_path):
    spec = json.dumps({name: str(directory) for name, (directory, _) in checkpoints.items()})
    results = launch(__file__, 2, tmp_path, args=[spec], timeout=150)
    for name, (directory, _) in checkpoints.items():
        want = run_steps(load(directory), decode_tokens(SHAPES[name]["vocab_size"]))
        got = results[0][name]["logits"]
        assert len(got) == len(want) == 4
        for step, (g, w) in enumerate(zip(got, want)):
            assert (torch.tensor(g) - w).abs().max() < 1e-4, (name, step)
        assert all(x is None for x in results[1][name]["logits"])  # logits live on the output rank only
        for r in range(2):
            read, total, kept = (results[r][name][k] for k in ("bytes_read", "bytes_total", "kept"))
            # exactly what it keeps (a full read of any sharded tensor would add its other half),
            # about half the checkpoint: replicated norms and, for mqa, the one kv head are extra
            assert read == kept, (name, r, read, kept)
            assert read < 0.55 * total, (name, r, read, total)


if __name__ == "__main__":
    rank_main()
