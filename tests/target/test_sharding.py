"""A target sharded over processes: the shared-forward protocol, the refusals, and (several processes, gloo on a
CPU) tensor-parallel features, extraction and online training against one unsharded process."""

import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from dflash.errors import ConfigError
from dflash.target import sharding
from dflash.target.sharding import TensorParallel, check_shardable, drain, shared
from tests.conftest import REPO

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "WANDB_MODE": "disabled", "ACCELERATE_USE_CPU": "1"}
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2"]


class ScriptedGroup(TensorParallel):
    """A group of `size` in one process: the other members' gathered calls come from a script, one list per
    gather (this process's own entry is whatever it gathers)."""

    def __init__(self, size: int, index: int, script: list[list]):
        super().__init__(group=None, size=size, index=index)
        self.script, self.seen = list(script), []

    def gather(self, obj):
        others = self.script.pop(0)
        self.seen.append(obj)
        return others[: self.index] + [obj] + others[self.index:]


def record(target, x):
    target.log.append(x)
    return x * 10


def test_every_process_runs_every_call_of_its_group_in_order_and_keeps_its_own():
    """Process 1 of 3: each gather runs the calls of processes 0, 1, 2 in that order (None: that process is done),
    `shared` returns process 1's result only, and `drain` serves the others until every one gathers None."""
    target = SimpleNamespace(log=[])
    target.tp = ScriptedGroup(3, 1, [[(record, (1,)), (record, (3,))],   # first shared call: 0 and 2 have calls
                                     [None, (record, (5,))],              # second: only 2 still has work
                                     [None, (record, (7,))],              # draining: 2's last call
                                     [None, None]])                       # all done
    assert shared(target, record, 2) == 20
    assert shared(target, record, 4) == 40
    drain(target)
    assert target.log == [1, 2, 3, 4, 5, 7] and target.tp.seen[2:] == [None, None] and not target.tp.script
    target.tp = None  # unsharded: just the call
    assert shared(target, record, 9) == 90 and target.log[-1] == 9


def text_config(**kw):
    base = dict(model_type="qwen3", base_model_tp_plan={"layers.*.self_attn.q_proj": "colwise"},
                num_attention_heads=8, num_key_value_heads=4, intermediate_size=256)
    return SimpleNamespace(**{**base, **kw})


def test_a_size_that_does_not_split_the_target_or_a_family_without_a_plan_is_refused_in_one_line():
    check_shardable("t", text_config(), 4)
    with pytest.raises(ConfigError, match=r"^target.tensor_parallel=8 does not divide t's num_key_value_heads=4; "
                                          r"use a size that divides them"):
        check_shardable("t", text_config(), 8)
    with pytest.raises(ConfigError, match=r"cannot shard t \(mamba\): transformers has no tensor-parallel plan for "
                                          r"it; place its layers .* \(target.device_map=auto\)"):
        check_shardable("t", text_config(model_type="mamba", base_model_tp_plan=None), 2)
    with pytest.raises(ConfigError, match=r"cannot shard g \(gemma4_text\): the plan splits"):
        check_shardable("g", text_config(model_type="gemma4_text"), 2)


def test_tensor_parallel_without_a_launcher_is_refused_naming_torchrun():
    with pytest.raises(ConfigError, match=r"target.tensor_parallel=2 shards the target over 2 processes started "
                                          r"together: launch with torchrun --nproc-per-node 2"):
        sharding.tensor_parallel_group(2)


def run(cmd: list, cwd) -> str:
    """The command's stdout, after it succeeded."""
    r = subprocess.run(cmd, cwd=cwd, env=ENV, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return r.stdout


@pytest.mark.slow
def test_tensor_parallel_features_equal_the_unsharded_targets(tiny_targets, tmp_path):
    """TP = 2 over two processes (gloo) for an attention, a hybrid and an MoE target (its experts split too): every
    feature and top-k log-probability within 1e-5 of the same target loaded whole, with shares of unequal size
    (one process drains while the other still extracts), each process holding the parameters the plan counts for it
    (dflash.target.sharding.sharded_parameters); Gemma 4's plan is refused in one line."""
    out = run(TORCHRUN + ["-m", "tests.target.tp_probe", "tiny_qwen3", "tiny_qwen3_5", "tiny_qwen3_moe", "tiny_gemma"],
              REPO)
    ranks = json.loads(out.strip().splitlines()[-1])
    for per_rank in ranks:
        for name in ("tiny_qwen3", "tiny_qwen3_5", "tiny_qwen3_moe"):
            got = per_rank[name]
            assert got["features"] < 1e-5 and got["topk_logprobs"] < 1e-5, (name, got)
            assert got["sharding"]["tensor_parallel"] == 2
            assert got["parameters"] == got["planned"], (name, got)  # dflash.plan counts what a process holds
        assert per_rank["tiny_qwen3_moe"]["sharding"]["expert_parallel"] == 2
        assert per_rank["tiny_qwen3"]["sharding"]["expert_parallel"] == 1
        refused = per_rank["tiny_gemma"]["refused"]
        assert "\n" not in refused and "target.device_map=auto" in refused


@pytest.mark.slow
def test_torchrun_extraction_with_tensor_parallel_writes_the_one_process_cache(tiny_targets, tmp_path):
    """`torchrun --nproc-per-node 2 extract.py ... target.tensor_parallel=2`: the completions (generated by the
    group together) and every feature (float32 storage) equal one process's, within 1e-5; the manifest records
    the sharding and, the family being exact, no layout that would keep the two caches apart."""
    from dflash.data.cache import FeatureCache

    common = ["target=tiny_qwen3", "data=tiny", "data.completions.max_new_tokens=24", "features.storage=float32",
              "features.shard_sequences=3"]
    run(TORCHRUN + [str(REPO / "extract.py"), *common, "target.tensor_parallel=2", f"features.dir={tmp_path}/tp/f",
                    f"data.completions.path={tmp_path}/tp/completions.jsonl"], tmp_path)
    run([sys.executable, str(REPO / "extract.py"), *common, f"features.dir={tmp_path}/one/f",
         f"data.completions.path={tmp_path}/one/completions.jsonl"], tmp_path)
    completions = [{r["id"]: r["completion_ids"] for r in map(json.loads, (tmp_path / k / "completions.jsonl").open())}
                   for k in ("tp", "one")]
    assert completions[0] == completions[1]
    tp, one = (FeatureCache(tmp_path / k / "f", dtype=torch.float32) for k in ("tp", "one"))
    assert tp.ids == one.ids and len(one) == 16 and len(tp.manifest["shards"]) == 6
    for i in range(len(one)):
        (a_ids, a_mask, a), (b_ids, b_mask, b) = tp[i], one[i]
        assert torch.equal(a_ids, b_ids) and torch.equal(a_mask, b_mask) and (a - b).abs().max() < 1e-5
    assert tp.manifest["sharding"] == {"tensor_parallel": 2, "expert_parallel": 1, "device_map": None}
    assert "layout" not in tp.manifest and "layout" not in one.manifest


@pytest.mark.slow
def test_online_training_with_tensor_parallel_equals_one_process_at_the_same_global_batch(tiny_targets, tmp_path):
    """Two processes, one tensor-parallel group computing both processes' features, the drafter data-parallel over
    both (batch 1 each), against one unsharded process of batch 2: the same losses (1e-5) and final weights."""
    from safetensors.torch import load_file

    from tests.train.test_distributed import launch, losses

    common = ["debug=tiny", "target=tiny_qwen3", "train.mode=online", "eval.ddtree_budgets=[4]", "train.max_steps=4",
              "train.save_every=100", f"data.completions.path={tmp_path}/completions.jsonl"]
    launch(tmp_path, 1, "train.batch_size=2", "train.grad_accum=2", "run.name=one", common=common)
    launch(tmp_path, 2, "train.batch_size=1", "train.grad_accum=2", "run.name=tp", "target.tensor_parallel=2",
           common=common)
    one, tp = tmp_path / "runs/one", tmp_path / "runs/tp"
    a, b = losses(one), losses(tp)
    assert len(a) == len(b) == 4 and max(abs(x - y) for x, y in zip(a, b)) < 1e-5, (a, b)
    wa, wb = (load_file(r / "checkpoints/step-000004/train_state/weights_fp32.safetensors") for r in (one, tp))
    assert max((wa[k] - wb[k]).abs().max().item() for k in wa) < 1e-5
    manifest = json.loads((tp / "checkpoints/step-000004/train_state/manifest.json").read_text())
    assert manifest["sharding"]["tensor_parallel"] == 2


def test_layers_placed_by_accelerate_give_the_targets_features(tiny_targets):
    """target.device_map=auto loads through accelerate's placement (on this CPU every layer lands on the CPU: the
    path a target bigger than one GPU takes) and computes the features of the target loaded on one device."""
    from dataclasses import replace

    from dflash.target.features import target_forward
    from dflash.target.loading import load_target
    from tests.conftest import compose

    cfg = compose("extract", ["target=tiny_qwen3_5"]).target
    placed = load_target(replace(cfg, device_map="auto"), torch.device("cpu"))
    assert placed.sharding == {"tensor_parallel": 1, "expert_parallel": 1, "device_map": "auto"}
    assert {p.device.type for p in placed.model.parameters()} == {"cpu"}
    ids = torch.randint(0, 250, (2, 20), generator=torch.Generator().manual_seed(0))
    a = target_forward(placed, ids, [1, 4, 6]).features
    b = target_forward(tiny_targets["tiny_qwen3_5"], ids, [1, 4, 6]).features
    assert torch.equal(a, b)
    with pytest.raises(ConfigError, match=r"target.tensor_parallel=2 and target.device_map=auto both lay the target "
                                          r"out; choose one"):
        replace(cfg, tensor_parallel=2, device_map="auto")


def test_features_of_a_family_not_verified_under_tensor_parallelism_are_kept_apart():
    """A manifest records the sharding; a family whose tensor-parallel features the tests do not hold equal gets a
    guarded `layout`, so its features are refused beside unsharded ones (provenance.allow_mismatch=[layout] to mix
    them knowingly); a verified family's mix freely."""
    from dflash.errors import ProvenanceError
    from dflash.provenance import check_provenance, layout

    def fake(family, size):
        return SimpleNamespace(config=SimpleNamespace(model_type=family),
                               sharding={"tensor_parallel": size, "expert_parallel": 1, "device_map": None})

    assert layout(fake("qwen3", 2)) is None and layout(fake("mamba", 1)) is None
    kept = layout(fake("mamba", 2))
    assert kept.startswith("tensor_parallel=2 (mamba")
    with pytest.raises(ProvenanceError, match=r"layout: .* in the checkpoint, tensor_parallel=2 \(mamba"):
        check_provenance({"layout": None}, {"layout": kept})
    assert check_provenance({}, {"layout": kept}, ["layout"]) == ["layout"]
