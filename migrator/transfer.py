"""Training state as JSON plus raw tensor bytes, and its point-to-point transfer over a process group.

No pickle: a state (model/optimizer/scheduler state_dicts, RNG states, data position; nested dicts,
lists, tuples, numbers, strings, None and tensors) is split into a JSON skeleton, where each tensor is
`{"__tensor__": i, "dtype": ..., "shape": [...]}`, and the tensors themselves. The tensors travel as
bytes: each is viewed as uint8, small ones are packed into buckets of up to BUCKET_BYTES (16-byte
aligned, so the receiver views them back without a copy), large ones go alone. Both sides derive the
same message plan from the skeleton, so only the skeleton's length and bytes precede the data.
`digest(state)` is a CRC-32 over the skeleton and every tensor's bytes: the sender's digest of what it
sent and the receiver's digest of what it loaded must agree before the new world takes a step.
torch is imported by this module; foreshock.migrator imports it lazily.
"""

from __future__ import annotations

import json
import math
import zlib
from typing import Any

import torch

BUCKET_BYTES = 8 << 20
ALIGN = 16
_DTYPES = {str(dt): dt for dt in (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64,
                                  torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool,
                                  torch.complex64, torch.complex128)}


class StateFormatError(ValueError):
    """A state that cannot be encoded (an unsupported type), named by its path in the state."""


def encode(state: Any) -> tuple[dict, list[torch.Tensor]]:
    tensors: list[torch.Tensor] = []

    def walk(obj: Any, path: str) -> Any:
        if isinstance(obj, torch.Tensor):
            t = obj.detach()
            if t.device.type != "cpu":
                t = t.cpu()
            if str(t.dtype) not in _DTYPES:
                raise StateFormatError(f"{path}: tensor dtype {t.dtype} is not supported")
            tensors.append(t.contiguous())
            return {"__tensor__": len(tensors) - 1, "dtype": str(t.dtype), "shape": list(t.shape)}
        if obj is None or isinstance(obj, (bool, int, str)):
            return obj
        if isinstance(obj, float):
            if math.isfinite(obj):
                return obj
            return {"__float__": repr(obj)}
        if isinstance(obj, tuple):
            return {"__tuple__": [walk(v, f"{path}[{i}]") for i, v in enumerate(obj)]}
        if isinstance(obj, list):
            return [walk(v, f"{path}[{i}]") for i, v in enumerate(obj)]
        if isinstance(obj, dict):
            if all(isinstance(k, str) for k in obj) and "__tensor__" not in obj:
                return {"__dict__": {k: walk(v, f"{path}.{k}") for k, v in obj.items()}}
            items = []
            for k, v in obj.items():
                if not isinstance(k, (str, int, float, bool, tuple)) and k is not None:
                    raise StateFormatError(f"{path}: dict key {k!r} of type {type(k).__name__} unsupported")
                items.append([walk(k, f"{path}<key>"), walk(v, f"{path}[{k!r}]")])
            return {"__items__": items}
        raise StateFormatError(f"{path}: {type(obj).__name__} cannot be transferred (no pickle); "
                               "give the object a state_dict() of tensors and plain values")

    return walk(state, "state"), tensors


def decode(skeleton: Any, tensors: list[torch.Tensor]) -> Any:
    def walk(obj: Any) -> Any:
        if isinstance(obj, list):
            return [walk(v) for v in obj]
        if not isinstance(obj, dict):
            return obj
        if "__tensor__" in obj:
            return tensors[obj["__tensor__"]]
        if "__float__" in obj:
            return float(obj["__float__"])
        if "__tuple__" in obj:
            return tuple(walk(v) for v in obj["__tuple__"])
        if "__dict__" in obj:
            return {k: walk(v) for k, v in obj["__dict__"].items()}
        if "__items__" in obj:
            return {_hashable(walk(k)): walk(v) for k, v in obj["__items__"]}
        raise StateFormatError(f"unknown skeleton node {sorted(obj)}")

    return walk(skeleton)


def _hashable(key: Any) -> Any:
    return tuple(key) if isinstance(key, list) else key


def tensor_specs(skeleton: Any) -> list[tuple[torch.dtype, tuple[int, ...]]]:
    specs: dict[int, tuple[torch.dtype, tuple[int, ...]]] = {}

    def walk(obj: Any) -> None:
        if isinstance(obj, list):
            for v in obj:
                walk(v)
        elif isinstance(obj, dict):
            if "__tensor__" in obj:
                dtype = _DTYPES.get(obj.get("dtype"))
                if dtype is None:
                    raise StateFormatError(f"tensor {obj['__tensor__']}: unknown dtype {obj.get('dtype')!r}")
                specs[int(obj["__tensor__"])] = (dtype, tuple(int(s) for s in obj["shape"]))
            else:
                for v in obj.values():
                    walk(v)

    walk(skeleton)
    if sorted(specs) != list(range(len(specs))):
        raise StateFormatError("tensor indices in the skeleton are not 0..n-1")
    return [specs[i] for i in range(len(specs))]


def _nbytes(dtype: torch.dtype, shape: tuple[int, ...]) -> int:
    return math.prod(shape) * torch.empty((), dtype=dtype).element_size()


def message_plan(specs) -> list[list[tuple[int, int, int]]]:
    """Messages as lists of (tensor index, byte offset, byte length); identical on both sides."""
    plan, bucket, used = [], [], 0
    for i, (dtype, shape) in enumerate(specs):
        n = _nbytes(dtype, shape)
        if n == 0:
            continue
        if n >= BUCKET_BYTES // 2:
            plan.append([(i, 0, n)])
            continue
        offset = -(-used // ALIGN) * ALIGN
        if bucket and offset + n > BUCKET_BYTES:
            plan.append(bucket)
            bucket, offset = [], 0
        bucket.append((i, offset, n))
        used = offset + n
    if bucket:
        plan.append(bucket)
    return plan


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    flat = t.reshape(-1)
    return flat.view(torch.uint8) if flat.dtype != torch.uint8 else flat


def _digest(header: bytes, tensors: list[torch.Tensor]) -> str:
    crc = zlib.crc32(header)
    for t in tensors:
        if t.numel():
            crc = zlib.crc32(_as_bytes(t).numpy(), crc)
    return f"{crc:08x}"


def digest(state: Any) -> str:
    """CRC-32 of a state's encoding (skeleton and tensor bytes); equal states give equal digests."""
    skeleton, tensors = encode(state)
    return _digest(json.dumps(skeleton, separators=(",", ":")).encode(), tensors)


def send_state(pg, state: Any, dst: int, tag_base: int = 0) -> tuple[int, str]:
    """Send a state to rank `dst` of `pg`; returns the bytes sent and the digest of what was sent.
    Raises on a broken peer."""
    skeleton, tensors = encode(state)
    header = json.dumps(skeleton, separators=(",", ":")).encode()
    header_t = torch.frombuffer(bytearray(header), dtype=torch.uint8)
    works = [pg.send([torch.tensor([len(header)], dtype=torch.int64)], dst, tag_base),
             pg.send([header_t], dst, tag_base + 1)]
    total = len(header)
    keep = []
    for m, msg in enumerate(message_plan(tensor_specs(skeleton))):
        if len(msg) == 1 and msg[0][1] == 0:
            buf = _as_bytes(tensors[msg[0][0]])
        else:
            buf = torch.empty(msg[-1][1] + msg[-1][2], dtype=torch.uint8)
            for i, off, n in msg:
                buf[off:off + n].copy_(_as_bytes(tensors[i]))
        keep.append(buf)
        works.append(pg.send([buf], dst, tag_base + 2 + m))
        total += buf.numel()
    for w in works:
        w.wait()
    return total, _digest(header, tensors)


def recv_state(pg, src: int, tag_base: int = 0, on_message=None) -> Any:
    """Receive a state sent by send_state from rank `src` of `pg`."""
    length = torch.empty(1, dtype=torch.int64)
    pg.recv([length], src, tag_base).wait()
    if not 0 < int(length) < (1 << 31):
        raise StateFormatError(f"state header length {int(length)} out of range")
    header = torch.empty(int(length), dtype=torch.uint8)
    pg.recv([header], src, tag_base + 1).wait()
    skeleton = json.loads(bytes(header.numpy()))
    specs = tensor_specs(skeleton)
    tensors: list[torch.Tensor | None] = [None] * len(specs)
    plan = message_plan(specs)
    bufs, works = [], []
    for m, msg in enumerate(plan):
        buf = torch.empty(msg[-1][1] + msg[-1][2], dtype=torch.uint8)
        bufs.append(buf)
        works.append(pg.recv([buf], src, tag_base + 2 + m))
    for m, (msg, buf, work) in enumerate(zip(plan, bufs, works)):
        work.wait()
        if on_message is not None:
            on_message(m, len(plan))
        for i, off, n in msg:
            dtype, shape = specs[i]
            tensors[i] = buf[off:off + n].view(dtype).reshape(shape)
    for i, (dtype, shape) in enumerate(specs):
        if tensors[i] is None:
            tensors[i] = torch.empty(shape, dtype=dtype)
    return decode(skeleton, tensors)


def save_checkpoint(path, state: Any) -> None:
    """A just-in-time checkpoint: JSON skeleton plus tensors, loadable with weights_only=True."""
    import os
    skeleton, tensors = encode(state)
    tmp = f"{path}.tmp"
    torch.save({"skeleton": json.dumps(skeleton), "tensors": tensors}, tmp)
    os.replace(tmp, path)


def load_checkpoint(path) -> Any:
    blob = torch.load(path, weights_only=True)
    return decode(json.loads(blob["skeleton"]), blob["tensors"])
