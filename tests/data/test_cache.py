import json

import pytest
import torch

from dflash.data import cache as fcache
from dflash.data.cache import FeatureCache
from dflash.errors import CacheError


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
