import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from dflash.data.cache import FeatureCache
from dflash.data.extraction import extract_training
from dflash.dist import Dist
from dflash.errors import ProvenanceError
from dflash.provenance import check_provenance
from dflash.target.features import target_forward
from tests.conftest import REPO, compose

MANIFEST_FIELDS = {"target", "target_path", "tokenizer", "layer_ids", "dtype", "storage", "kernel_backend", "kernels",
                   "versions", "device", "data", "max_length", "created", "shards", "complete"}


@pytest.fixture(scope="module")
def extracted(tmp_path_factory, tiny_targets):
    root = tmp_path_factory.mktemp("extract")
    job = compose("extract", ["target=tiny_qwen3_5", "data=tiny", "data.completions.max_new_tokens=24",
                              f"features.dir={root}/features", "features.shard_sequences=5",
                              "features.batch_tokens=300"])  # float32: the target's dtype
    manifest = extract_training(job, tiny_targets["tiny_qwen3_5"], Dist())
    return job, manifest, tiny_targets["tiny_qwen3_5"]


def test_manifest_records_provenance(extracted):
    job, manifest, target = extracted
    assert MANIFEST_FIELDS <= set(manifest) and manifest["complete"]
    assert manifest["layer_ids"] == [1, 2, 3, 4, 5] and manifest["dtype"] == "float32"
    assert "linear_attention=torch_fallback" in manifest["kernel_backend"]
    assert manifest["target"]["weights_fingerprint"] == target.fingerprint != "unknown"
    assert manifest["data"]["num_sequences"] == 16 and len(manifest["shards"]) == 4
    assert all(len(s["sha256"]) == 64 for s in manifest["shards"])


def test_cached_features_equal_the_target_forward(extracted):
    job, manifest, target = extracted
    cache = FeatureCache(job.features.dir, dtype=torch.float32)
    for i in (0, 7, 15):
        ids, mask, feats = cache[i]
        ref = target_forward(target, ids[None], manifest["layer_ids"]).features[0]
        assert (feats - ref).abs().max() < 1e-5  # padded batches vs one sequence: same up to float noise
        assert mask.any() and not mask[0] and mask[-1]


def test_prompts_longer_than_max_length_are_skipped_and_counted(tmp_path, tiny_targets):
    job = compose("extract", ["target=tiny_qwen3", "data=tiny", "data.max_length=60", "data.limit=6",
                              "data.completions.max_new_tokens=8", f"features.dir={tmp_path}/f"])
    manifest = extract_training(job, tiny_targets["tiny_qwen3"], Dist())
    skipped = manifest["data"]["skipped"]["prompt_too_long"]
    assert skipped > 0 and manifest["data"]["num_sequences"] == 6 - skipped


def test_other_backend_is_refused_with_field_values_and_override(extracted):
    _, manifest, _ = extracted
    other = {**manifest, "kernel_backend": "causal_conv1d=causal_conv1d,full_attention=sdpa,linear_attention=fla"}
    with pytest.raises(ProvenanceError) as e:
        check_provenance(other, manifest, expected_name="the checkpoint")
    text = str(e.value)
    assert "kernel_backend" in text and "linear_attention=fla" in text and "linear_attention=torch_fallback" in text
    assert "provenance.allow_mismatch=[kernel_backend]" in text
    assert check_provenance(other, manifest, ["kernel_backend"]) == ["kernel_backend"]


def run_extract(cwd, *overrides, env=None):
    return subprocess.Popen([sys.executable, str(REPO / "extract.py"), *overrides], cwd=cwd,
                            env={**os.environ, **(env or {})}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)


@pytest.mark.slow
def test_killed_extraction_resumes_to_an_identical_cache(tmp_path, dflash_home):
    common = ["target=tiny_qwen3_5", "data=tiny", "data.completions.max_new_tokens=24", "features.shard_sequences=2",
              f"data.completions.path={tmp_path}/completions.jsonl"]
    assert run_extract(tmp_path, *common, f"features.dir={tmp_path}/ref").wait(300) == 0
    proc = run_extract(tmp_path, *common, f"features.dir={tmp_path}/killed")
    deadline = time.time() + 300
    while not (tmp_path / "killed" / "shard-00002.json").exists():
        assert time.time() < deadline and proc.poll() is None, proc.stdout.read()
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert not (tmp_path / "killed" / "shard-00007.json").exists()
    resumed = run_extract(tmp_path, *common, f"features.dir={tmp_path}/killed")
    out = resumed.communicate(timeout=300)[0]
    assert resumed.returncode == 0 and "already written; resuming" in out
    ref = json.loads((tmp_path / "ref" / "manifest.json").read_text())
    got = json.loads((tmp_path / "killed" / "manifest.json").read_text())
    assert [s["sha256"] for s in ref["shards"]] == [s["sha256"] for s in got["shards"]]
    for f in ("target", "tokenizer", "layer_ids", "kernel_backend", "data", "storage"):
        assert ref[f] == got[f]


def test_a_cache_just_extracted_is_not_hashed_again(extracted, monkeypatch):
    """The writers' digests are stamped (issue 27): training right after extraction hashes no shard."""
    from dflash.data import cache as fcache

    job, manifest, _ = extracted
    hashed = []
    monkeypatch.setattr(fcache, "file_sha256", lambda path: hashed.append(path.name))
    cache = FeatureCache(job.features.dir, dtype=torch.float32)
    cache.verify_all()
    assert hashed == [] and cache.hashed_bytes == 0 and len(manifest["shards"]) == 4


def small_extract(tmp_path, *overrides):
    return compose("extract", ["target=tiny_qwen3", "data=tiny", "data.limit=3", "data.completions.max_new_tokens=8",
                               "features.shard_sequences=2", f"data.completions.path={tmp_path}/completions.jsonl",
                               *overrides])


@pytest.fixture(scope="module")
def bf16_target(tiny_targets):
    """tiny_qwen3 loaded in bfloat16 (the folder tiny_targets built)."""
    from dflash.target import load_target

    return load_target(compose("train", ["target=tiny_qwen3", "target.dtype=bfloat16"]).target, torch.device("cpu"))


def test_features_are_stored_in_the_targets_dtype_by_default(tmp_path, tiny_targets, bf16_target, caplog):
    """features.storage=auto (issue 66, item 6): a float32 target's cache holds its float32 features exactly, as the
    held-out set and live decoding see them; a bfloat16 target's holds bfloat16, which is all it computes. The
    config keeps auto: the storage is resolved where the cache is made."""
    from safetensors import safe_open

    for target, dtype in ((tiny_targets["tiny_qwen3"], torch.float32), (bf16_target, torch.bfloat16)):
        name = str(dtype).removeprefix("torch.")
        job = small_extract(tmp_path / name, f"features.dir={tmp_path}/{name}/features")
        manifest = extract_training(job, target, Dist())
        assert job.features.storage == "auto"
        assert (manifest["storage"], manifest["dtype"], manifest["storage_exact"]) == (name, name, True)
        with safe_open(str(tmp_path / name / "features" / manifest["shards"][0]["file"]), "pt") as f:
            assert f.get_slice("features").get_dtype() == {"float32": "F32", "bfloat16": "BF16"}[name]
        cache = FeatureCache(job.features.dir, dtype=torch.float32)
        ids, _, feats = cache[0]
        ref = target_forward(target, ids[None], manifest["layer_ids"]).features[0].float()
        assert (feats - ref).abs().max() < (1e-5 if dtype == torch.float32 else 0.05)  # batched vs alone
    assert "rounded" not in caplog.text


def test_a_storage_coarser_than_the_target_is_kept_and_said_once(tmp_path, tiny_targets, caplog):
    """An explicit features.storage=bfloat16 for a float32 target saves disk; extraction says in one line that the
    drafter trains on rounded features, and the manifest records it (storage_exact false)."""
    job = small_extract(tmp_path, f"features.dir={tmp_path}/features", "features.storage=bfloat16")
    with caplog.at_level("WARNING"):
        manifest = extract_training(job, tiny_targets["tiny_qwen3"], Dist())
    lines = [r.getMessage() for r in caplog.records if "rounded features" in r.getMessage()]
    assert len(lines) == 1 and "\n" not in lines[0]
    assert "float32 target's features are stored in bfloat16" in lines[0] and "features.storage=auto" in lines[0]
    assert (manifest["storage"], manifest["dtype"], manifest["storage_exact"]) == ("bfloat16", "float32", False)


def test_a_cache_made_under_the_old_bfloat16_default_is_resumed_and_reused_under_auto(tmp_path, tiny_targets):
    """A float32 target's cache made before auto (bfloat16, no storage_exact) is finished and reused as it is when
    features.storage is left at auto, never refused or extracted again; an explicit other storage is refused in one
    line naming storage."""
    from dflash.errors import CacheError
    from dflash.io import read_json, write_json

    target, root = tiny_targets["tiny_qwen3"], tmp_path / "features"
    old = small_extract(tmp_path, f"features.dir={root}", "features.storage=bfloat16")
    made = extract_training(old, target, Dist())
    digests = [s["sha256"] for s in made["shards"]]
    # as the former default left it: storage bfloat16, no storage_exact, the last shard not yet written
    manifest = {k: v for k, v in read_json(root / "manifest.json").items() if k not in ("storage_exact", "shards")}
    write_json(root / "manifest.json", {**manifest, "complete": False})
    (root / made["shards"][-1]["file"]).unlink()
    (root / made["shards"][-1]["file"]).with_suffix(".json").unlink()
    now = small_extract(tmp_path, f"features.dir={root}")  # features.storage left at auto
    resumed = extract_training(now, target, Dist())
    assert resumed["complete"] and resumed["storage"] == "bfloat16"
    assert [s["sha256"] for s in resumed["shards"]] == digests  # finished in bfloat16, as begun
    assert extract_training(now, target, Dist())["storage"] == "bfloat16"  # complete: reused as it is
    with pytest.raises(CacheError, match=r'storage: cache has "bfloat16", this run has "float32"'):
        extract_training(small_extract(tmp_path, f"features.dir={root}", "features.storage=float32"), target, Dist())
