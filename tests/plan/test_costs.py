"""dflash.plan.costs: the feature cache on disk, host memory of loading, GPU-hours, and the set-up the plan
recommends, which the experiment presets follow."""

import json
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import yaml

from dflash.config.plan import PlanConfig
from dflash.plan import costs
from dflash.plan.compose import compose
from dflash.plan.configured import RESULTS, checkpointing_of, composed_checkpointing, mfu_of, sequence_flops
from dflash.plan.costs import Run
from dflash.plan.flops import train_flops
from dflash.plan.memory import GiB, max_anchors
from dflash.plan.report import build, main, make_plan, make_run
from tests.conftest import REPO

PAPER = PlanConfig(mfu=0.35)  # the paper's data size, a stated MFU
# the Qwen3.6-27B preset at the paper's 3072 tokens, the whole target on each GPU, checkpointed: what the figures
# below were worked out for (the preset trains at 32768 tokens, its target sharded over pairs of GPUs)
Q36_RECIPE = ["experiment=qwen3_6_27b", "data.max_length=3072", "target.tensor_parallel=1",
              "train.gradient_checkpointing=full"]


@pytest.mark.parametrize("storage", ["bfloat16", "float8_e4m3fn", "float32"])
def test_cache_bytes_a_token_are_those_of_a_written_shard(tmp_path, storage):
    """write_shard's file, less its header and offsets, is the plan's bytes a token times the tokens."""
    from dflash.data.cache import write_shard

    n, H, lengths = 5, 64, [100, 37, 250]
    write_shard(tmp_path, 0, [str(i) for i in range(3)], [torch.arange(t) for t in lengths],
                [torch.ones(t, dtype=torch.bool) for t in lengths], [torch.randn(t, n * H) for t in lengths],
                storage, n)
    size = next(tmp_path.glob("shard-*.safetensors")).stat().st_size
    per_token = costs.cache_bytes_per_token(SimpleNamespace(target_layers=n, hidden=H), storage)
    assert 0 < size - sum(lengths) * per_token < 2048  # the JSON header and 4 int64 offsets



def measured(folder, experiment=None):
    """costs.measured_mfu as the plan reads bench/results (configured.mfu_of), of `folder`."""
    return costs.measured_mfu(folder, experiment, composed_checkpointing, "bench/results")


def hours(drafter, s, u, run):
    """costs.gpu_hours of the run's sequences as the plan counts them (configured.sequence_flops)."""
    return costs.gpu_hours(sequence_flops(drafter, s, run.tokens_per_sequence, u.num_anchors), s, u, run)

def test_the_27b_cache_and_loading_figures():
    """5 x 5120 values a token: 51.2 GB per million tokens in bf16, 25.6 in fp8, 61 TB for the paper's
    ~800K sequences of ~1500 tokens. Loading the target online holds at most the loader's 4 tensors in
    flight on the host (embed_tokens, lm_head and two MLP matrices: 5.1 GiB); the page cache holds up to
    the 50.1 GiB checkpoint, once a node."""
    job = compose(Q36_RECIPE)
    drafter, s, u = build(job, world=8)
    out = make_plan(s, u, [80, 141], drafter, make_run(job, PAPER))
    r = out["run"]
    assert (r["sequences"], r["tokens_per_sequence"]) == (800_000, 1500) and "paper" in r["sequences_where"]
    assert r["cache_gb_per_million_tokens"] == {"bfloat16": 51.205, "float8_e4m3fn": 25.625}
    assert round(r["cache_tb"], 1) == 61.4
    assert s.target_largest == (248320 * 5120, 248320 * 5120, 17408 * 5120, 17408 * 5120)
    load = r["loading_gib"]
    assert load["process"] == sum(s.target_largest) * 2 / GiB and 5.0 < load["process"] < 5.2
    assert round(load["page cache (shared by a node)"], 1) == 50.1
    assert load["heads only (offline training)"] == s.heads_params * 2 / GiB


@pytest.mark.slow
def test_the_loading_bound_holds_a_measured_load(tmp_path):
    """tests/target/load_probe.py's measured process memory of loading a target (float32 file, bf16 on the
    device) stays within the plan's bound: the loader threads' largest tensors in target.dtype."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from tests.target.load_probe import measure, write_target

    write_target(tmp_path, hidden=512, layers=8, vocab=16000)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(tmp_path))
    sizes = sorted((p.numel() for p in model.parameters()), reverse=True)
    bound = costs.loading_bytes(SimpleNamespace(target_largest=tuple(sizes[:costs.LOADER_THREADS]),
                                                target_params=sum(sizes), heads_params=0), 2)["process"]
    assert measure(tmp_path, "meta", "bfloat16")["peak_anon"] <= bound


def spread_blocks(tokens: int, anchors: int, block_size: int = 16):
    """One sequence of `tokens` response tokens with `anchors` blocks spread evenly, as the plan assumes."""
    from dflash.drafter.blocks import pack_blocks

    ids = torch.zeros(1, tokens, dtype=torch.long)
    return pack_blocks(ids, torch.ones(1, tokens, dtype=torch.bool), torch.tensor([tokens]),
                       [torch.linspace(0, tokens - 2, anchors).round().long()], block_size, 0)


def test_gpu_hours_are_tokens_times_flops_at_the_mfu():
    """Offline: one target forward a sequence (extraction) and the drafter's steps; online: the target's
    forward every epoch. The drafter's FLOPs are dflash/plan/flops.py's train_flops (what its MFU is measured
    against); checkpointing adds the layers' forward once more, at an MFU measured on a step without it."""
    job = compose([*Q36_RECIPE, "train.gradient_checkpointing=off"])
    drafter, s, u = build(job, world=8)
    run = make_run(job, PAPER)
    h = hours(drafter, s, u, run)
    T, N = 1500, run.sequences
    target = 2 * (s.target_params - s.heads_params) * T  # 2 FLOPs a non-embedding parameter a token
    step = sum(train_flops(drafter, spread_blocks(T, 512)).values())
    rate = 989e12 * 0.35 * 3600
    assert h["flops_per_token"] == {"drafter": step / T, "recompute": 0, "target forward": target / T}
    assert h["offline"]["extraction"] == pytest.approx(N * target / rate)
    assert h["offline"]["training"] == pytest.approx(6 * N * step / rate)
    assert h["online"]["total"] == pytest.approx(6 * N * (step + target) / rate)
    assert 500 < h["offline"]["total"] < h["online"]["total"] < 800
    ckpt = hours(drafter, s, replace(u, checkpointing=True), replace(run, mfu_recomputed=False))
    assert 1.15 < ckpt["offline"]["training"] / h["offline"]["training"] < 4 / 3
    assert hours(drafter, s, replace(u, checkpointing=True), run)["offline"] == h["offline"]  # mfu=
    steps = hours(drafter, s, u, replace(run, max_steps=1000))  # 1000 x 8 processes x 1 sequence
    assert steps["offline"]["training"] == pytest.approx(8000 * step / rate)


def test_a_checkpointed_step_is_not_charged_its_recompute_twice(tmp_path, monkeypatch):
    """An MFU is model FLOPs (no recompute) over the step's time: the Qwen3.6-27B preset's step, measured with
    gradient checkpointing as the preset trains, already spent its recompute in that time. Its plan's training
    hours are its model FLOPs at that MFU (they were 1.2x that: the recompute counted again); a plan without
    checkpointing at the same MFU takes less (no recompute to spend); an MFU given with mfu= is taken as the
    planned step's own."""
    job = compose(Q36_RECIPE)
    drafter, s, u = build(job, world=8)
    assert u.checkpointing
    result = {"device": "cuda", "checks": {"qwen3_6_step": {
        "shape": "experiment=qwen3_6_27b train.mode=offline: drafter 5 layers", "mfu": 0.28}}}
    (tmp_path / "2026-12-04-h200-gpu-check.json").write_text(json.dumps(result))
    run = make_run(job, PlanConfig(mfu_results=str(tmp_path)), "qwen3_6_27b")
    step = sum(train_flops(drafter, spread_blocks(run.tokens_per_sequence, u.num_anchors)).values())
    h = hours(drafter, s, u, run)
    assert h["offline"]["training"] == pytest.approx(6 * run.sequences * step / (989e12 * 0.28 * 3600))
    assert (run.mfu, run.mfu_recomputed) == (0.28, True)  # the preset checkpoints: its overrides say so
    per = sequence_flops(drafter, s, run.tokens_per_sequence, u.num_anchors)
    assert h["recompute_scale"] == 1 and 0.15 < per["recompute"] / per["drafter"] < 1 / 3
    plain = hours(drafter, s, replace(u, checkpointing=False), run)
    assert plain["offline"]["training"] == pytest.approx(h["offline"]["training"] * per["drafter"] / (
        per["drafter"] + per["recompute"]))
    given = hours(drafter, s, u, replace(run, mfu_recomputed=None))
    assert given["offline"]["training"] == pytest.approx(h["offline"]["training"])
    text = "\n".join(costs.render_run(make_plan(s, u, [80], drafter, run)["run"], 8))
    assert "recomputed, already in the time of the MFU's step" in text


def test_the_mfu_is_the_newest_gpu_results(tmp_path):
    assert measured(tmp_path) is None
    (tmp_path / "2026-12-01-cpu.json").write_text(json.dumps({"device": "cpu", "x": {"mfu": 0.9}}))
    (tmp_path / "2026-12-02-broken.json").write_text("{not json")
    assert measured(tmp_path) is None  # a CPU's figure is no GPU's
    gpu = {"device": "NVIDIA H100 80GB HBM3", "checks": {"flex": {"lengths": {"1024": {"mfu": 0.3}, "3072": {
        "mfu": 0.4}, "4096": {"mfu": None}}}, "q36": {"mfu": 0.5}}}
    (tmp_path / "2026-12-03-h100.json").write_text(json.dumps(gpu))
    (tmp_path / "2026-11-30-h100.json").write_text(json.dumps({"device": "cuda", "mfu": 0.1}))
    assert measured(tmp_path) == (0.4, "measured: median of 3 in bench/results/2026-12-03-h100.json",
                                  False)


def test_a_preset_plans_with_the_mfu_of_its_own_step(tmp_path):
    """The first H200's Qwen3-8B-size steps ran at MFU 0.33, the Qwen3.6-27B drafter's at 0.28 and its DFlash 2
    drafter's at 0.15 beside other checks and 0.20 alone (in a second file): a plan for a preset whose step was
    measured takes that step's MFU, alone before beside (a prefix of another preset's name does not match), and
    whether it recomputed (those presets checkpoint); every other plan the median of the newest file's steps
    that did not recompute."""
    gpu = {"device": "cuda", "checks": {
        "flex_train_step": {"shape": "drafter 5 layers at 4096 hidden", "lengths": {"1024": {"mfu": 0.33},
                                                                                    "3072": {"mfu": 0.33}}},
        "qwen3_6_step": {"shape": "experiment=qwen3_6_27b train.mode=offline: drafter 5 layers", "mfu": 0.28},
        "qwen3_6_dflash2_step": {"shape": "experiment=qwen3_6_27b_dflash2 train.mode=offline: drafter", "mfu": 0.15}}}
    (tmp_path / "2026-12-04-nvidia-h200-gpu-check.json").write_text(json.dumps(gpu))
    name = "bench/results/2026-12-04-nvidia-h200-gpu-check.json"
    assert measured(tmp_path, "qwen3_6_27b") == (
        0.28, f"measured: qwen3_6_step, experiment=qwen3_6_27b's step, in {name}", True)
    assert measured(tmp_path, "qwen3_6_27b_dflash2")[0] == 0.15
    assert measured(tmp_path, "qwen3_8b") == (0.33, f"measured: median of 2 in {name}", False)
    assert measured(tmp_path) == measured(tmp_path, "qwen3_8b")
    rerun = {"device": "cuda", "checks": {"qwen3_6_dflash2_step_alone": {
        "shape": "experiment=qwen3_6_27b_dflash2 train.mode=offline: drafter", "mfu": 0.2, "alone": True}}}
    (tmp_path / "2026-12-04-nvidia-h200-gpu-check-rerun.json").write_text(json.dumps(rerun))
    assert measured(tmp_path, "qwen3_6_27b_dflash2") == (
        0.2, "measured: qwen3_6_dflash2_step_alone, experiment=qwen3_6_27b_dflash2's step alone, in "
             "bench/results/2026-12-04-nvidia-h200-gpu-check-rerun.json", True)
    assert measured(tmp_path, "qwen3_6_27b")[0] == 0.28
    assert measured(tmp_path)[1] == f"measured: median of 2 in {name}"  # the full check's file
    recorded = {"device": "cuda", "checks": {"qwen3_6_step": {"shape": "experiment=qwen3_6_27b: drafter", "mfu": 0.3,
                                                              "checkpointing": False, "alone": True}}}
    (tmp_path / "2026-12-05-nvidia-h200-gpu-check.json").write_text(json.dumps(recorded))
    assert measured(tmp_path, "qwen3_6_27b")[::2] == (0.3, False)  # as preset_step recorded it
    later = {**recorded, "started": "2026-12-05T18:00:00+0000"}  # a second run that day: -2, after the first
    later["checks"] = {"qwen3_6_step": {**recorded["checks"]["qwen3_6_step"], "mfu": 0.31}}
    (tmp_path / "2026-12-05-nvidia-h200-gpu-check-2.json").write_text(json.dumps(later))
    assert measured(tmp_path, "qwen3_6_27b")[0] == 0.31
    (tmp_path / "2026-12-05-nvidia-h200-gpu-check.json").write_text(json.dumps(
        {**recorded, "started": "2026-12-05T09:00:00+0000"}))
    assert measured(tmp_path, "qwen3_6_27b")[0] == 0.31  # by its start, not its name


def test_the_plan_reads_no_field_written_by_hand(tmp_path):
    """A field hand_edited.json lists for a result (here "device" and every check's "alone", added by hand after
    the run) is not read: a result whose device no tool recorded is no GPU result, and a step the hand marked
    alone is not preferred as one timed alone."""
    gpu = {"device": "cuda", "checks": {"qwen3_6_step": {"shape": "experiment=qwen3_6_27b: drafter", "mfu": 0.28}}}
    (tmp_path / "2026-12-04-h200-gpu-check.json").write_text(json.dumps(gpu))
    rerun = {"device": "cuda", "why": "a note", "checks": {"qwen3_6_step_alone": {
        "shape": "experiment=qwen3_6_27b: drafter", "mfu": 0.2, "alone": True}, "other": {"alone": False}}}
    (tmp_path / "2026-12-04-h200-gpu-check-rerun.json").write_text(json.dumps(rerun))
    assert measured(tmp_path, "qwen3_6_27b")[0] == 0.2  # the hand's "alone" and "device" read
    (tmp_path / costs.HAND_EDITED).write_text(json.dumps({"2026-12-04-h200-gpu-check-rerun.json": {
        "notes": "x.notes.md", "hand_written": ["device", "why", "checks/*/alone"]}}))
    assert costs.tool_written(tmp_path / "2026-12-04-h200-gpu-check-rerun.json") == {"checks": {
        "qwen3_6_step_alone": {"shape": "experiment=qwen3_6_27b: drafter", "mfu": 0.2}, "other": {}}}
    assert costs.tool_written(tmp_path / "2026-12-04-h200-gpu-check.json") == gpu
    assert costs.tool_written(tmp_path / costs.HAND_EDITED) is None
    assert measured(tmp_path, "qwen3_6_27b")[0] == 0.28


def test_no_result_in_bench_results_gives_the_plan_a_field_a_tool_did_not_write(tmp_path):
    """Every GPU check report in bench/results/ holds, as the plan reads it, only fields the runner writes (the
    fields a Report writes at the top); the hand-edited one is listed in hand_edited.json with a notes file, its
    listed fields are there in its bytes (it is never edited) and gone from what the plan reads; so no preset's
    MFU comes from it (the first H200's DFlash 2 step is planned at what its full check recorded, 0.152, not at the
    hand-annotated rerun's 0.197, while no newer report has the step)."""
    from bench.gpu.runner import Report

    report = Report(["a_check"], tmp_path, "cpu", "python -m bench.gpu.checks", [["a_check"]])
    fields = set(json.loads(report.paths[0].read_text()))
    hand = json.loads((RESULTS / costs.HAND_EDITED).read_text())
    reports = sorted(RESULTS.glob("*gpu-check*.json"))
    assert len(reports) >= 3
    for path in reports:
        assert set(costs.tool_written(path)) <= fields, path.name
    for name, record in hand.items():
        raw, read = json.loads((RESULTS / name).read_text()), costs.tool_written(
            RESULTS / name)
        assert (RESULTS / record["notes"]).exists()
        for field in record["hand_written"]:
            top, _, rest = field.partition("/")
            assert top in raw, (name, field)
            if not rest:
                assert top not in read
        assert not any("alone" in c for c in read["checks"].values())
    for experiment in (None, "qwen3_6_27b", "qwen3_6_27b_dflash2"):
        where = mfu_of(PlanConfig(), experiment)[1]
        assert not any(where.endswith(f"bench/results/{name}") for name in hand), where


def test_the_run_reads_the_configured_data(tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"p{i}"}) + "\n" for i in range(7)))
    job = compose(["data=jsonl", f"data.prompts={prompts}", "data.offset=1", "data.limit=5"])
    run = make_run(job, PlanConfig())
    assert (run.sequences, run.sequences_where, run.tokens_per_sequence) == (5, "data.prompts", 1500)
    assert make_run({**job, "data": {**job["data"], "limit": None}}, PlanConfig()).sequences == 6
    missing = make_run({**job, "data": {**job["data"], "prompts": str(tmp_path / "nope.jsonl")}}, PlanConfig())
    assert missing.sequences == 800_000 and "paper" in missing.sequences_where
    mine = make_run(job, PlanConfig(sequences=1000, tokens_per_sequence=999, mfu=0.5))
    assert (mine.sequences, mine.tokens_per_sequence, mine.mfu, mine.mfu_where) == (1000, 999, 0.5, "mfu=")
    assert make_run({**job, "max_length": 512}, PlanConfig()).tokens_per_sequence == 512


PRESETS = sorted(p.stem for p in (REPO / "conf/experiment").glob("*.yaml"))
# The real small targets' experiments are sized for this machine and for one GPU, not for a node of 8.
ONE_MACHINE = {"smollm2_135m_cpu", "smollm2_135m_gpu"}
RECIPES = [p for p in PRESETS if p not in ONE_MACHINE]


def test_every_preset_is_a_recipe_or_a_one_machine_experiment():
    assert ONE_MACHINE <= set(PRESETS) and len(RECIPES) >= 12


@pytest.mark.parametrize("preset", sorted(ONE_MACHINE))
def test_the_one_machine_experiments_fit_one_gpu_at_their_own_data_size(preset):
    """On one 80 GB GPU the plan fits them in the mode they name, at the data size they read."""
    job = compose([f"experiment={preset}"])
    drafter, s, u = build(job, world=1)
    out = make_plan(s, u, [80], drafter, make_run(job, PlanConfig()))
    assert out["gpus"][0]["fits"]
    assert out["run"]["sequences"] == job["data"]["limit"] and out["run"]["sequences_where"] != "paper"


@pytest.mark.parametrize("preset", RECIPES)
def test_each_preset_trains_as_the_plan_recommends_on_8_gpus(preset):
    """On 8 x 80 GB the preset's mode, distribution, checkpointing and anchors are the plan's recommendation;
    on 8 x 141 GB its mode and anchors are, and its set-up fits too. Its comment quotes the plan's figures."""
    job = compose([f"experiment={preset}"])
    drafter, s, u = build(job, world=8)
    train = job["train"]
    out = make_plan(s, u, [80, 141], drafter, make_run(job, PAPER),
                    auto_checkpointing=train.gradient_checkpointing == "auto")  # as python -m dflash.plan does
    at80, at141 = out["run"]["recommended"]
    checkpointing = checkpointing_of(train.gradient_checkpointing)  # auto: what it chooses on 80 GB
    checkpointing = out["gpus"][0]["auto_checkpointing"] if train.gradient_checkpointing == "auto" else checkpointing
    assert (at80["mode"], at80["distributed"], at80["checkpointing"], at80["num_anchors"]) == (
        train.mode, train.distributed, checkpointing, train.num_anchors)
    assert (at141["mode"], at141["num_anchors"]) == (train.mode, train.num_anchors)
    assert all(g["fits"] for g in out["gpus"])
    text = (REPO / f"conf/experiment/{preset}.yaml").read_text()
    assert yaml.safe_load(text)["train"]["mode"] == train.mode  # the preset says it itself
    for figure in (f"peak {at80['peak']:.1f} GiB", f"{at141['peak']:.1f} GiB", f"{out['run']['cache_tb']:.0f} TB"):
        assert figure in text, f"conf/experiment/{preset}.yaml should quote the plan's {figure!r}"


def test_recommend_prefers_offline_when_the_cache_fits_the_disk():
    job = compose(["experiment=qwen3_8b"])
    _, s, u = build(job, world=8)
    run = make_run(job, replace(PAPER, sequences=10_000))  # 0.6 TB of cache
    (rec,) = costs.recommend(s, u, run, 0.6e12, [80])
    assert (rec["mode"], rec["distributed"], rec["checkpointing"]) == ("offline", "ddp", False)
    (big,) = costs.recommend(s, u, run, 50e12, [80])  # the paper's 49 TB: online, which fits 80 GB
    assert (big["mode"], big["distributed"], big["checkpointing"]) == ("online", "ddp", False)
    most = {m: max_anchors(s, replace(u, online=m == "online", distributed="fsdp", checkpointing=True), 80 * GiB)
            for m in ("offline", "online")}
    n = (most["offline"] + most["online"]) // 2  # more than the target leaves room for online
    (tight,) = costs.recommend(s, replace(u, num_anchors=n), run, 0.6e12, [80])
    assert (tight["mode"], tight["distributed"], tight["checkpointing"], tight["num_anchors"]) == (
        "offline", "fsdp", True, n) and "only offline fits" in tight["why"]
    assert tight["modes"]["online"]["num_anchors"] == most["online"] < n
    (none,) = costs.recommend(s, replace(u, num_anchors=50_000), run, 0.6e12, [24])
    assert none["mode"] == "offline" and 0 < none["num_anchors"] == max_anchors(s, replace(
        u, online=False, distributed="fsdp", checkpointing=True), 24 * GiB) < 50_000


def test_the_command_line_prints_the_run_side_by_side(capsys):
    main(["experiment=qwen3_6_27b", "world_size=8", "sequences=100000", "mfu=0.4"])
    text = capsys.readouterr().out
    for line in ("feature cache on disk", "host memory a process, loading", "GPU-hours", "offline", "online",
                 "100000 sequences (sequences=)", "MFU 40% (mfu=)", "recommended, 8 processes"):
        assert line in text, line
    main(["experiment=qwen3_8b", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert set(out["run"]["gpu_hours"]) == {"offline", "online", "flops_per_token", "recompute_scale"}
    assert Path(RESULTS).name == "results"
    assert isinstance(Run(sequences=1, tokens_per_sequence=1, sequences_where="x").disk_tb, float)


def test_the_mfu_is_read_from_the_results_folder_mfu_results_names(tmp_path, caplog):
    """mfu_results=<folder>: the plan's MFU comes from that folder's GPU results, named by its path (the default is
    this checkout's bench/results, named so); a folder that is not there is refused in one line; mfu= wins."""
    result = {"device": "cuda", "checks": {"q36": {"mfu": 0.42}}}
    (tmp_path / "2026-12-09-h100.json").write_text(json.dumps(result))
    assert mfu_of(PlanConfig(mfu_results=str(tmp_path))) == (
        0.42, f"measured: median of 1 in {tmp_path}/2026-12-09-h100.json", False)
    assert mfu_of(PlanConfig(mfu_results=str(tmp_path), mfu=0.3)) == (0.3, "mfu=", None)
    empty = tmp_path / "empty"
    empty.mkdir()
    assert mfu_of(PlanConfig(mfu_results=str(empty))) == (
        costs.ASSUMED_MFU, f"assumed: no GPU result with an MFU in {empty}/", False)
    assert mfu_of(PlanConfig())[1].split(" in ")[-1].startswith("bench/results/")
    with pytest.raises(SystemExit):
        main(["experiment=qwen3_8b", f"mfu_results={tmp_path / 'nope'}"])
    assert f"mfu_results={tmp_path / 'nope'}: no such folder" in caplog.text
    main(["experiment=qwen3_8b", f"mfu_results={tmp_path}", "--json"])
