"""The feature cache: safetensors shards of many sequences each, and a provenance manifest.

Shard `shard-00007.safetensors` holds, for its sequences in order: `input_ids` [T] int32,
`loss_mask` [T] uint8, `offsets` [n+1] int64 (sequence i is rows offsets[i]:offsets[i+1]) and
`features` [T, n_layers*H] in the storage dtype (bfloat16, float32, or float8_e4m3fn with
`scales` [T, n_layers] float32, one scale per token and layer). Shards are read memory-mapped,
one sequence at a time. Each finished shard has a sidecar `shard-00007.json` (its manifest
entry, with a sha256 of the file); `manifest.json` says what made the features (DESIGN §3)
and, once every shard is written, `complete: true`.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from dflash.errors import CacheError
from dflash.io import read_json, write_json
from dflash.layout import CacheLayout
from dflash.provenance import check_resumable

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
                features: list[torch.Tensor], storage: str, n_layers: int) -> dict:
    """Write shard k atomically (temp file, fsync, rename), then its sidecar; return the entry."""
    lengths = torch.tensor([0] + [t.numel() for t in input_ids])
    tensors = {
        "input_ids": torch.cat(input_ids).to(torch.int32),
        "loss_mask": torch.cat(loss_masks).to(torch.uint8),
        "offsets": lengths.cumsum(0).to(torch.int64),
        **quantize(torch.cat([f.float() for f in features]), storage, n_layers),
    }
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


def open_for_writing(root: Path, manifest: dict) -> None:
    """Start a cache, or check that an unfinished one was begun with the same configuration."""
    root.mkdir(parents=True, exist_ok=True)
    for tmp in root.glob(".*.tmp"):  # debris of a crash mid-write
        tmp.unlink()
    path = CacheLayout(root).manifest
    if path.exists():
        old = read_json(path)
        check_resumable(old, manifest, root)
        if old.get("complete"):
            return
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

    Shards are opened lazily (so DataLoader workers each map their own) and, with `verify`,
    checked against their sha256 the first time each is opened in a process.
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

    def __len__(self) -> int:
        return len(self.index)

    def verify_all(self) -> None:
        """Check every shard against its checksum now (one read of the cache), so that a corrupt shard
        stops a run before its data loader starts, in the process that can report it on one line."""
        for k in range(len(self.manifest["shards"])):
            self._check(k)

    def _check(self, k: int) -> None:
        if self.verify and k not in self._verified:
            path = self.root / self.manifest["shards"][k]["file"]
            if file_sha256(path) != self.manifest["shards"][k]["sha256"]:
                raise CacheError(f"shard {path} does not match its checksum (corrupt); delete it and its "
                                 f"sidecar {path.with_suffix('.json').name}, then re-run extract.py")
            self._verified.add(k)

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
        k, j = self.index[i]
        f = self._open(k)
        s, e = self.offsets[k][j].item(), self.offsets[k][j + 1].item()
        ids = f.get_slice("input_ids")[s:e].long()
        mask = f.get_slice("loss_mask")[s:e].bool()
        stored = f.get_slice("features")[s:e]
        scales = f.get_slice("scales")[s:e] if "scales" in f.keys() else None
        return ids, mask, dequantize(stored, scales, self.n_layers, self.dtype)

    def __getstate__(self):  # handles do not cross process boundaries; reopen lazily
        state = dict(self.__dict__)
        state["_handles"] = {}
        return state


def is_complete(root: str | Path) -> bool:
    """A finished cache is at `root` (its manifest says complete)."""
    path = CacheLayout(Path(root)).manifest
    return path.exists() and read_manifest(Path(root)).get("complete", False)
