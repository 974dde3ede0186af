"""The KV offload tier: prefix pages evicted from the pool kept in host memory, then on local disk,
and loaded back when a later prompt shares the prefix (vLLM's --kv-offloading-size idea, with
LMCache's disk tier).

    pool page evicted ──offload──▶ host tier (LRU, --kv-offload-gb) ──spill──▶ disk tier (--kv-offload-dir)
    match_prefix miss ──load──▶ host tier, else disk tier (checksum checked) ──▶ a pool page, published

The block manager calls `offload` as it takes a published page for reuse and `load` where its
pool misses (workers/engine/block_manager.py `OffloadTier`). Both copy at once: the page's content
is read before its new holder writes it, and a loaded page holds its content before any step can
read it. A loaded page leaves the host tier (the pool holds it; evicted again, it comes back);
a disk file stays until the disk budget pushes it out. `persist` (Engine.close: a worker that
stops on purpose) writes the host tier's pages and the pool's prefix pages to disk as well.

On disk, one file a page, named by its key, in a folder named by the engine's fingerprint (the
model file, the dtypes, the quantization, the page's shape, an fp8 pool's scales): a restarted
worker of the same model finds its pages again, and a different model never reads them. A file
is its header (msgpack: key, token ids, dtype, shape, CRC-32 of the data) and the page's bytes;
it is written to a temporary name and renamed, so a reader never sees half a file, and workers
sharing the folder share its pages. A file whose checksum, key, token ids, dtype or shape does not
match is removed and counts as a miss: the prefix is computed again.

On a GPU both copies are synchronous (a pinned staging buffer and a copy stream would overlap
them with the step); tensor- and pipeline-parallel workers, whose pages are split over ranks,
are refused (EngineConfig).
"""

from __future__ import annotations

import hashlib
import logging
import os
import struct
import zlib
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import msgpack
import torch

log = logging.getLogger(__name__)

HEADER_LENGTH = struct.Struct("<I")  # bytes of the msgpack header that follows
SUFFIX = ".kvpage"


@dataclass
class OffloadStats:
    offloaded: int = 0  # pages copied out of the pool
    host_hits: int = 0
    disk_hits: int = 0
    spilled: int = 0  # host pages written to disk
    dropped: int = 0  # pages no tier kept (host full, no disk tier)
    rejected: int = 0  # disk files that failed their checks (removed)


def page_bytes(tensor: torch.Tensor) -> bytes:
    return tensor.contiguous().view(torch.uint8).numpy().tobytes()


def checksum(data: bytes) -> int:
    """CRC-32 of a page's bytes: it catches a damaged or cut file (what it is for: not a digest
    against someone who may write the folder), 5x faster than blake2b here (0.2 ms a page)."""
    return zlib.crc32(data)


class DiskTier:
    """Page files in `folder` (one engine fingerprint's), at most `budget_bytes` of them written
    or found by this process, the least recently used removed first."""

    def __init__(self, folder: Path, budget_bytes: int, dtype: torch.dtype, shape: Sequence[int]):
        self.folder, self.budget_bytes, self.dtype, self.shape = folder, budget_bytes, dtype, tuple(shape)
        self.on_forget: Callable[[int], None] | None = None  # each key whose file it removes or loses
        self.dtype_name = str(dtype).removeprefix("torch.")
        folder.mkdir(parents=True, exist_ok=True)
        self.files: OrderedDict[int, int] = OrderedDict()  # key -> file bytes, least recently used first
        found = []
        for entry in os.scandir(folder):
            if entry.name.endswith(SUFFIX):
                try:
                    stat = entry.stat()
                    found.append((stat.st_mtime_ns, int(entry.name.removesuffix(SUFFIX), 16), stat.st_size))
                except (OSError, ValueError):
                    continue
        for _, key, size in sorted(found):
            self.files[key] = size
        self.bytes = sum(self.files.values())
        self._trim()

    def path(self, key: int) -> Path:
        return self.folder / f"{key:016x}{SUFFIX}"

    def __contains__(self, key: int) -> bool:
        return key in self.files or self.path(key).exists()

    def write(self, key: int, token_ids: tuple[int, ...], data: torch.Tensor) -> bool:
        """False: it could not be written."""
        if key in self.files:  # already there (the same prefix's page)
            self.files.move_to_end(key)
            return True
        raw = page_bytes(data)
        header = msgpack.packb(
            {
                "key": key,
                "token_ids": list(token_ids),
                "dtype": self.dtype_name,
                "shape": list(self.shape),
                "checksum": checksum(raw),
            }
        )
        path = self.path(key)
        temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        try:
            with open(temporary, "wb") as f:
                f.write(HEADER_LENGTH.pack(len(header)) + header + raw)
            os.replace(temporary, path)
        except OSError as e:
            log.warning("kv offload: cannot write %s: %s", path, e)
            temporary.unlink(missing_ok=True)
            return False
        size = HEADER_LENGTH.size + len(header) + len(raw)
        self.files[key] = size
        self.bytes += size
        self._trim()
        return True

    def read(self, key: int, token_ids: tuple[int, ...]) -> torch.Tensor | None:
        """The page under `key` if its file is there and passes every check; a file that fails
        one is removed (None)."""
        path = self.path(key)
        try:
            with open(path, "rb") as f:
                blob = bytearray(os.fstat(f.fileno()).st_size)  # read once, sliced without copies
                f.readinto(blob)
        except OSError:
            self._forget(key)
            return None
        data = self._checked_data(memoryview(blob), key, token_ids)
        if isinstance(data, str):
            log.warning("kv offload: %s: %s; removed, the prefix is computed again", path, data)
            path.unlink(missing_ok=True)
            self._forget(key)
            return None
        if key not in self.files:  # another process's file: now one of ours too
            self.files[key] = len(blob)
            self.bytes += len(blob)
        self.files.move_to_end(key)
        return torch.frombuffer(data, dtype=torch.uint8).view(self.dtype).view(self.shape)

    def _checked_data(self, blob: memoryview, key: int, token_ids: tuple[int, ...]) -> memoryview | str:
        """The page's bytes in `blob`, or what is wrong with the file."""
        try:
            (length,) = HEADER_LENGTH.unpack_from(blob)
            header = msgpack.unpackb(blob[HEADER_LENGTH.size : HEADER_LENGTH.size + length])
        except (struct.error, ValueError, msgpack.UnpackException) as e:
            return f"unreadable header ({e})"
        data = blob[HEADER_LENGTH.size + length :]
        if not isinstance(header, dict):
            return "unreadable header"
        if header.get("key") != key:
            return "another key"
        if tuple(header.get("token_ids", ())) != token_ids:
            return "other token ids"
        if header.get("dtype") != self.dtype_name or tuple(header.get("shape", ())) != self.shape:
            return "another page layout"
        if header.get("checksum") != checksum(data):
            return "checksum mismatch"
        return data

    def _forget(self, key: int) -> None:
        size = self.files.pop(key, None)
        if size is not None:
            self.bytes -= size
        if self.on_forget is not None:
            self.on_forget(key)

    def _trim(self) -> None:
        while self.files and self.bytes > self.budget_bytes:
            key = next(iter(self.files))
            self.path(key).unlink(missing_ok=True)
            self._forget(key)

    def clear(self) -> None:
        for key in list(self.files):
            self.path(key).unlink(missing_ok=True)
            self._forget(key)


class KVOffload:
    """The tiers behind one pool (`kv_cache` [layers, pages, 2, page size, KV heads, head dim]):
    `host_bytes` of pages in host memory, and a `disk` tier, or none."""

    def __init__(self, kv_cache: torch.Tensor, host_bytes: int, disk: DiskTier | None = None):
        self.kv_cache, self.host_bytes, self.disk = kv_cache, host_bytes, disk
        self.page_nbytes = kv_cache[:, 0].numel() * kv_cache.element_size()
        self.host: OrderedDict[int, tuple[tuple[int, ...], torch.Tensor]] = OrderedDict()  # LRU first
        self.stats = OffloadStats()
        self.on_forget: Callable[[int], None] | None = None  # each key no tier holds any more
        if disk is not None:
            disk.on_forget = self._forgot

    def _forgot(self, key: int) -> None:
        if self.on_forget is not None and key not in self.host and (self.disk is None or key not in self.disk.files):
            self.on_forget(key)

    def held_keys(self) -> list[int]:
        return [*self.host, *(() if self.disk is None else self.disk.files)]

    @property
    def host_pages(self) -> int:
        return len(self.host)

    def offload(self, key: int, page_id: int, token_ids: tuple[int, ...]) -> bool:
        self.stats.offloaded += 1
        data = copy_page_out(self.kv_cache, page_id)
        if self.page_nbytes > self.host_bytes:  # no host tier: straight to disk
            return self._spill(key, token_ids, data)
        self.host[key] = (token_ids, data)
        self.host.move_to_end(key)
        while len(self.host) * self.page_nbytes > self.host_bytes:
            old_key, (old_ids, old_data) = self.host.popitem(last=False)
            if not self._spill(old_key, old_ids, old_data):
                self._forgot(old_key)
        return True

    def _spill(self, key: int, token_ids: tuple[int, ...], data: torch.Tensor) -> bool:
        """To the disk tier; False: no disk tier, or the write failed (the page is dropped)."""
        if self.disk is None or not self.disk.write(key, token_ids, data):
            self.stats.dropped += 1
            return False
        self.stats.spilled += 1
        return True

    def load(self, key: int, page_id: int, token_ids: tuple[int, ...]) -> bool:
        held = self.host.get(key)
        if held is not None and held[0] == token_ids:
            del self.host[key]  # the pool holds it now
            self._forgot(key)  # unless a disk file holds it too
            data = held[1]
            self.stats.host_hits += 1
        elif self.disk is not None and key in self.disk:
            data = self.disk.read(key, token_ids)
            if data is None:
                self.stats.rejected += 1
                return False
            self.stats.disk_hits += 1
        else:
            return False
        copy_page_in(self.kv_cache, page_id, data)
        return True

    def persist(self, pages) -> None:
        """Host pages, then `pages` (key, pool page id, token ids; the most recently used last) to
        the disk tier, so that a restart finds them; nothing without a disk tier."""
        if self.disk is None:
            return
        for key, (token_ids, data) in list(self.host.items()):
            self.disk.write(key, token_ids, data)
        for key, page_id, token_ids in pages:
            self.disk.write(key, token_ids, copy_page_out(self.kv_cache, page_id))
        log.info("kv offload: %d pages on disk for the next start (%s)", len(self.disk.files), self.disk.folder)

    def clear(self) -> None:
        keys = list(self.host)
        self.host.clear()
        if self.disk is not None:
            self.disk.clear()
        for key in keys:
            self._forgot(key)


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype.itemsize == 1 else t  # fp8: torch has no fp8 copy_ on a CPU


def copy_page_out(kv_cache: torch.Tensor, page_id: int) -> torch.Tensor:
    """Page `page_id` of every layer as one CPU tensor [layers, 2, S, H, D]. A layer at a time: each
    is one contiguous run, copied on this thread, where one strided copy of the whole page is cut
    into parallel parts that wait on each other (5-50x slower on a busy 2-core machine)."""
    data = torch.empty(kv_cache[:, page_id].shape, dtype=kv_cache.dtype)
    for layer in range(kv_cache.shape[0]):
        as_bytes(data[layer]).copy_(as_bytes(kv_cache[layer, page_id]))
    return data


def copy_page_in(kv_cache: torch.Tensor, page_id: int, data: torch.Tensor) -> None:
    """`copy_page_out`'s tensor back into page `page_id`."""
    data = data.to(kv_cache.device)
    for layer in range(kv_cache.shape[0]):
        as_bytes(kv_cache[layer, page_id]).copy_(as_bytes(data[layer]))


def engine_fingerprint(model_path: Path, parts: Sequence[object]) -> str:
    """Names the disk tier's folder: the model file or folder (its files' names, sizes and
    modification times) and `parts` (dtypes, quantization, the page's shape, fp8 scales)."""
    digest = hashlib.blake2b(digest_size=8)
    files = [model_path] if model_path.is_file() else sorted(p for p in model_path.rglob("*") if p.is_file())
    for path in files:
        stat = path.stat()
        digest.update(f"{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}\n".encode())
    for part in parts:
        digest.update(repr(part).encode() + b"\n")
    return digest.hexdigest()


def offload_for_engine(config, kv_cache: torch.Tensor, model_path: Path | None, kv_scales: torch.Tensor | None):
    """The tiers `config` (an EngineConfig) asks for, behind `kv_cache`."""
    disk = None
    if config.kv_offload_dir is not None:
        if model_path is None:
            raise ValueError("kv_offload_dir: needs a model loaded from a path (it names the folder's pages)")
        parts = (
            str(kv_cache.dtype),
            tuple(kv_cache[:, 0].shape),
            config.quantization,
            config.batch_invariant,
            None if kv_scales is None else kv_scales.float().cpu().tolist(),
        )
        folder = Path(config.kv_offload_dir) / engine_fingerprint(Path(model_path), parts)
        disk = DiskTier(folder, int(config.kv_offload_disk_gb * 2**30), kv_cache.dtype, kv_cache[:, 0].shape)
        log.info("kv offload: disk tier %s (%d pages found)", folder, len(disk.files))
    return KVOffload(kv_cache, int(config.kv_offload_gb * 2**30), disk)
