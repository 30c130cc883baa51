"""The scheduler/runner contract as messages: msgpack frames, via msgspec.

`encode(obj)` turns a SchedulerOutput, GrammarOutput or ModelRunnerOutput (any of
the contract's dataclasses) into bytes; `decode(data, cls)` gives back an equal
object of that class, typed all the way down (msgspec reads the dataclasses'
annotations). What msgpack has no type for travels as:

- numpy arrays (logprobs, the grammar bitmask): [dtype, shape, raw bytes].

KV never travels: the connector's metadata names blocks by id and hash, and the
worker half reads the entries from the stores itself.

SamplingParams is a dataclass like the rest: its fields travel as they are, those
the engine derived when it took the request in (the stop token ids with EOS, the
bad words as token ids) included.

Nothing else is allowed: a tensor, a callable or an object of another class makes
encode() raise, so the contract cannot quietly grow something that would not
cross a process boundary.
"""
from __future__ import annotations

from typing import Any, TypeVar

import msgspec
import numpy as np

T = TypeVar("T")


def _enc_hook(obj: Any) -> Any:
    if isinstance(obj, np.ndarray):
        arr = np.ascontiguousarray(obj)
        return [arr.dtype.str, list(arr.shape), arr.tobytes()]
    if isinstance(obj, np.generic):
        return obj.item()
    raise TypeError(f"{type(obj).__name__} is not part of the scheduler/runner contract "
                    f"(no tensors, buffers, callables or other objects in a message)")


def _dec_hook(cls: type, obj: Any) -> Any:
    if cls is np.ndarray:
        dtype, shape, raw = obj
        return np.frombuffer(raw, dtype=np.dtype(dtype)).reshape(shape).copy()
    raise TypeError(f"cannot decode {cls.__name__}")


_encoder = msgspec.msgpack.Encoder(enc_hook=_enc_hook)
_decoders: dict[type, msgspec.msgpack.Decoder] = {}


def encode(obj: Any) -> bytes:
    return _encoder.encode(obj)


def decoder(cls):
    """A function bytes -> object of `cls` (typed decoding, built once per type)."""
    dec = _decoders.get(cls)
    if dec is None:
        dec = _decoders[cls] = msgspec.msgpack.Decoder(cls, dec_hook=_dec_hook)
    return dec.decode


def decode(data: bytes, cls: type[T]) -> T:
    return decoder(cls)(data)
