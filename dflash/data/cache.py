"""The feature cache: safetensors shards of many sequences each, and a provenance manifest.

Shard `shard-00007.safetensors` holds, for its sequences in order: `input_ids` [T] int32,
`loss_mask` [T] uint8, `offsets` [n+1] int64 (sequence i is rows offsets[i]:offsets[i+1]) and
`features` [T, n_layers*H] in the storage dtype (float32, bfloat16, float16, or float8_e4m3fn with
`scales` [T, n_layers] float32, one scale per token and layer), and with features.topk_logits = k the
target's top-k next-token distribution per position (`topk_logprobs` [T, k], `topk_ids` [T, k], `topk_rest`
[T]; manifest key `topk_logits`). Shards are read memory-mapped,
one sequence at a time. Each finished shard has a sidecar `shard-00007.json` (its manifest
entry, with a sha256 of the file); `manifest.json` says what made the features (DESIGN §3)
and, once every shard is written, `complete: true`. `verified/rank-<r>.json` (dflash.data.stamp) records
what process r verified, so that a shard is hashed once, not by every process at every start.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from dflash.config.data import rounds
from dflash.data.stamp import Stamp, file_state
from dflash.dist import Dist
from dflash.errors import CacheError
from dflash.io import read_json, write_json
from dflash.layout import CacheLayout
from dflash.provenance import check_resumable
from dflash.target.features import TopK

log = logging.getLogger(__name__)

FP8_MAX = 448.0  # largest finite float8_e4m3fn


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 24), b""):
            h.update(chunk)
    return h.hexdigest()


def quantize(features: torch.Tensor, storage: str, n_layers: int) -> dict[str, torch.Tensor]:
    """[T, n*H] float -> stored tensors."""
    if storage != "float8_e4m3fn":
        return {"features": features.to(getattr(torch, storage)).contiguous()}
    x = features.float().view(features.shape[0], n_layers, -1)
    scales = (x.abs().amax(-1) / FP8_MAX).clamp_min(1e-12)
    q = (x / scales[..., None]).to(torch.float8_e4m3fn).view(features.shape[0], -1)
    return {"features": q.contiguous(), "scales": scales.contiguous()}


def dequantize(stored: torch.Tensor, scales: torch.Tensor | None, n_layers: int, dtype: torch.dtype) -> torch.Tensor:
    if scales is None:
        return stored.to(dtype)
    x = stored.float().view(stored.shape[0], n_layers, -1) * scales[..., None]
    return x.view(stored.shape[0], -1).to(dtype)


def write_shard(root: Path, k: int, ids: list[str], input_ids: list[torch.Tensor], loss_masks: list[torch.Tensor],
                features: list[torch.Tensor], storage: str, n_layers: int, stamp: Stamp | None = None,
                topk: list | None = None) -> dict:
    """Write shard k atomically (temp file, fsync, rename), then its sidecar; return the entry. With
    `stamp` (the writing process's), the writer's digest is recorded there, so that no later start
    hashes the shard again while its file is unchanged. topk: per sequence a dflash.target.features.TopK
    [T, k] (features.topk_logits), stored as topk_logprobs [T, k] float32, topk_ids [T, k] int32 and
    topk_rest [T] float32."""
    lengths = torch.tensor([0] + [t.numel() for t in input_ids])
    tensors = {
        "input_ids": torch.cat(input_ids).to(torch.int32),
        "loss_mask": torch.cat(loss_masks).to(torch.uint8),
        "offsets": lengths.cumsum(0).to(torch.int64),
        **quantize(torch.cat([f.float() for f in features]), storage, n_layers),
    }
    if topk is not None:
        tensors["topk_logprobs"] = torch.cat([t.logprobs.float() for t in topk]).contiguous()
        tensors["topk_ids"] = torch.cat([t.ids for t in topk]).to(torch.int32).contiguous()
        tensors["topk_rest"] = torch.cat([t.rest.float() for t in topk]).contiguous()
    layout = CacheLayout(root)
    path = layout.shard(k)
    tmp = root / f".{path.name}.tmp"
    # one metadata key: safetensors writes several in hash order, which would make shard bytes
    # (and their checksums) differ between runs that wrote the same data
    save_file(tensors, str(tmp), metadata={"dflash": json.dumps({"ids": ids, "storage": storage}, sort_keys=True)})
    with tmp.open("rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, path)
    entry = {"file": path.name, "sequences": len(ids), "tokens": int(lengths.sum()),
             "bytes": path.stat().st_size, "sha256": file_sha256(path), "lengths": lengths[1:].tolist(),
             "ids": ids}
    write_json(layout.sidecar(k), entry)
    if stamp is not None:
        stamp.add(path.name, entry["sha256"], file_state(path))
        stamp.save()
    return entry


def done_shards(root: Path) -> dict[int, dict]:
    """Shards whose file and sidecar agree (a shard without a sidecar is redone)."""
    done = {}
    for side in CacheLayout(root).sidecars():
        k = int(side.stem.split("-")[1])
        entry = read_json(side)
        path = root / entry["file"]
        if path.exists() and path.stat().st_size == entry["bytes"]:
            done[k] = entry
    return done


def recorded_storage(root: Path) -> str | None:
    """The storage of the cache begun or made at `root` (its manifest's), None where there is none."""
    path = CacheLayout(Path(root)).manifest
    return read_manifest(Path(root)).get("storage") if path.exists() else None


def open_for_writing(root: Path, manifest: dict) -> None:
    """Start a cache, or check that an unfinished one was begun with the same configuration. The manifest also
    records `storage_exact`: whether the stored features are the target's exactly (storage its dtype or float32),
    false where the drafter trains on rounded ones (dflash.config.data.rounds)."""
    root.mkdir(parents=True, exist_ok=True)
    for tmp in root.glob(".*.tmp"):  # debris of a crash mid-write
        tmp.unlink()
    path = CacheLayout(root).manifest
    if path.exists():
        old = read_json(path)
        check_resumable(old, manifest, root)
        if old.get("complete"):
            return
    if {"storage", "dtype"} <= manifest.keys():
        manifest = {**manifest, "storage_exact": not rounds(manifest["storage"], manifest["dtype"])}
    write_json(path, {**manifest, "complete": False})


def finalize(root: Path, num_shards: int) -> dict:
    """Record every shard in manifest.json and mark the cache complete."""
    manifest = read_json(CacheLayout(root).manifest)
    done = done_shards(root)
    missing = [k for k in range(num_shards) if k not in done]
    if missing:
        raise CacheError(f"cache {root} is missing shards {missing[:10]}; run extract.py again to finish it")
    manifest["shards"] = [done[k] for k in range(num_shards)]
    manifest["num_sequences"] = sum(e["sequences"] for e in manifest["shards"])
    manifest["num_tokens"] = sum(e["tokens"] for e in manifest["shards"])
    manifest["finished"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    manifest["complete"] = True
    write_json(CacheLayout(root).manifest, manifest)
    return manifest


def read_manifest(root: Path) -> dict:
    path = CacheLayout(Path(root)).manifest
    if not path.exists():
        raise CacheError(f"{root} has no manifest.json: it is not a dflash feature cache (run extract.py, "
                         f"or point features.dir at the cache directory)")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise CacheError(f"{path} is corrupt ({e}); delete {root} and extract again") from e


class FeatureCache:
    """Random access to the sequences of a complete cache: (input_ids, loss_mask, features).

    Shards are opened lazily (so DataLoader workers each map their own). With `verify`, a shard is
    checked against its sha256 before its data is read: all at once by `verify_all` (training, before
    step 0), else the first time it is opened in a process; either way only where no `Stamp` vouches
    for it.
    """

    def __init__(self, root: str | Path, verify: bool = True, dtype: torch.dtype = torch.bfloat16):
        self.root = Path(root)
        self.manifest = read_manifest(self.root)
        if not self.manifest.get("complete"):
            raise CacheError(f"cache {self.root} is incomplete (extraction stopped early); run extract.py "
                             f"with the same config to finish it")
        self.verify, self.dtype = verify, dtype
        self.n_layers = len(self.manifest["layer_ids"])
        self.index: list[tuple[int, int]] = []
        self.offsets: list[torch.Tensor | None] = []
        self.ids: list[str] = []
        self.seq_lengths: list[int] = []
        for k, entry in enumerate(self.manifest["shards"]):
            path = self.root / entry["file"]
            if not path.exists():
                raise CacheError(f"shard {path} is missing; re-run extract.py to rebuild it")
            if path.stat().st_size != entry["bytes"]:
                raise CacheError(f"shard {path} has {path.stat().st_size} bytes, expected {entry['bytes']} "
                                 f"(truncated?); delete it and its .json sidecar, then re-run extract.py")
            self.offsets.append(None)
            self.index.extend((k, i) for i in range(entry["sequences"]))
            self.ids.extend(entry["ids"])
            self.seq_lengths.extend(entry["lengths"])
        self._handles: dict[int, object] = {}
        self._verified: set[int] = set()
        self.stamp: Stamp | None = None
        """What this and the other processes verified before (read when first needed)."""
        self.hashed_bytes = 0
        """Bytes of shards this process has hashed."""

    def __len__(self) -> int:
        return len(self.index)

    def verify_all(self, dist: Dist | None = None) -> None:
        """Check every shard against its digest now, so that a corrupt one stops the run before its data
        loader starts, on every process, with a message naming it (here, not in a DataLoader worker,
        which would wrap the message in its traceback).

        Each shard is hashed once: where no stamp vouches for it (the writer's at extraction, or an
        earlier start's), by the one process of `dist` that owns it (k % world == rank, as extraction
        splits the writing), which records the result in its stamp; once all have (`Dist.wait_long`),
        every process reads the others' stamps. A second start hashes nothing. Where the others'
        stamps cannot be read here (a read-only cache folder, or a copy of the cache on each node
        rather than a shared one), this process hashes what they did not vouch for itself."""
        if not self.verify:
            return
        dist = dist or Dist()
        self.stamp = Stamp(self.root, dist.rank)
        n = len(self.manifest["shards"])
        todo = [k for k in range(n) if not self._vouched(k)]
        for k in todo:
            if k % dist.world == dist.rank:
                self._hash(k)
        self.stamp.save()
        corrupt = dict(self.stamp.corrupt)
        if dist.world > 1:
            # every process has hashed its share (hours, at a first start of a large cache) and saved its stamp
            dist.wait_long("verify_cache")
            self.stamp.refresh()
            for r in range(dist.world):
                if r != dist.rank:
                    corrupt.update(self.stamp.still_corrupt(r))
            left = [k for k in todo if k not in self._verified and self.manifest["shards"][k]["file"] not in corrupt
                    and not self._vouched(k)]
            if left:
                log.warning("process %d: no stamp readable here vouches for %d shards of %s that other processes "
                            "verified (is %s writable and shared by every process?); hashing them here too",
                            dist.rank, len(left), self.root, self.stamp.layout.stamp(0).parent)
                for k in left:
                    self._hash(k)
                corrupt.update(self.stamp.corrupt)
        if corrupt:
            names = sorted(corrupt)
            if len(names) == 1:
                raise CacheError(corrupt[names[0]]["error"])
            raise CacheError(f"{len(names)} shards of {self.root} do not match their checksums or cannot be read "
                             f"(corrupt): {', '.join(names[:20])}{' ...' if len(names) > 20 else ''}; delete each "
                             f"and its .json sidecar, then run extract.py again with the same config: it "
                             f"re-extracts only those shards (the other shards and the completions are kept)")
        log.info("cache %s: %d shards verified, %d of them hashed at this start (%.2f GB by this process)",
                 self.root, n, len(todo), self.hashed_bytes / 1e9)

    def _vouched(self, k: int) -> bool:
        """Whether a stamp vouches for shard k as its file is now (marks it verified)."""
        entry = self.manifest["shards"][k]
        if self.stamp.vouches(entry["file"], entry["sha256"], file_state(self.root / entry["file"])):
            self._verified.add(k)
        return k in self._verified

    def _hash(self, k: int) -> str | None:
        """Hash shard k and record the result in this process's stamp; the error, if it is corrupt."""
        entry = self.manifest["shards"][k]
        path = self.root / entry["file"]
        state = file_state(path)
        fix = (f"delete it and its sidecar {path.with_suffix('.json').name}, then run extract.py again with the "
               f"same config: it re-extracts only that shard (the other shards and the completions are kept)")
        try:
            error = None if file_sha256(path) == entry["sha256"] else \
                f"shard {path} does not match its checksum (corrupt); {fix}"
        except OSError as e:
            error = f"shard {path} cannot be read ({e}); {fix}"
        self.hashed_bytes += state["bytes"]
        if error:
            self.stamp.corrupt[entry["file"]] = {**state, "error": error}
        else:
            self.stamp.add(entry["file"], entry["sha256"], state)
            self._verified.add(k)
        return error

    def _check(self, k: int) -> None:
        """Before shard k's data is read in a process that did not run verify_all (evaluation, tools)."""
        if not self.verify or k in self._verified:
            return
        if self.stamp is None:
            self.stamp = Stamp(self.root)  # read here, never saved: DataLoader workers would race on one file
        if not self._vouched(k) and (error := self._hash(k)):
            raise CacheError(error)

    def _open(self, k: int):
        if k not in self._handles:
            path = self.root / self.manifest["shards"][k]["file"]
            self._check(k)
            try:
                handle = safe_open(str(path), framework="pt")
                self.offsets[k] = handle.get_tensor("offsets")
            except Exception as e:
                raise CacheError(f"shard {path} cannot be read ({e}); delete it and its sidecar, then re-run "
                                 f"extract.py") from e
            self._handles[k] = handle
        return self._handles[k]

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        ids, mask, stored, scales = self.stored(i)
        return ids, mask, dequantize(stored, scales, self.n_layers, self.dtype)

    def stored(self, i: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Sequence i as stored: (input_ids, loss_mask, features [T, n_layers*H] in the storage dtype, float8
        scales [T, n_layers] or None). Training moves these to the device and dequantizes there (half the bytes
        of float32 for bfloat16, a quarter for float8)."""
        k, j = self.index[i]
        f = self._open(k)
        s, e = self.offsets[k][j].item(), self.offsets[k][j + 1].item()
        ids = f.get_slice("input_ids")[s:e].long()
        mask = f.get_slice("loss_mask")[s:e].bool()
        stored = f.get_slice("features")[s:e]
        scales = f.get_slice("scales")[s:e] if "scales" in f.keys() else None
        return ids, mask, stored, scales

    @property
    def topk_logits(self) -> int:
        """k of the stored top-k next-token distributions (features.topk_logits); 0 when there are none."""
        return int(self.manifest.get("topk_logits") or 0)

    def topk(self, i: int):
        """Sequence i's stored top-k next-token distribution, a dflash.target.features.TopK [T, k] (ids as
        int64), or None when the cache holds none."""
        if not self.topk_logits:
            return None
        k, j = self.index[i]
        f = self._open(k)
        s, e = self.offsets[k][j].item(), self.offsets[k][j + 1].item()
        return TopK(f.get_slice("topk_logprobs")[s:e], f.get_slice("topk_ids")[s:e].long(),
                    f.get_slice("topk_rest")[s:e])

    def __getstate__(self):  # handles do not cross process boundaries; reopen lazily
        state = dict(self.__dict__)
        state["_handles"] = {}
        return state


def is_complete(root: str | Path) -> bool:
    """A finished cache is at `root` (its manifest says complete)."""
    path = CacheLayout(Path(root)).manifest
    return path.exists() and read_manifest(Path(root)).get("complete", False)
