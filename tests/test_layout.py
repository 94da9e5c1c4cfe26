"""The on-disk layouts of dflash.layout: run folders, checkpoints, feature caches (paths only)."""

from pathlib import Path

from dflash.layout import CacheLayout, CheckpointLayout, RunLayout, step_name


def test_run_paths():
    run = RunLayout(Path("/r/runs/my-run"))
    assert run.name == "my-run"
    assert (run.config, run.info, run.metrics, run.log) == (
        Path("/r/runs/my-run/config.yaml"), Path("/r/runs/my-run/run.json"), Path("/r/runs/my-run/metrics.jsonl"),
        Path("/r/runs/my-run/train.log"))
    assert run.checkpoints == Path("/r/runs/my-run/checkpoints")
    assert run.best == Path("/r/runs/my-run/checkpoints/best.json")
    assert run.eval_dir("step-020000") == Path("/r/runs/my-run/eval/step-020000")
    assert run.eval_dir("step-020000-live") == Path("/r/runs/my-run/eval/step-020000-live")


def test_step_folders_are_zero_padded_to_six_digits():
    assert step_name(20) == "step-000020" and step_name(1234567) == "step-1234567"
    ckpt = RunLayout(Path("/r/run")).checkpoint(20)
    assert ckpt == CheckpointLayout(Path("/r/run/checkpoints/step-000020"))


def test_checkpoint_paths_and_files():
    ckpt = CheckpointLayout(Path("/c/step-000020"))
    assert (ckpt.config, ckpt.weights) == (Path("/c/step-000020/config.json"), Path("/c/step-000020/model.safetensors"))
    assert ckpt.train_state == Path("/c/step-000020/train_state")
    assert ckpt.state == ckpt.state_file("state.json") == Path("/c/step-000020/train_state/state.json")
    assert ckpt.manifest == Path("/c/step-000020/train_state/manifest.json")
    assert ckpt.files() == {"config.json", "model.safetensors", "modeling_dflash.py", "dflash2.py", "attention.py",
                            "train_state/state.json", "train_state/weights_fp32.safetensors",
                            "train_state/manifest.json",
                            "train_state/optimizer.bin", "train_state/scheduler.bin", "train_state/random_states_0.pkl"}
    assert ckpt.files(with_manifest=False) == ckpt.files() - {"train_state/manifest.json"}
    # one RNG file per process; under FSDP also accelerate's gathered model
    assert ckpt.files(world_size=2, fsdp=True) - ckpt.files() == {"train_state/random_states_1.pkl",
                                                                  "train_state/pytorch_model_fsdp.bin"}
    assert ckpt.format1_files() == {"config.json", "model.safetensors", "train_state/optimizer.pt",
                                    "train_state/scheduler.pt", "train_state/rng.pt", "train_state/state.json"}


def test_train_state_names_are_the_ones_accelerate_writes():
    from accelerate.utils.constants import FSDP_MODEL_NAME, OPTIMIZER_NAME, RNG_STATE_NAME, SCHEDULER_NAME

    assert CheckpointLayout.ACCELERATE_FILES == (f"{OPTIMIZER_NAME}.bin", f"{SCHEDULER_NAME}.bin")
    assert CheckpointLayout.FSDP_FILES == (f"{FSDP_MODEL_NAME}.bin",)
    assert CheckpointLayout.rng_file(3) == f"{RNG_STATE_NAME}_3.pkl"


def test_list_checkpoints_finds_step_folders_only_oldest_first(tmp_path):
    run = RunLayout(tmp_path / "run")
    assert run.list_checkpoints() == []  # no checkpoints/ yet
    for name in ("step-000020", "step-000003", "step-1000000", "step-abc", "step-000010-old", ".tmp-step-000030",
                 "best", "other"):
        (run.checkpoints / name).mkdir(parents=True)
    (run.checkpoints / "step-000040").write_text("a file, not a checkpoint folder")
    run.best.write_text("{}")
    assert run.list_checkpoints() == [(3, run.checkpoints / "step-000003"), (20, run.checkpoints / "step-000020"),
                                      (1000000, run.checkpoints / "step-1000000")]


def test_of_checkpoint_is_the_run_holding_it(tmp_path):
    run = RunLayout(tmp_path / "runs" / "a")
    ckpt = run.checkpoint(8)
    ckpt.path.mkdir(parents=True)
    assert RunLayout.of_checkpoint(ckpt.path) == RunLayout(run.path.resolve())
    assert RunLayout.of_checkpoint(run.checkpoints / ".." / "checkpoints" / "step-000008").path == run.path.resolve()
    assert not RunLayout.of_checkpoint(ckpt.path).is_run()
    run.info.write_text("{}")
    assert RunLayout.of_checkpoint(ckpt.path).is_run()


def test_eval_summaries_are_the_step_evaluations(tmp_path):
    run = RunLayout(tmp_path)
    for name in ("step-000040", "step-000000", "step-000040-live", "zlab-drafter", "step-000080"):
        run.eval_dir(name).mkdir(parents=True)
        if name != "step-000080":  # an evaluation that did not finish
            (run.eval_dir(name) / "summary.json").write_text("{}")
    assert run.eval_summaries() == [run.eval_dir(n) / "summary.json"
                                    for n in ("step-000000", "step-000040", "step-000040-live")]


def test_step_evaluations_are_the_runs_own_settings_by_step(tmp_path):
    """eval/step-<digits> only, by step: not evaluate.py's at other settings (-t1, -t0.6-unary, -2prompts, -2) nor
    live ones, nor an earlier evaluation kept aside under a dated name."""
    run = RunLayout(tmp_path)
    for name in ("step-000768", "step-000000", "step-000768-t1", "step-000768-t0.6-unary", "step-000768-live",
                 "step-000768-2prompts", "step-000768-2", "step-000768.20261206-101500"):
        run.eval_dir(name).mkdir(parents=True)
        (run.eval_dir(name) / "summary.json").write_text("{}")
    assert run.step_evaluations() == [(0, run.eval_dir("step-000000") / "summary.json"),
                                      (768, run.eval_dir("step-000768") / "summary.json")]


def test_cache_paths():
    cache = CacheLayout(Path("/w/cache/tiny_qwen3/tiny/features"))
    assert cache.manifest == Path("/w/cache/tiny_qwen3/tiny/features/manifest.json")
    assert cache.shard(3) == Path("/w/cache/tiny_qwen3/tiny/features/shard-00003.safetensors")
    assert CacheLayout.shard_name(3) == "shard-00003.safetensors"
    assert cache.sidecar(3) == Path("/w/cache/tiny_qwen3/tiny/features/shard-00003.json")
    assert cache.target_root == Path("/w/cache/tiny_qwen3")


def test_sidecars_are_sorted_and_skip_other_files(tmp_path):
    cache = CacheLayout(tmp_path)
    for k in (2, 0, 1):
        cache.shard(k).write_bytes(b"")
        cache.sidecar(k).write_text("{}")
    cache.manifest.write_text("{}")
    assert cache.sidecars() == [cache.sidecar(k) for k in range(3)]
