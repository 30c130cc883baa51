"""Checkpoint files: where a folder's safetensors are, and their tensors, read whole or
lazily (a tensor-parallel rank reads only its slice). A leaf: the loader, the
tensor-parallel sharding and the models' checkpoint mappers all read through it."""
from __future__ import annotations

import json
import os

import torch
from safetensors import safe_open


def safetensors_files(model_dir: str) -> list[str]:
    index = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            weight_map = json.load(f)["weight_map"]
        return [os.path.join(model_dir, name) for name in sorted(set(weight_map.values()))]
    single = os.path.join(model_dir, "model.safetensors")
    if os.path.exists(single):
        return [single]
    found = sorted(f for f in os.listdir(model_dir) if f.endswith(".safetensors"))
    if not found:
        raise FileNotFoundError(f"no .safetensors weights in {model_dir}")
    return [os.path.join(model_dir, f) for f in found]


def iter_checkpoint(model_dir: str):
    for path in safetensors_files(model_dir):
        with safe_open(path, framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


class LazyTensor:
    """A checkpoint tensor not read yet: slicing reads only the slice; anything else
    (a model's checkpoint mapper reshaping it) reads it whole."""

    def __init__(self, f, name: str):
        self._f, self._name = f, name
        self._slice = f.get_slice(name)

    @property
    def shape(self) -> torch.Size:
        return torch.Size(self._slice.get_shape())

    def __getitem__(self, index) -> torch.Tensor:
        return self._slice[index]

    def full(self) -> torch.Tensor:
        return self._f.get_tensor(self._name)

    def __getattr__(self, name):
        return getattr(self.full(), name)


def materialize(tensor) -> torch.Tensor:
    return tensor.full() if isinstance(tensor, LazyTensor) else tensor


def iter_checkpoint_lazy(model_dir: str):
    for path in safetensors_files(model_dir):
        with safe_open(path, framework="pt") as f:
            for name in f.keys():
                yield name, LazyTensor(f, name)


def checkpoint_header(model_dir: str) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Every tensor's name -> (safetensors dtype, "F8_E4M3" / "BF16" / ..., shape), from
    the files' headers: no tensor data is read."""
    out = {}
    for path in safetensors_files(model_dir):
        with safe_open(path, framework="pt") as f:
            for name in f.keys():
                s = f.get_slice(name)
                out[name] = (s.get_dtype(), tuple(s.get_shape()))
    return out
