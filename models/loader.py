"""Loading a Hugging Face checkpoint directory into a (tensor-parallel) model, slice by slice.

    model_dir/config.json                      -> load_config
    model_dir/model.safetensors                -> load_checkpoint: for each file, for each tensor NAME:
    or model.safetensors.index.json (+ shards)       NAME -> parameter (+ shard id) via model.packed_modules_mapping
                                                     param.weight_loader(param, LazySlice[, shard_id])

A ``LazySlice`` wraps ``safe_open(...).get_slice(NAME)``: it has ``.shape`` and reads
from the file only the rows/columns a weight_loader indexes, so a tp>1 rank never
materialises a full copy of a sharded tensor (replicated ones, such as norms, are
read whole). Every read is counted (``LoadProgress.bytes_read``).

Names: a checkpoint name whose dotted part is a key of ``packed_modules_mapping``
(``...self_attn.q_proj.weight``) loads the fused parameter (``...self_attn.qkv_proj.weight``)
with that shard id. Parameters shared by two names (tied embeddings:
``lm_head.weight`` is ``model.embed_tokens.weight``) are satisfied by either, so a
checkpoint without ``lm_head.weight`` loads a tied head from ``embed_tokens``.
Parameters without a ``weight_loader`` are copied whole after a shape check.

Every tensor is tried; then one ``CheckpointError`` lists all missing, unexpected and
mis-shaped names. Leaf module: imports nothing from the project.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import transformers
from safetensors import safe_open
from torch import nn

INDEX_FILE, SINGLE_FILE = "model.safetensors.index.json", "model.safetensors"
AUTO_PROGRESS_BYTES = 1 << 30  # progress=None prints for checkpoints at least this large
_DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1,
                "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}


class CheckpointError(ValueError):
    """The checkpoint does not fit the model; every problem is listed by tensor name."""

    def __init__(self, model_dir: Path, missing: list[str], unexpected: list[str], mismatched: list[str]):
        self.missing, self.unexpected, self.mismatched = missing, unexpected, mismatched
        parts = [f"checkpoint {model_dir} does not fit the model:"]
        for what, names in (("missing tensors", missing), ("unexpected tensors", unexpected),
                            ("mis-shaped tensors", mismatched)):
            if names:
                shown = names[:20] + ([f"... and {len(names) - 20} more"] if len(names) > 20 else [])
                parts.append(f"  {len(names)} {what}:\n    " + "\n    ".join(shown))
        super().__init__("\n".join(parts))


@dataclass(frozen=True)
class LoadProgress:
    """Passed to a progress callback after each file (and printed when progress is on)."""

    file: str
    files_done: int
    files_total: int
    tensors_done: int
    tensors_total: int
    bytes_read: int       # bytes materialised from the files so far (this rank's slices)
    bytes_total: int      # bytes of every tensor in the checkpoint
    seconds: float

    def line(self) -> str:
        mib = 1 << 20
        return (f"phyrt loader: [{self.files_done}/{self.files_total}] {self.file}: {self.tensors_done}/"
                f"{self.tensors_total} tensors, {self.bytes_read / mib:.1f} MiB read of "
                f"{self.bytes_total / mib:.1f} MiB, {self.seconds:.1f} s")


class LazySlice:
    """A checkpoint tensor not read yet: ``.shape``, and ``[index]`` reads just that part."""

    def __init__(self, name: str, handle: Any, counter: list[int]):
        self.name, self._slice, self._counter = name, handle.get_slice(name), counter
        self.shape = torch.Size(self._slice.get_shape())

    def __getitem__(self, index: Any) -> torch.Tensor:
        tensor = self._slice[index]
        self._counter[0] += tensor.numel() * tensor.element_size()
        return tensor

    def __repr__(self) -> str:
        return f"LazySlice({self.name!r}, shape={tuple(self.shape)})"


def load_config(model_dir: str | Path) -> transformers.Qwen3Config:
    """``config.json`` of a local Qwen3 checkpoint (never downloads)."""
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"no config.json in {model_dir}")
    config = transformers.AutoConfig.from_pretrained(str(model_dir), local_files_only=True)
    if not isinstance(config, transformers.Qwen3Config):
        raise ValueError(f"{path}: model_type {getattr(config, 'model_type', None)!r} is not 'qwen3'")
    return config


def checkpoint_files(model_dir: str | Path) -> dict[str, list[str]]:
    """``{file name: [tensor names]}`` from the index, or of the single ``model.safetensors``."""
    model_dir = Path(model_dir)
    index = model_dir / INDEX_FILE
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        files: dict[str, list[str]] = {}
        for name, file in weight_map.items():
            files.setdefault(file, []).append(name)
        absent = sorted(f for f in files if not (model_dir / f).is_file())
        if absent:
            raise FileNotFoundError(f"{index} names files that are not in {model_dir}: {absent}")
        return dict(sorted(files.items()))
    single = model_dir / SINGLE_FILE
    if single.is_file():
        with safe_open(str(single), framework="pt") as f:
            return {SINGLE_FILE: list(f.keys())}
    raise FileNotFoundError(f"no {SINGLE_FILE} or {INDEX_FILE} in {model_dir}")


def default_weight_loader(param: nn.Parameter, loaded: Any) -> None:
    """A replicated parameter: the whole tensor, after a shape check."""
    if tuple(loaded.shape) != tuple(param.shape):
        raise ValueError(f"expected shape {tuple(param.shape)}, got {tuple(loaded.shape)}")
    with torch.no_grad():
        param.copy_(loaded[:])


def _target(name: str, mapping: dict[str, tuple[str, Any]]) -> tuple[str, Any]:
    parts = name.split(".")
    for i, part in enumerate(parts):
        if part in mapping:
            fused, shard = mapping[part]
            return ".".join(parts[:i] + [fused] + parts[i + 1:]), shard
    return name, None


def _needed(name: str, mapping: dict[str, tuple[str, Any]]) -> dict[Any, str]:
    """The shards a parameter needs, each with the checkpoint name that provides it."""
    parts = name.split(".")
    for i, part in enumerate(parts):
        shards = {shard: ".".join(parts[:i] + [orig] + parts[i + 1:])
                  for orig, (fused, shard) in mapping.items() if fused == part}
        if shards:
            return shards
    return {None: name}


def load_checkpoint(model: nn.Module, model_dir: str | Path, *,
                    progress: bool | Callable[[LoadProgress], None] | None = None) -> None:
    """Fill every parameter of ``model`` from the checkpoint in ``model_dir``.

    ``progress``: a callable gets a ``LoadProgress`` after each file; True prints a line
    per file on stderr; False is silent; None prints only for checkpoints of 1 GiB or more.
    Raises ``CheckpointError`` (a ValueError) naming every missing, unexpected or
    mis-shaped tensor, ``FileNotFoundError`` when files are absent.
    """
    model_dir = Path(model_dir)
    files = checkpoint_files(model_dir)
    mapping = dict(getattr(model, "packed_modules_mapping", {}) or {})
    params = dict(model.named_parameters(remove_duplicate=False))
    names_of: dict[int, list[str]] = {}
    for pname, param in params.items():
        names_of.setdefault(id(param), []).append(pname)
    loaded: dict[int, set] = {pid: set() for pid in names_of}
    unexpected, mismatched = [], []

    sizes = _tensor_bytes(model_dir, files)
    bytes_total, tensors_total, counter, done, start = sum(sizes.values()), len(sizes), [0], 0, time.monotonic()
    report = _reporter(progress, bytes_total)

    for i, (file, names) in enumerate(files.items()):
        with safe_open(str(model_dir / file), framework="pt") as f:
            for name in names:
                pname, shard = _target(name, mapping)
                param = params.get(pname)
                if param is None:
                    unexpected.append(name)
                    continue
                lazy = LazySlice(name, f, counter)
                fn = getattr(param, "weight_loader", None)
                try:
                    if fn is None:
                        default_weight_loader(param, lazy)
                    elif shard is None:
                        fn(param, lazy)
                    else:
                        fn(param, lazy, shard)
                except (ValueError, IndexError, RuntimeError) as exc:
                    mismatched.append(f"{name} (into {pname}): {exc}")
                    continue
                loaded[id(param)].add(shard)
        done += len(names)
        if report is not None:
            report(LoadProgress(file, i + 1, len(files), done, tensors_total, counter[0], bytes_total,
                                time.monotonic() - start))

    missing, failed = [], {m.split(" ", 1)[0] for m in mismatched}
    for pid, pnames in names_of.items():
        for shard, ckpt_name in _needed(pnames[0], mapping).items():
            if shard not in loaded[pid] and ckpt_name not in failed:
                missing.append(ckpt_name)
    if missing or unexpected or mismatched:
        raise CheckpointError(model_dir, sorted(missing), sorted(unexpected), mismatched)


def _tensor_bytes(model_dir: Path, files: dict[str, list[str]]) -> dict[str, int]:
    """The size of every tensor of the checkpoint, from the file headers (no data read)."""
    sizes = {}
    for file, names in files.items():
        with safe_open(str(model_dir / file), framework="pt") as f:
            for name in names:
                s = f.get_slice(name)
                sizes[name] = _numel(s.get_shape()) * _DTYPE_BYTES.get(s.get_dtype(), 4)
    return sizes


def _reporter(progress: bool | Callable[[LoadProgress], None] | None,
              bytes_total: int) -> Callable[[LoadProgress], None] | None:
    if callable(progress):
        return progress
    if progress is True or (progress is None and bytes_total >= AUTO_PROGRESS_BYTES):
        return lambda p: print(p.line(), file=sys.stderr, flush=True)
    return None


def _numel(shape: list[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
