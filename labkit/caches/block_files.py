"""One KV block in a file: the disk tier's unit, written whole and read back only if it checks out.

A second tier keeps a block that the pool evicted: its name (the hash chain's, chapter 04) and its
K/V, every layer's. On a later prefix hit the block is read back into a free pool block, and the
model goes on as if it had computed those tokens itself. A file that is not exactly what was written
must never reach attention: wrong K/V give wrong tokens without any error. So a block file carries
what it is (its name, the pool's shape and dtype) and a SHA-256 of its bytes, and ``read_block``
checks all of it before it touches the pool. A file cut short, a flipped bit, another block's file
or another model's are each refused with ``BlockFileError``, which names the file and the reason;
the caller recomputes the block.

The layout: an 8-byte magic, a 4-byte little-endian header length, the header (JSON: ``name``,
``num_layers``, ``block_size``, ``num_kv_heads``, ``head_dim``, ``dtype``, ``sha256``), then the payload,
every layer's K block then V block, in the pool's own element type.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from pathlib import Path

import torch

from ..checks import check_int
from ..memory.tiered import TierLoadError
from .paged import KVPool

__all__ = ["MAGIC", "BlockFileError", "block_payload_bytes", "write_block", "read_block", "decode_block",
           "copy_block"]

MAGIC = b"KVBLOCK1"


class BlockFileError(TierLoadError):
    """A block file that cannot be used: the message names the file and why (a second tier then drops it and
    the block is computed again)."""


def _layout(pool: KVPool) -> dict:
    k = pool.k_caches[0]
    return {"num_layers": len(pool.k_caches), "block_size": k.shape[1], "num_kv_heads": k.shape[2],
            "head_dim": k.shape[3], "dtype": str(k.dtype).removeprefix("torch.")}


def _check(pool: object, block_id: object, name: object) -> None:
    _check_pool(pool, name)
    check_int("block_id", block_id, 0)
    if block_id >= pool.k_caches[0].shape[0]:
        raise ValueError(f"block_id must be in [0, {pool.k_caches[0].shape[0] - 1}], got {block_id}")


def _check_pool(pool: object, name: object) -> None:
    if not isinstance(pool, KVPool):
        raise ValueError(f"pool must be a labkit.caches.paged.KVPool, got {type(pool).__name__}")
    if pool.k_scales[0] is not None:
        raise ValueError("pool must hold unquantized K/V: a quantized pool's scales are not written to block files")
    if not isinstance(name, str) or not name:
        raise ValueError(f"name must be the block's name (a non-empty string), got {name!r}")


def block_payload_bytes(pool: KVPool) -> int:
    """Bytes of one block's K/V over all layers: what a tier moves per block."""
    return pool.bytes_per_block


def write_block(pool: KVPool, block_id: int, name: str, path: str | os.PathLike) -> int:
    """Write pool block ``block_id`` (every layer's K and V) to ``path`` under its ``name``; returns the bytes
    written. The file is written beside ``path`` and renamed into place, so a reader never sees half of it."""
    _check(pool, block_id, name)
    parts = [c[block_id].contiguous().cpu() for layer in range(len(pool.k_caches))
             for c in (pool.k_caches[layer], pool.v_caches[layer])]
    payload = b"".join(p.view(torch.uint8).numpy().tobytes() for p in parts)
    header = json.dumps({"name": name, **_layout(pool), "sha256": hashlib.sha256(payload).hexdigest()}).encode()
    path = Path(path)
    partial = path.with_name(path.name + ".partial")
    with open(partial, "wb") as f:
        f.write(MAGIC + struct.pack("<I", len(header)) + header + payload)
    os.replace(partial, path)
    return len(MAGIC) + 4 + len(header) + len(payload)


def read_block(pool: KVPool, block_id: int, name: str, path: str | os.PathLike) -> int:
    """Read the block file ``path`` into pool block ``block_id``, after checking that it is block ``name`` of a
    pool shaped like this one and that its bytes are the ones written. Returns the payload's bytes. Any
    mismatch raises ``BlockFileError`` (naming the file and the reason) and leaves the pool as it was."""
    _check(pool, block_id, name)
    parts = decode_block(pool, name, path)
    copy_block(pool, block_id, parts)
    return pool.bytes_per_block


def decode_block(pool: KVPool, name: str, path: str | os.PathLike, data: bytes | None = None) -> list[torch.Tensor]:
    """The checked half of ``read_block``: the K/V of block file ``path`` (its bytes ``data`` if the caller read
    them, else read here), every layer's K then V, each shaped like one pool block, after every check
    ``read_block`` makes. The pool is not touched: a second tier stages a block this way when a prefix
    match finds it, and copies it in (``copy_block``) only once the request is admitted."""
    _check_pool(pool, name)
    path = Path(path)
    if data is None:
        try:
            data = path.read_bytes()
        except OSError as err:
            raise BlockFileError(f"{path}: cannot be read ({err.strerror or err})") from None
    if len(data) < len(MAGIC) + 4 or data[:len(MAGIC)] != MAGIC:
        raise BlockFileError(f"{path}: not a block file (no {MAGIC!r} at its start)")
    (size,) = struct.unpack("<I", data[len(MAGIC):len(MAGIC) + 4])
    start = len(MAGIC) + 4 + size
    try:
        header = json.loads(bytes(data[len(MAGIC) + 4:start]))
    except ValueError:
        raise BlockFileError(f"{path}: its header is cut short or damaged") from None
    if not isinstance(header, dict) or header.get("name") != name:
        raise BlockFileError(f"{path}: holds block {header.get('name') if isinstance(header, dict) else '?'!r}, "
                             f"not {name!r}")
    want = _layout(pool)
    got = {k: header.get(k) for k in want}
    if got != want:
        raise BlockFileError(f"{path}: written for a pool of {got}, this pool is {want}")
    payload = data[start:]
    if len(payload) != pool.bytes_per_block:
        raise BlockFileError(f"{path}: {len(payload)} bytes of K/V, a block holds {pool.bytes_per_block} "
                             f"(the file is {'cut short' if len(payload) < pool.bytes_per_block else 'too long'})")
    if hashlib.sha256(payload).hexdigest() != header.get("sha256"):
        raise BlockFileError(f"{path}: its K/V bytes do not match their checksum (the file is damaged)")
    raw = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    block = pool.k_caches[0][0]
    per = block.numel() * block.element_size()
    return [raw[i * per:(i + 1) * per].view(block.dtype).view(block.shape) for i in range(2 * len(pool.k_caches))]


def copy_block(pool: KVPool, block_id: int, parts: list[torch.Tensor]) -> None:
    """Copy ``decode_block``'s tensors (every layer's K then V) into pool block ``block_id``."""
    check_int("block_id", block_id, 0)
    if block_id >= pool.k_caches[0].shape[0]:
        raise ValueError(f"block_id must be in [0, {pool.k_caches[0].shape[0] - 1}], got {block_id}")
    caches = [c for layer in range(len(pool.k_caches)) for c in (pool.k_caches[layer], pool.v_caches[layer])]
    if len(parts) != len(caches) or any(p.shape != c[block_id].shape for p, c in zip(parts, caches)):
        raise ValueError(f"parts must be {len(caches)} tensors shaped {tuple(caches[0][block_id].shape)} "
                         f"(every layer's K then V)")
    for part, cache in zip(parts, caches):
        cache[block_id].copy_(part)
