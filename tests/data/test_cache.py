import json
import os
import subprocess
import sys
import time

import pytest
import torch

from dflash.data import cache as fcache
from dflash.data import stamp as fstamp
from dflash.data.cache import FeatureCache
from dflash.errors import CacheError
from dflash.layout import CacheLayout
from tests.conftest import REPO


def make_cache(root, storage="bfloat16", n=5, layers=2, hidden=8, seed=0, base_len=3):
    g = torch.Generator().manual_seed(seed)
    seqs = []
    for i in range(n):
        L = base_len + i
        seqs.append((f"s{i}", torch.randint(0, 100, (L,), generator=g), torch.rand(L, generator=g) > 0.5,
                     torch.randn(L, layers * hidden, generator=g) * (1 + 10 * i)))
    manifest = {"format_version": 1, "layer_ids": list(range(layers)), "storage": storage, "target": {"x": 1}}
    fcache.open_for_writing(root, manifest)
    for k in range(0, n, 2):
        part = seqs[k:k + 2]
        fcache.write_shard(root, k // 2, [s[0] for s in part], [s[1] for s in part], [s[2] for s in part],
                           [s[3] for s in part], storage, layers)
    fcache.finalize(root, (n + 1) // 2)
    return seqs


@pytest.mark.parametrize("storage", ["float32", "bfloat16", "float8_e4m3fn"])
def test_round_trip_per_sequence(tmp_path, storage):
    seqs = make_cache(tmp_path, storage)
    cache = FeatureCache(tmp_path, dtype=torch.float32)
    assert len(cache) == 5 and cache.ids == [s[0] for s in seqs] and cache.seq_lengths == [3, 4, 5, 6, 7]
    for i in (4, 0, 2):  # random access across shards
        ids, mask, feats = cache[i]
        assert torch.equal(ids, seqs[i][1]) and torch.equal(mask, seqs[i][2])
        ref = seqs[i][3]
        if storage == "float32":
            assert torch.equal(feats, ref)
        elif storage == "bfloat16":
            assert torch.equal(feats, ref.to(torch.bfloat16).float())
        else:  # e4m3 keeps ~3 mantissa bits, per token and layer scale
            rel = (feats - ref).norm() / ref.norm()
            assert rel < 0.05, rel


def test_fp8_is_about_half_of_bf16(tmp_path):
    make_cache(tmp_path / "a", "bfloat16", n=6, layers=4, hidden=256, base_len=100)
    make_cache(tmp_path / "b", "float8_e4m3fn", n=6, layers=4, hidden=256, base_len=100)
    size = lambda p: sum(f.stat().st_size for f in p.glob("*.safetensors"))  # noqa: E731
    assert size(tmp_path / "b") <= 0.52 * size(tmp_path / "a")


def test_incomplete_missing_truncated_and_corrupt_shards(tmp_path):
    with pytest.raises(CacheError, match="no manifest.json"):
        FeatureCache(tmp_path / "empty")
    make_cache(tmp_path / "c")
    manifest = json.loads((tmp_path / "c" / "manifest.json").read_text())
    shard = tmp_path / "c" / manifest["shards"][1]["file"]
    data = shard.read_bytes()
    shard.write_bytes(data[:-10])
    with pytest.raises(CacheError, match="truncated"):
        FeatureCache(tmp_path / "c")
    shard.write_bytes(data[:-1] + bytes([data[-1] ^ 0xFF]))
    cache = FeatureCache(tmp_path / "c")
    cache[0]  # shard 0 is fine
    with pytest.raises(CacheError, match="checksum"):
        cache[2]
    shard.unlink()
    with pytest.raises(CacheError, match="missing"):
        FeatureCache(tmp_path / "c")
    (tmp_path / "c" / "manifest.json").write_text("{broken")
    with pytest.raises(CacheError, match="corrupt"):
        FeatureCache(tmp_path / "c")


def test_unfinished_cache_is_refused_and_resumable(tmp_path):
    manifest = {"format_version": 1, "layer_ids": [0], "storage": "bfloat16"}
    fcache.open_for_writing(tmp_path, manifest)
    fcache.write_shard(tmp_path, 0, ["a"], [torch.tensor([1, 2])], [torch.tensor([True, True])], [torch.ones(2, 4)],
                       "bfloat16", 1)
    with pytest.raises(CacheError, match="incomplete"):
        FeatureCache(tmp_path)
    (tmp_path / ".shard-00001.safetensors.tmp").write_bytes(b"half")  # crash debris
    fcache.open_for_writing(tmp_path, manifest)
    assert not list(tmp_path.glob(".*.tmp")) and list(fcache.done_shards(tmp_path)) == [0]
    with pytest.raises(CacheError, match="missing shards \\[1\\]"):
        fcache.finalize(tmp_path, 2)


def test_resuming_with_another_configuration_is_refused(tmp_path):
    fcache.open_for_writing(tmp_path, {"format_version": 1, "layer_ids": [1, 2], "storage": "bfloat16"})
    with pytest.raises(CacheError, match=r"layer_ids: cache has \[1, 2\], this run has \[1, 3\].*features.dir"):
        fcache.open_for_writing(tmp_path, {"format_version": 1, "layer_ids": [1, 3], "storage": "bfloat16"})


# -- verified once (issue 27): stamps, shards hashed by the one rank that owns them -----------------------

def make_shards(root, num_shards=10, stamp=None):
    """A complete cache of `num_shards` shards of 2 tiny sequences each (shard k holds sequences 2k, 2k+1);
    with `stamp`, written as extraction writes it (the writer's digests recorded)."""
    g = torch.Generator().manual_seed(1)
    fcache.open_for_writing(root, {"format_version": 1, "layer_ids": [0, 1], "storage": "bfloat16"})
    for k in range(num_shards):
        lengths = (3 + k % 4, 5)
        fcache.write_shard(root, k, [f"s{2 * k}", f"s{2 * k + 1}"], [torch.randint(0, 50, (n,), generator=g) for n in lengths],
                           [torch.ones(n, dtype=torch.bool) for n in lengths], [torch.randn(n, 8, generator=g) for n in lengths],
                           "bfloat16", 2, stamp=stamp)
    return fcache.finalize(root, num_shards)


@pytest.fixture
def counters(monkeypatch):
    """Bytes hashed and shards opened for reading, per thread (a thread stands for a rank) and shard file."""
    import threading
    from collections import Counter, defaultdict

    hashed, opened = defaultdict(Counter), defaultdict(Counter)
    real_hash, real_open = fcache.file_sha256, fcache.safe_open

    def counting_hash(path):
        hashed[threading.current_thread().name][path.name] += path.stat().st_size
        return real_hash(path)

    def counting_open(path, **kw):
        opened[threading.current_thread().name][os.path.basename(path)] += 1
        return real_open(path, **kw)

    monkeypatch.setattr(fcache, "file_sha256", counting_hash)
    monkeypatch.setattr(fcache, "safe_open", counting_open)
    return hashed, opened


def start(root, world=2, read=None):
    """What every rank of a training start does with the cache, each rank a thread (barrier shared):
    FeatureCache + verify_all, then read the sequences `read(rank)`. Returns {rank: error or None}."""
    import threading

    from dflash.dist import Dist

    barrier, errors = threading.Barrier(world, timeout=60), {}

    def rank(r):
        try:
            cache = FeatureCache(root)
            cache.verify_all(Dist(r, world, barrier.wait))
            for i in (read(r) if read else []):
                cache[i]
            errors[r] = None
        except CacheError as e:
            errors[r] = str(e)

    threads = [threading.Thread(target=rank, args=(r,), name=f"rank{r}") for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return errors


def shard(k):
    return CacheLayout.shard_name(k)


def test_each_rank_hashes_only_its_shards_once_and_a_second_start_nothing(tmp_path, counters):
    hashed, opened = counters
    manifest = make_shards(tmp_path)
    sizes = {e["file"]: e["bytes"] for e in manifest["shards"]}
    assert start(tmp_path) == {0: None, 1: None}
    for r in (0, 1):  # first start: rank r hashed shards k % 2 == r, each once, nothing else
        assert dict(hashed[f"rank{r}"]) == {shard(k): sizes[shard(k)] for k in range(r, 10, 2)}
    assert not opened  # verification reads no data
    hashed.clear()
    # second start: nothing hashed; each rank opens only the shards of the sequences it reads
    reads = {0: [0, 1, 6], 1: [9, 19]}
    assert start(tmp_path, read=reads.get) == {0: None, 1: None}
    assert not hashed
    assert dict(opened["rank0"]) == {shard(0): 1, shard(3): 1} and dict(opened["rank1"]) == {shard(4): 1, shard(9): 1}
    # so does a later start with another number of processes, and a cache opened for evaluation
    assert start(tmp_path, world=3) == {0: None, 1: None, 2: None} and not hashed
    FeatureCache(tmp_path)[7]
    assert not hashed


def test_a_cache_written_with_the_writers_stamp_is_not_hashed_again(tmp_path, counters):
    hashed, _ = counters
    make_shards(tmp_path, 4, stamp=fstamp.Stamp(tmp_path, rank=0))
    written = sum(hashed["MainThread"].values())  # the writer hashed each shard once
    hashed.clear()
    assert start(tmp_path) == {0: None, 1: None} and not hashed and written > 0


@pytest.mark.parametrize("verified_before", [True, False])
def test_a_corrupt_shard_is_refused_on_every_rank_before_its_data_is_read(tmp_path, counters, verified_before):
    """Bytes flipped after extraction (size kept, even the mtime set back) stop every rank at verify_all
    with the shard's name and the fix; its owner alone hashes it; nothing is deleted."""
    hashed, opened = counters
    make_shards(tmp_path, 6, stamp=fstamp.Stamp(tmp_path) if verified_before else None)
    if verified_before:
        assert start(tmp_path) == {0: None, 1: None}
    hashed.clear()
    path = tmp_path / shard(3)
    before = path.stat()
    time.sleep(0.02)  # past the file system's timestamp granularity (a few ms)
    data = bytearray(path.read_bytes())
    data[-5] ^= 0xFF
    path.write_bytes(bytes(data))
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    errors = start(tmp_path, read=lambda r: range(12))
    for r in (0, 1):
        assert f"shard {path} does not match its checksum" in errors[r], errors[r]
        assert "re-extracts only that shard" in errors[r]
    owned = {r: {shard(k) for k in range(r, 6, 2)} for r in (0, 1)}
    assert set(hashed) <= {"rank0", "rank1"} and set(hashed["rank1"]) == ({shard(3)} if verified_before else owned[1])
    assert set(hashed["rank0"]) == (set() if verified_before else owned[0])
    assert not opened and path.exists() and path.with_suffix(".json").exists()


def test_several_corrupt_shards_are_named_together(tmp_path):
    make_shards(tmp_path, 4)
    for k in (1, 2):
        path = tmp_path / shard(k)
        data = path.read_bytes()
        path.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))
    errors = start(tmp_path)
    for r in (0, 1):
        assert f"2 shards of {tmp_path}" in errors[r] and f"{shard(1)}, {shard(2)}" in errors[r], errors[r]


def test_without_a_writable_stamp_every_rank_verifies_what_nobody_vouched_for(tmp_path, counters, monkeypatch,
                                                                                 caplog):
    """A read-only cache folder: no stamp is saved, so each rank also hashes the others' shards (it cannot
    know what they found), and warns; a corrupt shard is still refused on every rank."""
    hashed, _ = counters
    make_shards(tmp_path, 4)
    real_write = fstamp.write_json

    def read_only(path, obj, **kw):
        if "verified" in str(path):
            raise PermissionError(13, "Read-only file system", str(path))
        return real_write(path, obj, **kw)

    monkeypatch.setattr(fstamp, "write_json", read_only)
    with caplog.at_level("WARNING"):
        assert start(tmp_path) == {0: None, 1: None}
    assert "is " in caplog.text and "writable and shared" in caplog.text and "could not record" in caplog.text
    for r in (0, 1):
        assert set(hashed[f"rank{r}"]) == {shard(k) for k in range(4)}
    path = tmp_path / shard(2)
    data = path.read_bytes()
    path.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))
    errors = start(tmp_path)
    assert all(f"shard {path} does not match its checksum" in errors[r] for r in (0, 1)), errors


TWO_RANKS = """
import json, os, sys
from collections import Counter

from dflash import dist as dist_mod
from dflash.data import cache as fcache
from dflash.errors import CacheError
from dflash.train.batches import CachedSource, Schedule

root, out = sys.argv[1], sys.argv[2]
dist = dist_mod.current()
hashed, opened, phase = Counter(), Counter(), ["verify"]
real_hash, real_open = fcache.file_sha256, fcache.safe_open
def counting_hash(path):
    hashed[phase[0] + ":" + path.name] += path.stat().st_size
    return real_hash(path)
def counting_open(path, **kw):
    opened[os.path.basename(path)] += 1
    return real_open(path, **kw)
fcache.file_sha256, fcache.safe_open = counting_hash, counting_open
result = {"rank": dist.rank, "world": dist.world, "error": None}
try:
    cache = fcache.FeatureCache(root)
    cache.verify_all(dist)
    phase[0] = "read"
    schedule = Schedule(len(cache), batch_size=2, world=dist.world, grad_accum=2, seed=0)
    index = [i for step in range(3) for micro in range(2) for i in schedule.micro_batch(step, micro, dist.rank)[1]]
    source = CachedSource(cache)
    for i in index:
        source[i]
    result["index"] = index
except CacheError as e:
    result["error"] = str(e)
result.update(hashed=dict(hashed), opened=dict(opened))
with open(os.path.join(out, f"rank{dist.rank}.json"), "w") as f:
    json.dump(result, f)
dist_mod.finish()  # the group ended before exit, as the entry points end it
"""


def launch_two(tmp_path, root, name):
    """TWO_RANKS in 2 gloo processes (accelerate launch); {rank: its result}."""
    script, out = tmp_path / "two_ranks.py", tmp_path / name
    script.write_text(TWO_RANKS)
    out.mkdir()
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
           "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no", str(script), str(root), str(out)]
    env = {**os.environ, "ACCELERATE_USE_CPU": "1", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    r = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600, check=False)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return {rank: json.loads((out / f"rank{rank}.json").read_text()) for rank in (0, 1)}


@pytest.mark.slow
def test_two_processes_hash_each_shard_once_then_nothing_and_refuse_a_corrupt_one(tmp_path):
    root = tmp_path / "features"
    manifest = make_shards(root, 12)
    sizes = {e["file"]: e["bytes"] for e in manifest["shards"]}
    first = launch_two(tmp_path, root, "first")
    for r in (0, 1):  # each process hashed its own shards, once, and nothing while reading
        assert first[r]["world"] == 2 and first[r]["error"] is None
        assert first[r]["hashed"] == {f"verify:{shard(k)}": sizes[shard(k)] for k in range(r, 12, 2)}
    second = launch_two(tmp_path, root, "second")
    for r in (0, 1):  # a second start hashes nothing; each process opens the shards of its own sequences only
        assert second[r]["error"] is None and second[r]["hashed"] == {}
        assert set(second[r]["opened"]) == {shard(i // 2) for i in second[r]["index"]}
    assert not set(second[0]["index"]) & set(second[1]["index"])
    path = root / shard(4)
    data = path.read_bytes()
    path.write_bytes(data[:-3] + bytes([data[-3] ^ 0x10]) + data[-2:])
    third = launch_two(tmp_path, root, "third")
    for r in (0, 1):
        assert f"shard {path} does not match its checksum" in third[r]["error"] and third[r]["opened"] == {}
    assert third[0]["hashed"] == {f"verify:{shard(4)}": sizes[shard(4)]} and third[1]["hashed"] == {}
