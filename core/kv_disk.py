"""The prefix cache's second tier: cached blocks kept on disk under their chain hash, so the
chapter's chain outlives the process (issue 52, off unless ``kv_disk_dir`` is given).

The chapter names a whole prefix by one chain hash. The pool forgets that name when a cached
block is evicted, and the process forgets it when it ends. This tier keeps the block: a block
that leaves the pool with a hash (the "evict" of prefix_cache.py's section 6) -- and, with
``write="save"``, every block when it is saved -- is written to one file named by its hash. A
lookup that misses in the pool probes the tier along the same chain (``probe``); each block
found is loaded into a fresh pool block the plan takes, and the commit registers it in the
map as if the step had computed it.

Never a wrong token. Files live in a namespace directory named by a fingerprint of everything
that makes K/V what it is (``fingerprint``): the weights' bytes, dtype, quantization, the
model's config (RoPE included), the backend, the block size and the hash function. Each file
also carries its fingerprint, its hash, its parent's hash, its token ids and its salt, and a
checksum of all of it; a block read back is served only if all of them match what the
``Sequence``'s chain says (the chain is read off the ``Sequence``, never hashed again). A file
that is absent, truncated, corrupted or foreign is a miss, counted, never an error.

Writes are atomic (a private temporary file, fsync, ``os.replace``): a crash or Ctrl-C mid-write
leaves no readable file, and two engines on one directory only ever see whole files. The
budget (``size_bytes``) is kept least recently used first: a hit touches its file's time.

When a load becomes visible: ``probe`` reads into memory, ``place`` copies into pool blocks
the plan reserved (free blocks nothing committed points at), and only the commit registers
them. A step that fails leaves the map, and the tier, as they were.
"""
from __future__ import annotations

import json
import os
import struct
import time
import uuid
import weakref
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch
import xxhash

FORMAT = b"KVDISK1\n"        # magic and format version: an older layout is a foreign file
SUFFIX = ".kvb"
MEDIUM_DISK = "DISK"          # KV events' medium for this tier (vLLM's pool is "GPU", its offload "CPU")
WRITE_MODES = ("evict", "save")
ROOT = object()               # a first block's parent: the chain's seed (its salt's root hash)
_LEN = struct.Struct("<I")
_SUM = struct.Struct("<Q")


def fingerprint(model, backend_name: str, block_size: int, hash_fn) -> str:
    """What K/V depends on, as one hex name: every parameter's and buffer's bytes, the config,
    the dtype, the weight format, the backend, the block size and the hash function."""
    h = xxhash.xxh3_128()
    described = [FORMAT.decode(), repr(model.config), str(model.dtype), str(model.quantization),
                 backend_name, str(block_size), _hash_fn_name(hash_fn)]
    h.update("\n".join(described).encode())
    for name, tensor in model.state_dict(keep_vars=True).items():
        h.update(f"{name}:{tensor.dtype}:{tuple(tensor.shape)}".encode())
        h.update(_tensor_bytes(tensor))
    return h.hexdigest()


def _hash_fn_name(fn) -> str:
    return f"{getattr(fn, '__module__', '')}.{getattr(fn, '__qualname__', '')}:{fn!r}"


def _tensor_bytes(tensor: torch.Tensor) -> memoryview:
    flat = tensor.detach().contiguous().reshape(-1).view(torch.uint8).cpu()
    return memoryview(flat.numpy())


@dataclass
class TierBlock:
    """One block read back and verified: its K/V in memory until ``place`` copies them in."""

    index: int
    block_hash: int
    k: torch.Tensor
    v: torch.Tensor


@dataclass
class TierStats:
    """Per-tier counters (``EngineCore.stats`` reports them as ``kv_disk_*``)."""

    hits: int = 0             # blocks served from disk
    misses: int = 0           # probes that found no file
    bad_files: int = 0        # files found but refused: truncated, corrupted, foreign, stale
    writes: int = 0
    write_errors: int = 0     # a write that failed (disk full, permissions): nothing kept
    removed: int = 0          # files deleted to keep the budget
    bytes_read: int = 0
    bytes_written: int = 0
    load_seconds: float = 0.0  # reading + verifying + copying into the pool
    place_seconds: float = 0.0  # of which copying into the pool (a pool page's first touch faults)

    def as_dict(self) -> dict:
        return {f"kv_disk_{k}": v for k, v in self.__dict__.items()}


@dataclass
class _Index:
    """Every file of the directory (all namespaces): path -> size, least recently used first."""

    files: OrderedDict = field(default_factory=OrderedDict)
    total: int = 0

    @classmethod
    def scan(cls, root: Path) -> "_Index":
        """Once, at start: what earlier engines left, oldest access first."""
        found = []
        for path in root.glob(f"*/*{SUFFIX}"):
            try:
                st = path.stat()
            except OSError:
                continue
            found.append((st.st_mtime, path, st.st_size))
        index = cls()
        for _, path, size in sorted(found):
            index.add(path, size)
        return index

    def add(self, path: Path, size: int) -> None:
        self.total += size - self.files.pop(path, 0)
        self.files[path] = size

    def touch(self, path: Path) -> None:
        if path in self.files:
            self.files.move_to_end(path)

    def pop_oldest(self) -> Path:
        path, size = self.files.popitem(last=False)
        self.total -= size
        return path


class DiskTier:
    """The tier of one engine: ``attach`` it to the prefix cache, then ``probe`` / ``place``
    (the plan), ``flush`` (after a commit) and ``new_weights`` (the weights changed)."""

    enabled = True

    def __init__(self, directory, size_bytes: int, kv, fingerprint_fn: Callable[[], str],
                 write: str = "evict") -> None:
        if write not in WRITE_MODES:
            raise ValueError(f"kv_disk_write must be one of {WRITE_MODES}, got {write!r}")
        if size_bytes <= 0:
            raise ValueError(f"kv_disk_size must be > 0, got {size_bytes} bytes")
        self.root = Path(directory)
        self.root.mkdir(parents=True, exist_ok=True)
        self.size_bytes, self.kv, self.write = int(size_bytes), kv, write
        self._fingerprint_fn = fingerprint_fn
        self.stats = TierStats()
        self.index = _Index.scan(self.root)
        self._listeners: list[Callable] = []
        self._parent_of: dict[int, int] = {}  # pool block id -> its parent's hash, set at save
        self._pending: dict[int, int] = {}    # block id -> hash, saved and still to write ("save")
        # a waiting sequence's last probe (it may wait for pool blocks): never read twice
        self._probed: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self.new_weights()

    def new_weights(self) -> None:
        """The weights changed: a new namespace; the old weights' files are never read again
        (they age out of the budget)."""
        self.namespace = self._fingerprint_fn()
        self.dir = self.root / self.namespace
        self.dir.mkdir(exist_ok=True)
        self._parent_of.clear()
        self._pending.clear()
        self._probed = weakref.WeakKeyDictionary()

    def attach(self, prefix_cache) -> None:
        """Follow the pool's saves and evictions (the prefix cache's trace)."""
        self.cache, self.blocks = prefix_cache, prefix_cache.block_manager.blocks
        prefix_cache.tier = self
        prefix_cache.subscribe(self._on_chain_event)

    def subscribe(self, listener: Callable[[str, int, int | None, bytes | None], None]) -> None:
        """``listener(kind, hash, parent hash, token bytes)``: "stored" / "removed" on disk."""
        self._listeners.append(listener)

    def path_of(self, block_hash: int) -> Path:
        return self.dir / f"{block_hash:x}{SUFFIX}"

    # ------------------------------------------------------------------ reading (the plan)

    def probe(self, seq, chain: list[int], first: int, last: int) -> list[TierBlock]:
        """``seq``'s blocks [first, last) from disk, in order, stopping at the first miss; each
        verified against the chain on ``seq`` (hash, parent, tokens, salt)."""
        kept = self._probed.get(seq)
        if kept is not None and kept[0] == first:  # it waited a step: read once, kept
            return kept[1][:last - first]
        found: list[TierBlock] = []
        for index in range(first, last):
            block = self._read(seq, chain, index)
            if block is None:
                break
            found.append(block)
        if found:
            self._probed[seq] = (first, found)
        return found

    def _read(self, seq, chain: list[int], index: int) -> TierBlock | None:
        started, path = time.perf_counter(), self.path_of(chain[index])
        try:
            data = _read_whole(path)
        except OSError:  # absent, or removed by another engine meanwhile
            self.stats.misses += 1
            return None
        block = self._verify(data, seq, chain, index)
        if block is None:
            self.stats.bad_files += 1
            return None
        self._touch(path, len(data))
        self.stats.hits += 1
        self.stats.bytes_read += len(data)
        self.stats.load_seconds += time.perf_counter() - started
        return block

    def _verify(self, data: bytes, seq, chain: list[int], index: int) -> TierBlock | None:
        """The block in ``data`` if it is whole and is exactly ``seq``'s block ``index``."""
        try:
            header, tokens, salt, payload = _unpack(data)
        except (ValueError, KeyError, TypeError, struct.error, UnicodeDecodeError):
            return None
        parent = chain[index - 1] if index else seq._root_hash
        bs = self.kv.block_size
        if (header["fingerprint"] != self.namespace or header["hash"] != chain[index]
                or header["parent"] != parent or salt != seq.cache_salt
                or tokens != seq.block_bytes(index, bs) or len(payload) != self._block_nbytes()):
            return None
        k, v = self._tensors(payload)
        return TierBlock(index, chain[index], k, v)

    def _touch(self, path: Path, size: int) -> None:
        """A hit: this file is the most recently used (for every engine on the directory)."""
        try:
            os.utime(path)
        except OSError:
            pass
        self.index.add(path, size)

    # ------------------------------------------------------------------ into the pool

    def place(self, seq, loaded: list[TierBlock], blocks) -> None:
        """Copy each loaded block's K/V into its pool block (a fresh block the plan took)."""
        self._probed.pop(seq, None)
        started = time.perf_counter()
        for tier_block, block in zip(loaded, blocks):
            rows = self._rows(block.block_id)
            self.kv.k[:, :, rows].copy_(tier_block.k)
            self.kv.v[:, :, rows].copy_(tier_block.v)
        spent = time.perf_counter() - started
        self.stats.load_seconds += spent
        self.stats.place_seconds += spent

    def _rows(self, block_id: int) -> slice:
        bs = self.kv.block_size
        return slice(block_id * bs, (block_id + 1) * bs)

    def _block_shape(self) -> tuple[int, ...]:
        layers, heads, _, dim = self.kv.k.shape
        return layers, heads, self.kv.block_size, dim

    def _block_nbytes(self) -> int:
        n = 1
        for d in self._block_shape():
            n *= d
        return 2 * n * self.kv.k.element_size()

    def _tensors(self, payload: memoryview) -> tuple[torch.Tensor, torch.Tensor]:
        flat = torch.frombuffer(payload, dtype=self.kv.k.dtype)  # no copy: the file's own buffer
        k, v = flat.view(2, *self._block_shape()).to(self.kv.k.device)
        return k, v

    # ------------------------------------------------------------------ writing

    def _on_chain_event(self, event) -> None:
        """The pool saved a block (remember its parent's hash; "save" mode: write it after
        the commit), or is evicting one (write it now: the forward will overwrite its K/V)."""
        if event.kind == "save":
            block = self.blocks[event.block_id]  # its parent is cached (or it is a first block)
            self._parent_of[event.block_id] = (self.blocks[block.parent[0]].block_hash
                                               if block.parent else ROOT)
            if self.write == "save":
                self._pending[event.block_id] = event.block_hash
        elif event.kind == "evict":
            self._pending.pop(event.block_id, None)
            self._store(self.blocks[event.block_id])
            self._parent_of.pop(event.block_id, None)
        elif event.kind == "forget":  # a reset: the block's K/V is no longer trusted
            self._pending.pop(event.block_id, None)
            self._parent_of.pop(event.block_id, None)

    def flush(self) -> None:
        """Write the blocks saved by the last commit ("save" mode); after the commit, so a
        commit never waits on a disk."""
        pending, self._pending = self._pending, {}
        for block_id, block_hash in pending.items():
            block = self.blocks[block_id]
            if block.block_hash == block_hash:
                self._store(block)

    def _store(self, block) -> None:
        parent = self._parent_of.get(block.block_id)
        if parent is None or block.block_hash is None:
            return  # its save was before a reset or a weight change: not this namespace's
        if parent is ROOT:  # the chain's seed, hashed here and not in a commit (a salt's hash)
            parent = self.cache.root_hash(block.salt)
        path = self.path_of(block.block_hash)
        if path in self.index.files:  # already there (it was loaded from disk, or saved before)
            self.index.touch(path)
            return
        data = self._pack(block, parent)
        if self._write_atomic(path, data):
            self.index.add(path, len(data))
            self.stats.writes += 1
            self.stats.bytes_written += len(data)
            self._emit("stored", block.block_hash, parent, block.token_bytes)
            self._keep_budget()

    def _pack(self, block, parent: int) -> bytes:
        rows = self._rows(block.block_id)
        kv = torch.stack([self.kv.k[:, :, rows], self.kv.v[:, :, rows]]).contiguous()
        payload = _tensor_bytes(kv).tobytes()
        salt = None if block.salt is None else block.salt.encode()
        header = {"fingerprint": self.namespace, "hash": block.block_hash, "parent": parent,
                  "tokens": len(block.token_bytes), "salt": None if salt is None else len(salt),
                  "payload": len(payload), "dtype": str(self.kv.k.dtype),
                  "shape": list(self._block_shape())}
        return _pack(header, block.token_bytes, salt or b"", payload)

    def _write_atomic(self, path: Path, data: bytes) -> bool:
        """Temporary file (unique to this process and call), fsync, rename over the name: a
        reader sees the old file, the whole new one, or none. Anything raised midway removes
        the temporary file; an interrupt is raised again once it is gone."""
        tmp = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex}.tmp")
        try:
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
            return True
        except BaseException as exc:
            _unlink(tmp)
            if not isinstance(exc, Exception):
                raise
            self.stats.write_errors += 1
            return False

    def _keep_budget(self) -> None:
        """Least recently used files leave until the directory fits its budget."""
        while self.index.total > self.size_bytes and self.index.files:
            path = self.index.pop_oldest()
            _unlink(path)
            self.stats.removed += 1
            if path.parent == self.dir:
                self._emit("removed", int(path.stem, 16), None, None)

    def _emit(self, kind: str, block_hash: int, parent: int | None, tokens: bytes | None) -> None:
        for listener in list(self._listeners):
            listener(kind, block_hash, parent, tokens)


def _unlink(path: Path) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def _pack(header: dict, tokens: bytes, salt: bytes, payload: bytes) -> bytes:
    head = json.dumps(header, sort_keys=True).encode()
    # spaces after the JSON so the payload starts 64-byte aligned (read back as a tensor in place)
    head += b" " * (-(len(FORMAT) + _LEN.size + len(head) + len(tokens) + len(salt)) % 64)
    body = b"".join([FORMAT, _LEN.pack(len(head)), head, tokens, salt, payload])
    return body + _SUM.pack(xxhash.xxh3_64_intdigest(body))


def _read_whole(path: Path) -> bytearray:
    """The file in one writable buffer (its payload becomes a tensor without a copy)."""
    with open(path, "rb", buffering=0) as f:
        size = os.fstat(f.fileno()).st_size
        data = bytearray(size)
        if f.readinto(data) != size:
            raise OSError(f"{path}: changed while read")
    return data


def _unpack(data) -> tuple[dict, bytes, str | None, memoryview]:
    """(header, token bytes, salt, payload) of a whole, unaltered file; ValueError otherwise.
    ``data``: bytes or a bytearray; the payload is a view into it."""
    data = memoryview(data)
    if len(data) < len(FORMAT) + _LEN.size + _SUM.size or bytes(data[:len(FORMAT)]) != FORMAT:
        raise ValueError("not a tier file")
    body, (checksum,) = data[:-_SUM.size], _SUM.unpack(data[-_SUM.size:])
    if xxhash.xxh3_64_intdigest(body) != checksum:
        raise ValueError("checksum")
    at = len(FORMAT) + _LEN.size
    (head_len,) = _LEN.unpack(body[len(FORMAT):at])
    header = json.loads(bytes(body[at:at + head_len]))
    at += head_len
    n_tok, n_salt = header["tokens"], header["salt"]
    tokens, at = bytes(body[at:at + n_tok]), at + n_tok
    salt = None if n_salt is None else bytes(body[at:at + n_salt]).decode()
    at += n_salt or 0
    payload = body[at:]
    if len(payload) != header["payload"]:
        raise ValueError("length")
    return header, tokens, salt, payload
