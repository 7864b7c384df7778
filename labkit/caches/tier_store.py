"""Second tiers that hold real K/V: block files on a disk, or tensors in host memory (chapter 08).

``labkit.memory.tiered.TierStore`` keeps the *names* of the blocks a pool evicted, which is all a
simulator needs. An engine needs the K/V too, and the four payload hooks move them:

* ``save(block_id, entry)``: the allocator is about to hand pool block ``block_id`` to someone else;
  its K/V are still intact, so copy them out now (the only chance);
* ``fetch(entry)``: a prefix match found ``entry`` in the tier: read it and check it *now*, into a
  staging copy, without touching the pool. A copy that cannot be used raises ``TierLoadError``
  (``BlockFileError`` for a file): the match ends there, the entry leaves the tier, and the request
  computes those tokens again, before any of them was counted as computed;
* ``load(payload, block_id)``: the request was admitted onto fresh pool blocks: copy the staged K/V in;
* ``drop(entry)``: the tier forgets the block (no room, or refused): free what it occupied.

``DiskTierStore`` writes each block to ``<entry_id>.kvblock`` (``labkit.caches.block_files``: a header
naming the block and the pool's shape, and a SHA-256 of its bytes). Reading it back costs a file open
plus the bytes over the disk's bandwidth; ``direct_io=True`` reads with ``O_DIRECT`` so the
operating system's page cache cannot serve the read from memory and flatter the disk. Where the
filesystem refuses ``O_DIRECT`` (tmpfs does), the store says so in ``read_mode`` and drops the file's
cached pages (``posix_fadvise(DONTNEED)``) before each read instead. Either way this bypasses only
*this* machine's cache: a virtual disk may still be cached by its host.

``MemoryTierStore`` keeps clones of the block's tensors in host memory: vLLM's CPU offloading
(``OffloadingConnector`` with a CPU backend), where a load is one copy over the host link.

Both count what they moved: ``bytes_written``, ``bytes_read``, ``write_s`` and ``read_s`` (reading and
checking, in ``fetch``) and ``load_s`` (the copies into the pool).
"""

from __future__ import annotations

import mmap
import os
import time
from pathlib import Path

import torch

from ..checks import check_flag
from ..memory.prefix import CachedBlock
from ..memory.tiered import TierStore
from .block_files import BlockFileError, copy_block, decode_block, write_block
from .paged import KVPool

__all__ = ["DiskTierStore", "MemoryTierStore"]

_ALIGN = 4096  # O_DIRECT wants buffers, offsets and lengths aligned to the device's block; 4 KiB suits all


def _check_pool(pool: object) -> KVPool:
    if not isinstance(pool, KVPool):
        raise ValueError(f"pool must be a labkit.caches.paged.KVPool, got {type(pool).__name__}")
    if pool.k_scales[0] is not None:
        raise ValueError("pool must hold unquantized K/V (a quantized pool's scales are not kept by a tier)")
    return pool


def _read_uncached(path: Path) -> bytes:
    """``path``'s bytes, after dropping its cached pages (``posix_fadvise(DONTNEED)``)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        return os.pread(fd, os.fstat(fd).st_size, 0)
    finally:
        os.close(fd)


def _read_direct(path: Path) -> bytes:
    """``path``'s bytes, read with ``O_DIRECT`` into a page-aligned buffer (OSError where it is refused)."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    try:
        size = os.fstat(fd).st_size
        buf = mmap.mmap(-1, max(_ALIGN, -(-size // _ALIGN) * _ALIGN))  # page-aligned, as O_DIRECT needs
        view, got = memoryview(buf), 0
        while got < size:
            n = os.readv(fd, [view[got:]])
            if n == 0:
                break
            got += n
        return bytes(view[:got])
    finally:
        os.close(fd)


class _PayloadStore(TierStore):
    """What both stores share: the pool, and the counters of what moved and how long it took."""

    def __init__(self, pool: KVPool, capacity: int):
        self.pool = _check_pool(pool)
        super().__init__(capacity)
        self.bytes_written = self.bytes_read = 0
        self.write_s = self.read_s = self.load_s = 0.0

    def _parts(self, block_id: int) -> list[torch.Tensor]:
        k, v = self.pool.k_caches, self.pool.v_caches
        return [c[block_id] for layer in range(len(k)) for c in (k[layer], v[layer])]

    def load(self, payload: list[torch.Tensor], block_id: int) -> None:
        start = time.perf_counter()
        copy_block(self.pool, block_id, payload)
        self.load_s += time.perf_counter() - start


class MemoryTierStore(_PayloadStore):
    """A tier in host memory: each evicted block's K/V cloned to the CPU, up to ``capacity`` blocks."""

    def __init__(self, pool: KVPool, capacity: int):
        super().__init__(pool, capacity)
        self.blocks: dict[int, list[torch.Tensor]] = {}  # entry id -> every layer's K then V

    def save(self, block_id: int, entry: CachedBlock) -> None:
        start = time.perf_counter()
        self.blocks[entry.entry_id] = [p.to("cpu", copy=True) for p in self._parts(block_id)]
        self.bytes_written += self.pool.bytes_per_block
        self.write_s += time.perf_counter() - start

    def fetch(self, entry: CachedBlock) -> list[torch.Tensor]:
        parts = self.blocks.get(entry.entry_id)
        if parts is None:  # cannot happen unless someone emptied the dict behind the store's back
            raise BlockFileError(f"block {entry.entry_id}: not in host memory")
        self.bytes_read += self.pool.bytes_per_block
        return parts

    def drop(self, entry: CachedBlock) -> None:
        self.blocks.pop(entry.entry_id, None)


class DiskTierStore(_PayloadStore):
    """A tier of block files in ``directory`` (created if missing), up to ``capacity`` blocks.

    ``direct_io``: read with ``O_DIRECT`` (``read_mode`` "direct"), or where the filesystem refuses it, after
    dropping the file's cached pages ("fadvise"); False reads through the page cache ("cached").
    """

    def __init__(self, pool: KVPool, directory: str | os.PathLike, capacity: int, *, direct_io: bool = False):
        super().__init__(pool, capacity)
        self.direct_io = check_flag("direct_io", direct_io)
        if not isinstance(directory, (str, os.PathLike)) or not str(directory):
            raise ValueError(f"directory must be a path (str or os.PathLike), got {directory!r}")
        self.directory = Path(directory)
        created = not self.directory.exists()
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise ValueError(f"directory must be a writable folder, {self.directory} is not ({err})") from None
        try:
            self.read_mode = self._probe() if direct_io else "cached"
        except ValueError:
            if created:  # refused: leave no folder behind
                self.directory.rmdir()
            raise

    def path(self, entry: CachedBlock) -> Path:
        """The file that holds ``entry``'s K/V."""
        return self.directory / f"{entry.entry_id}.kvblock"

    @staticmethod
    def name(entry: CachedBlock) -> str:
        """The name written into the file's header and checked on reading: the block's hash."""
        return str(entry.block_hash)

    def _probe(self) -> str:
        """"direct" if this file system reads with O_DIRECT (an aligned read, not only the open: some refuse at
        the read), else "fadvise" if it takes ``posix_fadvise``; ValueError if neither works here."""
        probe = self.directory / ".direct_io_probe"
        probe.write_bytes(b"\0" * _ALIGN)
        try:
            if hasattr(os, "O_DIRECT"):
                try:
                    if len(_read_direct(probe)) == _ALIGN:
                        return "direct"
                except OSError:
                    pass  # tmpfs and some overlayfs refuse O_DIRECT
            if hasattr(os, "posix_fadvise"):
                try:
                    _read_uncached(probe)
                    return "fadvise"
                except OSError:
                    pass
            raise ValueError(f"direct_io=True needs O_DIRECT or posix_fadvise, and neither works here "
                             f"(for {self.directory}); pass direct_io=False")
        finally:
            probe.unlink()

    def save(self, block_id: int, entry: CachedBlock) -> None:
        start = time.perf_counter()
        path = self.path(entry)
        self.bytes_written += write_block(self.pool, block_id, self.name(entry), path)
        if self.read_mode == "fadvise":  # written pages must reach the disk before they can be dropped
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
        self.write_s += time.perf_counter() - start

    def _read(self, path: Path) -> bytes | memoryview:
        """The file's bytes, the way ``read_mode`` says."""
        if self.read_mode == "cached":
            return path.read_bytes()
        return _read_uncached(path) if self.read_mode == "fadvise" else _read_direct(path)

    def fetch(self, entry: CachedBlock) -> list[torch.Tensor]:
        path, start = self.path(entry), time.perf_counter()
        try:
            data = self._read(path)
        except OSError as err:
            raise BlockFileError(f"{path}: cannot be read ({err.strerror or err})") from None
        try:
            parts = decode_block(self.pool, self.name(entry), path, data)
        finally:
            self.read_s += time.perf_counter() - start
        self.bytes_read += len(data)
        return parts

    def drop(self, entry: CachedBlock) -> None:
        self.path(entry).unlink(missing_ok=True)
