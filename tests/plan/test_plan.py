"""dflash.plan: the per-GPU memory plan of a training step, checked against measured peaks on CPU."""

import json
from dataclasses import replace

import pytest
import torch
from transformers import Qwen3Config

from bench.measure import TensorPeak
from dflash.config import OptimConfig
from dflash.drafter.blocks import draft_packed, pack_blocks
from dflash.drafter.build import build_drafter, drafter_config
from dflash.drafter.loss import block_terms
from dflash.drafter.model import DFlashDraftModel
from dflash.drafter.recompute import use_checkpointing
from dflash.plan.compose import compose
from dflash.plan.configured import active_intermediate, active_params, drafter_shape, moe_experts, target_config
from dflash.plan.memory import (DENSE_MASK_BYTES, MODE_WORDS, PERSISTENT, GiB, Setup, block_mask_bytes, flex_padded,
                                peak, terms)
from dflash.plan.report import build, main, make_plan, render
from dflash.train.optim import build_optimizer
from tests.conftest import modules_loaded


@pytest.mark.parametrize("experiment", ["qwen3_8b", "qwen3_6_27b"])
def test_plan_of_the_real_targets_builds_on_meta_and_is_sane(experiment):
    offline = [f"experiment={experiment}", "train.mode=offline", "train.distributed=ddp",
               "train.gradient_checkpointing=off"]
    drafter, shape, setup = build(compose(offline))
    assert all(p.device.type == "meta" for p in drafter.parameters())
    if experiment == "qwen3_8b":  # 5 Qwen3-8B-wide layers, fc from 5 target layers, two norms
        layer = 2 * 4096 * 4096 + 2 * 4096 * 1024 + 3 * 4096 * 12288 + 2 * 128 + 2 * 4096
        assert shape.params == 5 * layer + 5 * 4096 * 4096 + 2 * 4096
    assert (shape.hidden, shape.vocab, shape.block_size, setup.num_anchors, setup.ctx_len) == (
        {"qwen3_8b": 4096, "qwen3_6_27b": 5120}[experiment], {"qwen3_8b": 151936, "qwen3_6_27b": 248320}[experiment],
        16, 512, {"qwen3_8b": 3072, "qwen3_6_27b": 32768}[experiment])  # the recipe's length; long context
    out = make_plan(shape, setup, [24, 40, 80, 141])
    t = out["terms_gib"]
    assert t["gradients (fp32)"] == t["drafter parameters (fp32)"] == t["AdamW state (2 x fp32)"] / 2
    assert t["activations, checkpointing"] < t["activations, no checkpointing"]
    assert 10 < out["peak"]["no checkpointing"]["gib"] < 80  # the recipe trains offline on one 80 GB GPU
    anchors = [g["max_num_anchors"]["no checkpointing"] for g in out["gpus"]]
    assert anchors == sorted(anchors) and anchors[2] > 512
    assert all(g["max_num_anchors"]["checkpointing"] >= g["max_num_anchors"]["no checkpointing"] for g in out["gpus"])
    at_max = peak(shape, replace(setup, num_anchors=anchors[2]))[0]
    assert at_max <= 80 * GiB < peak(shape, replace(setup, num_anchors=anchors[2] + 1))[0]


def test_plan_sharding_and_the_command_line(capsys):
    job = compose(["experiment=qwen3_6_27b", "train.mode=offline", "train.distributed=ddp",
                   "target.tensor_parallel=1"])  # the whole target on each GPU
    _, shape, ddp = build(job, world=8)
    _, _, fsdp = build({**job, "train": replace(job["train"], distributed="fsdp")}, world=8)
    t_ddp, t_fsdp = terms(shape, ddp), terms(shape, fsdp)
    assert t_fsdp["AdamW state (2 x fp32)"] == t_ddp["AdamW state (2 x fp32)"] / 8
    assert t_ddp["DDP gradient buckets"] == t_ddp["gradients (fp32)"] and t_fsdp["DDP gradient buckets"] == 0
    _, online, setup = build({**job, "train": replace(job["train"], mode="online")})
    assert 26e9 < online.target_params < 28e9 and terms(online, setup)["target model (online)"] > 50e9

    main(["experiment=qwen3_8b", "train.num_anchors=1024", "gpu_gb=[80,141]", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert out["setup"]["num_anchors"] == 1024 and [g["gpu_gib"] for g in out["gpus"]] == [80, 141]
    main(["experiment=qwen3_8b", "gpu_gb=48"])
    text = capsys.readouterr().out
    assert "loss logits buffer" in text and "48 GiB" in text


def test_parameters_counted_on_meta_equal_a_real_drafter(tiny_targets):
    job = compose(["target=tiny_qwen3", "drafter=tiny", "train.mixed_precision=no"])
    _, shape, setup = build(job)
    real = build_drafter(job["drafter"], job["layers"], tiny_targets["tiny_qwen3"])
    assert shape.params == sum(p.numel() for p in real.parameters()) > 0
    loaded = tiny_targets["tiny_qwen3"]  # the target built on meta counts what loading it gives
    assert drafter_shape(real, shape.vocab, shape.tied, (loaded.model, loaded.config)) == shape
    assert shape.target_params == sum(p.numel() for p in loaded.model.parameters())
    assert setup.compute == 4 and setup.frozen == 4  # the tiny target is float32


def measured_step(H, L, N, *, heads, kv, head_dim, inter, layers, block, vocab, n_target, chunk,
                  layer_types=None, checkpointing=False, autocast=False, grad_accum=1, dflash2=False):
    """(peak tensor bytes of a second training step on CPU, its Shape and Setup): draft_packed, block_terms,
    backward, clipping and the AdamW step of the real code, anchors spread evenly over the sequence."""
    torch.manual_seed(0)
    target = Qwen3Config(vocab_size=vocab, hidden_size=H, intermediate_size=inter, num_hidden_layers=8,
                         num_attention_heads=heads, num_key_value_heads=kv, head_dim=head_dim)
    config = drafter_config(target, num_layers=layers, block_size=block, target_layer_ids=list(range(n_target)),
                            mask_token_id=vocab - 1, layer_types=layer_types,
                            sliding_window=L // 2 if layer_types else None,
                            dflash2={"conv_kernel_size": 2, "conv_group_size": 16, "selector_rank": 32,
                                     "selector_top_k": 8} if dflash2 else None)
    drafter = DFlashDraftModel(config).float().train()
    use_checkpointing(drafter, MODE_WORDS[checkpointing])  # as loop.py turns it on
    frozen = torch.bfloat16 if autocast else torch.float32
    embed = torch.nn.Embedding(vocab, H).to(frozen).requires_grad_(False)
    head = torch.nn.Linear(H, vocab, bias=False).to(frozen).requires_grad_(False)
    optimizer = build_optimizer(drafter, OptimConfig())
    ids = torch.randint(0, vocab - 1, (1, L))
    anchors = torch.linspace(0, L - 2, N).round().long()
    blocks = pack_blocks(ids, torch.ones(1, L, dtype=torch.bool), torch.tensor([L]), [anchors], block, vocab - 1)
    features = torch.randn(1, L, n_target * H)

    def step():
        for _ in range(grad_accum):
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                hidden = draft_packed(drafter, embed, features, blocks, "sdpa")
                terms = block_terms(hidden, head.weight, blocks.labels, blocks.label_mask, 7.0, chunk,
                                    selector=drafter.candidate_selector)
            loss = terms.loss_sum if terms.selector_sum is None else terms.loss_sum + terms.selector_sum
            (loss / terms.weight_sum).backward()
        torch.nn.utils.clip_grad_norm_(drafter.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    step()  # the first step makes AdamW's state
    with TensorPeak() as mem:
        mem.track(*drafter.parameters(), *drafter.buffers(), embed.weight, head.weight, features, ids,
                  *[v for state in optimizer.state.values() for v in state.values()],
                  *[v for v in vars(blocks).values() if torch.is_tensor(v)])
        step()
    setup = Setup(ctx_len=L, num_anchors=N, grad_accum=grad_accum, compute=2 if autocast else 4,
                  frozen=2 if autocast else 4,
                  backend="sdpa", checkpointing=checkpointing, chunk_logits=chunk, foreach=False,
                  allowance=0, fragmentation=0)
    return mem.peak, drafter_shape(drafter, vocab), setup


SHAPES = {  # three float32 shapes: unchunked and chunked loss, one to three chunks of blocks, a sliding layer
    "small": {"H": 64, "L": 256, "N": 32, "heads": 4, "kv": 2, "head_dim": 16, "inter": 128, "layers": 2, "block": 8,
              "vocab": 512, "n_target": 3, "chunk": 0},
    "wider": {"H": 96, "L": 384, "N": 64, "heads": 6, "kv": 2, "head_dim": 16, "inter": 192, "layers": 2, "block": 8,
              "vocab": 1024, "n_target": 5, "chunk": 64 * 1024},
    "longer": {"H": 128, "L": 512, "N": 40, "heads": 4, "kv": 2, "head_dim": 32, "inter": 320, "layers": 3,
               "block": 16, "vocab": 768, "n_target": 2, "chunk": 16 * 768,
               "layer_types": ["sliding_attention", "full_attention", "full_attention"]},
}
CASES = {**{name: (name, {}) for name in SHAPES},
         "wider, gradient checkpointing": ("wider", {"checkpointing": True}),
         "wider, selective checkpointing": ("wider", {"checkpointing": "selective"}),
         "longer, selective checkpointing, bf16 autocast": ("longer", {"checkpointing": "selective", "autocast": True}),
         "small, DFlash 2, selective checkpointing": ("small", {"dflash2": True, "checkpointing": "selective"}),
         "small, bf16 autocast": ("small", {"autocast": True}),
         "longer, 2 micro-batches": ("longer", {"grad_accum": 2}),
         "wider, DFlash 2": ("wider", {"dflash2": True}),
         "small, DFlash 2, bf16 autocast": ("small", {"dflash2": True, "autocast": True})}


@pytest.mark.parametrize("case", list(CASES))
def test_estimate_matches_the_measured_peak_on_cpu(case):
    shape_name, extra = CASES[case]
    measured, shape, setup = measured_step(**SHAPES[shape_name], **extra)
    estimate, phase = peak(shape, setup)
    print(f"{case}: measured {measured / 2**20:.2f} MiB, estimate {estimate / 2**20:.2f} MiB ({phase}), "
          f"ratio {estimate / measured:.3f}")
    assert abs(estimate / measured - 1) < 0.15


def test_block_mask_bytes_are_those_of_the_real_block_masks():
    """The plan's block-mask term for the Qwen3.6-27B preset (a sliding and a full mask a sequence, 32768 tokens
    and 512 blocks of 16) is the bytes of the BlockMasks packed_block_mask builds at that shape, counted in the peak
    on the flex path; its build figure is the measured peak of the temporaries (40 MiB, [queries, key tiles]:
    nothing [queries, keys] is made); the dense figure is what it replaced (7.2 GiB)."""
    from dflash.drafter.blocks import packed_block_mask

    drafter, shape, setup = build(compose(["experiment=qwen3_6_27b"]))
    assert shape.layer_types == ("full_attention", "sliding_attention") and setup.backend == "flex"
    n, size, L = setup.num_anchors, shape.block_size, flex_padded(setup).ctx_len
    anchors = torch.linspace(0, L - 2, n).round().long()[None]
    assert L == 32768 and n == 512
    kept = 0
    for window in (None, 2048):
        with TensorPeak() as mem:
            mask = packed_block_mask(anchors, L, size, window)
        kept += sum(getattr(mask, k).numel() * 4 for k in ("kv_num_blocks", "kv_indices", "full_kv_num_blocks",
                    "full_kv_indices", "q_num_blocks", "q_indices", "full_q_num_blocks", "full_q_indices"))
        assert mem.largest[1] == (1, n * size, (L + n * size) // 128)  # [b, queries, key tiles]
    got = block_mask_bytes(shape, setup)
    assert got["kept"] == kept < 2**20
    assert abs(got["build"] / mem.peak - 1) < 0.1
    assert got["dense before"] == n * size * (L + n * size) * (3 + 20) > 1000 * kept
    assert terms(shape, setup)["flex block masks"] == kept and "flex block masks" in PERSISTENT
    sdpa = replace(setup, backend="sdpa")
    assert terms(shape, sdpa)["flex block masks"] == 0 and not make_plan(shape, sdpa, [80])[
        "block_mask_bytes_per_sequence"]
    out = make_plan(shape, replace(setup, batch=2), [80])
    assert out["block_mask_bytes_per_sequence"] == got  # per sequence: a batch of 2 holds twice as much
    assert "block masks a sequence: 0.63 MiB kept" in render(make_plan(shape, setup, [80]), drafter, "x")


@pytest.mark.parametrize("window", [None, 256])
def test_dense_mask_bytes_are_what_create_block_mask_holds(window):
    """DENSE_MASK_BYTES, the 'before' figure: create_block_mask's peak per [query, key] entry on CPU."""
    from torch.nn.attention.flex_attention import create_block_mask

    from dflash.drafter.blocks import make_mask_mod

    L, n, size = 512, 32, 16
    mod = make_mask_mod(torch.linspace(0, L - 2, n).round().long()[None], L, size, window)
    with TensorPeak() as mem:
        create_block_mask(mod, B=1, H=None, Q_LEN=n * size, KV_LEN=L + n * size, device="cpu")
    expected = DENSE_MASK_BYTES["full_attention" if window is None else "sliding_attention"]
    assert abs(mem.peak / (n * size * (L + n * size)) / expected - 1) < 0.1


def test_online_counts_the_targets_embed_and_lm_head_once():
    """Online, the drafter borrows the target's own embed_tokens and lm_head: they are inside the whole
    target's 50.1 GiB (unsharded), not 4.7 GiB more beside it."""
    job = compose(["experiment=qwen3_6_27b", "train.distributed=ddp", "target.tensor_parallel=1"])
    _, shape, setup = build(job, world=8)
    offline, online = terms(shape, replace(setup, online=False)), terms(shape, replace(setup, online=True))
    assert shape.heads_params == 2 * 248320 * 5120 and offline["frozen embed + lm_head"] == shape.heads_params * 2
    assert online["frozen embed + lm_head"] == 0 and online["target model (online)"] == shape.target_params * 2
    kept = lambda t: sum(t[k] for k in PERSISTENT)
    assert kept(online) - kept(offline) == (shape.target_params - shape.heads_params) * 2  # 45.4 GiB, not 50.1


def test_fsdp_terms_are_what_accel_sets_up():
    """accel.fsdp_plugin: FSDP2, a unit per decoder layer (the rest is the root unit), float32 parameters and
    reductions (autocast makes the bf16 copies). So a rank keeps 1/world of the float32 state, the root's and
    two layers' float32 weights gathered, bf16 copies of all weights under autocast (as DDP does), and under
    grad_accum > 1 the whole unsharded gradients (FSDP2's no_sync accumulation)."""
    from dflash.drafter.model import DFlashDraftModel
    from dflash.train import accel

    plugin = accel.fsdp_plugin()
    policy = plugin.mixed_precision_policy
    assert plugin.fsdp_version == 2 and plugin.auto_wrap_policy is not None
    assert (policy.param_dtype, policy.reduce_dtype) == (None, None)  # the parameters' own dtype: float32
    assert DFlashDraftModel._no_split_modules == ["DFlashDecoderLayer"]

    job = compose(["experiment=qwen3_6_27b", "train.distributed=fsdp"])
    _, s, u = build(job, world=8)
    assert s.root_params == 5 * 5120 * 5120 + 2 * 5120  # fc, hidden_norm, norm
    t = terms(s, u)
    assert t["drafter parameters (fp32)"] == t["gradients (fp32)"] == s.params * 4 / 8
    assert t["FSDP gathered parameters (fp32)"] == (s.root_params + 2 * s.layer_params) * 4 < s.params * 2
    assert t["FSDP gradients before reduce-scatter"] == 2 * s.layer_params * 4
    assert t["autocast weight copies (bf16)"] == s.params * 2 and t["gradients kept between micro-batches"] == 0
    fp32 = terms(s, replace(u, compute=4))
    assert fp32["autocast weight copies (bf16)"] == 0 and fp32["FSDP gathered parameters (fp32)"] == t[
        "FSDP gathered parameters (fp32)"]
    assert terms(s, replace(u, grad_accum=4))["gradients kept between micro-batches"] == s.params * 4
    one = terms(s, replace(u, world=1))  # accelerate trains FSDP on one process unsharded, as DDP
    assert one["FSDP gathered parameters (fp32)"] == 0 and one["drafter parameters (fp32)"] == s.params * 4


def test_the_drafters_state_is_what_fit_counts():
    """dflash/train/fit.py refuses online runs from the same formulas: DDP 20 bytes a parameter (weights,
    gradients, two moments, buckets); FSDP 16 / world plus the bf16 weights. The plan's terms sum to its
    figures, so the refusal of Qwen3.6-27B online DDP on 80 GB and the FSDP fit agree with the plan (the whole
    target on each GPU)."""
    from types import SimpleNamespace

    from dflash.target.placement import ALLOWANCE
    from dflash.train import fit

    job = compose(["experiment=qwen3_6_27b", "target.tensor_parallel=1"])
    _, s, u = build(job, world=8)
    for distributed in ("ddp", "fsdp"):
        t = terms(s, replace(u, distributed=distributed))
        mine = t["drafter parameters (fp32)"] + t["gradients (fp32)"] + t["AdamW state (2 x fp32)"]
        mine += t["DDP gradient buckets"] if distributed == "ddp" else t["autocast weight copies (bf16)"]
        train = SimpleNamespace(distributed=distributed, mixed_precision="auto")
        assert mine == fit.drafter_state(train, s.params, 8)[0]
        before = (t["target model (online)"] + mine + ALLOWANCE) / GiB
        assert round(before, 1) == {"ddp": 86.3, "fsdp": 58.9}[distributed]  # fit's figures, vs 79.2 GiB


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["no", "bf16"])
def test_fsdp_estimate_matches_a_measured_two_process_step(tmp_path, precision):
    """The plan's FSDP peak against tests/plan/fsdp_probe.py's measured tensor peak of the loop's step on
    each of 2 gloo processes, FSDP2 set up by accel.fsdp_plugin. Parameters dominate this shape, so counting
    the whole drafter gathered (the plan before) overshoots by 27% in float32."""
    import os
    import subprocess
    import sys

    from tests.conftest import REPO
    from tests.plan.fsdp_probe import ANCHORS, BLOCK, DIMS, LAYERS, LENGTH, N_TARGET

    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
           "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
           str(REPO / "tests/plan/fsdp_probe.py"), str(tmp_path), precision]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "ACCELERATE_USE_CPU": "1", "PYTHONPATH": str(REPO)}
    r = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600, check=False)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    config = drafter_config(Qwen3Config(**DIMS), num_layers=LAYERS, block_size=BLOCK,
                            target_layer_ids=list(range(N_TARGET)), mask_token_id=DIMS["vocab_size"] - 1)
    shape = drafter_shape(DFlashDraftModel(config), DIMS["vocab_size"])
    a = 2 if precision == "bf16" else 4
    setup = Setup(ctx_len=LENGTH, num_anchors=ANCHORS, compute=a, frozen=a, backend="sdpa", chunk_logits=0,
                  foreach=False, world=2, distributed="fsdp", allowance=0, fragmentation=0)
    estimate, phase = peak(shape, setup)
    for rank in (0, 1):
        got = json.loads((tmp_path / f"peak-{rank}.json").read_text())
        assert got["world"] == 2 and got["sharded"] == "DTensor"
        print(f"{precision}, rank {rank}: measured {got['peak'] / 2**20:.2f} MiB, estimate "
              f"{estimate / 2**20:.2f} MiB ({phase}), ratio {estimate / got['peak']:.3f}")
        assert abs(estimate / got["peak"] - 1) < 0.15


# The presets of the real targets with public z-lab drafters: (target layers, hidden, vocab, tied, drafter layers,
# block, heads, kv heads, head_dim, MLP, sliding layers, window, the published target_layer_ids).
PUBLISHED = {
    "llama3_1_8b_instruct": (32, 4096, 128256, False, 5, 10, 32, 8, 128, 12288, 0, None, [1, 8, 15, 22, 29]),
    "gemma4_31b_it": (60, 5376, 262144, True, 5, 16, 64, 8, 128, 10752, 4, 2048, [1, 12, 23, 35, 46, 57]),
    "gemma4_26b_a4b_it": (30, 2816, 262144, True, 5, 16, 32, 8, 128, 5632, 4, 2048, [1, 6, 11, 17, 22, 27]),
    "gpt_oss_20b": (24, 2880, 201088, False, 8, 8, 64, 8, 64, 7680, 0, None, [1, 6, 11, 16, 21]),
    "gpt_oss_120b": (36, 2880, 201088, False, 8, 10, 64, 8, 64, 7680, 0, None, [1, 9, 17, 25, 33]),
    "qwen3_coder_30b_a3b": (48, 2048, 151936, False, 8, 16, 32, 4, 128, 6144, 0, None, [1, 12, 23, 34, 45]),
    "qwen3_6_35b_a3b": (40, 2048, 248320, False, 6, 16, 32, 8, 128, 6144, 5, 4096, [1, 6, 11, 16, 22, 27, 32, 37]),
}
# parameters of the text model on meta (billions, as the hub's cards give them: 8B, 31B, 26B, 21B, 117B, 30.5B, 35B)
# and of those, what one token runs through
TARGET_PARAMS = {"llama3_1_8b_instruct": (8.03, 8.03), "gemma4_31b_it": (30.70, 30.70),
                 "gemma4_26b_a4b_it": (25.23, 3.82), "gpt_oss_20b": (20.91, 4.19), "gpt_oss_120b": (116.83, 5.71),
                 "qwen3_coder_30b_a3b": (30.53, 3.35), "qwen3_6_35b_a3b": (34.66, 3.45)}


@pytest.mark.parametrize("experiment", list(PUBLISHED))
def test_plan_of_the_published_drafters_targets(experiment):
    """Each preset composes, builds its target and drafter on the meta device from the plan's TARGETS (no
    download) at the published drafter's shape, and gets a plan whose configured set-up fits 80 GB GPUs
    (tests/plan/test_costs.py checks that it is the plan's recommendation and that the preset quotes it)."""
    T, H, V, tied, layers, block, heads, kv, hd, mlp, sliding, window, ids = PUBLISHED[experiment]
    job = compose([f"experiment={experiment}"])
    assert job["target"].num_layers == T and target_config(job["target"]).num_hidden_layers == T
    drafter, shape, setup = build(job, world=8)
    assert all(p.device.type == "meta" for p in drafter.parameters())
    assert drafter.target_layer_ids == ids and drafter.block_size == block
    assert drafter.layer_types.count("sliding_attention") == sliding and drafter.config.sliding_window == window
    assert drafter.mask_token_id == job["target"].mask_token_id < V
    assert (shape.hidden, shape.vocab, shape.tied, shape.layers, shape.heads, shape.kv_heads, shape.head_dim,
            shape.intermediate, shape.target_layers) == (H, V, tied, layers, heads, kv, hd, mlp, len(ids))
    attention = H * heads * hd * 2 + H * kv * hd * 2 + 2 * hd  # q, o; k, v; q_norm, k_norm
    # the GPT-OSS drafters have biased attention projections, copied from their target (published: true)
    assert drafter.config.attention_bias is experiment.startswith("gpt_oss")
    bias = heads * hd + 2 * kv * hd + H if drafter.config.attention_bias else 0
    assert shape.layer_params == attention + bias + 3 * H * mlp + 2 * H
    assert shape.params == layers * shape.layer_params + len(ids) * H * H + 2 * H  # + fc, hidden_norm, norm
    total, active = TARGET_PARAMS[experiment]
    tp = job["target"].tensor_parallel
    whole = build(compose([f"experiment={experiment}", "target.tensor_parallel=1"]), world=8)[1]
    assert (round(whole.target_params / 1e9, 2), round(shape.target_active_params / 1e9, 2)) == (total, active)
    # sharded over 8 (gpt-oss-120b: 117B parameters fit no GPU whole), or 2 (Qwen3.6-35B-A3B: at 32768 tokens the
    # whole target leaves no room for the step on 80 GB): a GPU keeps its share of the experts and of the rest
    share = round(shape.target_params / 1e9, 2)
    assert tp == {"gpt_oss_120b": 8, "qwen3_6_35b_a3b": 2}.get(experiment, 1) and total / tp <= share < 1.1 * total / tp
    out = make_plan(shape, setup, [80, 141])
    configured = out["peak"]["checkpointing" if setup.checkpointing else "no checkpointing"]["gib"]
    assert configured <= 80  # the 31B at 384 anchors: at 512 nothing online fits 80 GB
    assert setup.num_anchors == (384 if experiment == "gemma4_31b_it" else 512)
    assert setup.online and setup.tensor_parallel == tp


def test_moe_targets_count_the_experts_a_token_runs_through():
    """The target forward's working set and FLOPs follow the experts a token is routed to: top_k x the expert width
    (+ a shared expert, + Gemma 4's dense MLP beside its experts), and the parameters but the other experts'."""
    from transformers import GptOssConfig, LlamaConfig

    widths = {name: active_intermediate(target_config(compose([f"experiment={name}"])["target"]))
              for name in ("llama3_1_8b_instruct", "gemma4_26b_a4b_it", "gpt_oss_20b", "qwen3_coder_30b_a3b",
                           "qwen3_6_35b_a3b")}
    assert widths == {"llama3_1_8b_instruct": 14336, "gemma4_26b_a4b_it": 2112 + 8 * 704, "gpt_oss_20b": 4 * 2880,
                      "qwen3_coder_30b_a3b": 8 * 768, "qwen3_6_35b_a3b": 8 * 512 + 512}
    H, inter, E, k, L = 64, 32, 4, 2, 2
    moe = GptOssConfig(hidden_size=H, intermediate_size=inter, num_local_experts=E, num_experts_per_tok=k,
                       num_hidden_layers=L, num_attention_heads=2, num_key_value_heads=1, head_dim=32, vocab_size=128,
                       layer_types=["sliding_attention", "full_attention"])
    dense = LlamaConfig(hidden_size=H, intermediate_size=inter, num_hidden_layers=L, num_attention_heads=2,
                        num_key_value_heads=1, vocab_size=128)
    with torch.device("meta"):
        from transformers import AutoModelForCausalLM

        moe_model, dense_model = AutoModelForCausalLM.from_config(moe), AutoModelForCausalLM.from_config(dense)
    assert moe_experts(moe) == (E, k) and moe_experts(dense) == (0, 0)
    total = sum(p.numel() for p in moe_model.parameters())
    experts = L * E * (H * 2 * inter + 2 * inter + inter * H + H)  # gate_up, its bias, down, its bias
    assert active_params(moe_model, moe) == total - experts + experts * k // E
    assert active_params(dense_model, dense) == sum(p.numel() for p in dense_model.parameters())


def test_the_plan_says_what_auto_checkpointing_chooses_per_gpu(capsys):
    """python -m dflash.plan train.gradient_checkpointing=auto: each GPU size says what auto chooses there (off where
    the step fits without checkpointing, else selective where that fits, else full) and judges each GPU's fit by
    auto's step."""
    import re

    main(["experiment=qwen3_8b", "train.mode=offline", "train.gradient_checkpointing=auto", "gpu_gb=[24,30,141]",
          "--json"])
    out = json.loads(capsys.readouterr().out)
    peaks = [out["peak"][name]["gib"] for name in ("checkpointing", "selective checkpointing", "no checkpointing")]
    assert 24 < peaks[0] < peaks[1] < 30 < peaks[2] < 141 and out["auto_checkpointing"]  # 24.9, 27.5 and 33.6 GiB
    assert [g["auto_checkpointing"] for g in out["gpus"]] == [True, "selective", False]
    assert [g["fits"] for g in out["gpus"]] == [False, True, True]
    assert abs(out["gpus"][1]["free_gib"] - (30 - peaks[1])) < 1e-9
    assert abs(out["gpus"][2]["free_gib"] - (141 - peaks[2])) < 1e-9
    main(["experiment=qwen3_8b", "train.mode=offline", "train.gradient_checkpointing=off", "gpu_gb=[24,30,141]"])
    text = capsys.readouterr().out  # false configured: auto still shown
    assert "auto       largest train.num_anchors: no checkpointing / selective / full" in text
    assert "peak, no checkpointing" in text and text.count("(configured)") == 1
    gpu = r"^ +(\d+) GiB +(?:fits, [\d.]+ GiB free|short by [\d.]+ GiB) +(off|selective|full) "
    shown = re.findall(gpu, text, re.M)
    assert shown == [("24", "full"), ("30", "selective"), ("141", "off")]


def test_the_plan_takes_a_users_config_dir_and_config_name_as_train_py_does(tmp_path, tiny_targets, dflash_home,
                                                                            capsys):
    """python -m dflash.plan --config-dir <dir> target=mine: the user's own target preset, as train.py takes it
    (it failed on Hydra's lexer); -cd / --config-dir=, and --config-name naming a primary config of the folder."""
    mine = tmp_path / "my_conf"
    (mine / "target").mkdir(parents=True)
    (mine / "target" / "mine.yaml").write_text(
        f"name: mine\npath: {dflash_home / 'targets' / 'tiny_qwen3'}\nnum_layers: 8\nmask_token_id: 261\n"
        f"dtype: float32\n")
    (mine / "mine_train.yaml").write_text("defaults:\n  - job\n  - override target: mine\n  - _self_\n")
    for args in (["--config-dir", str(mine), "target=mine"], [f"--config-dir={mine}", "target=mine"],
                 ["-cd", str(mine), "--config-name", "mine_train"]):
        main([*args, "drafter=tiny", "--json"])
        out = json.loads(capsys.readouterr().out)
        # the tiny target's width, and the cache in its dtype (features.storage=auto, resolved as extraction does)
        assert out["shape"]["hidden"] == 64 and out["run"]["storage"] == "float32", args
    main(["--config-dir", str(mine), "target=mine", "drafter=tiny", "gpu_gb=24"])
    assert f"memory plan: --config-dir {mine} target=mine" in capsys.readouterr().out
    for wrong in (["target=mine"], ["--config-dir", str(tmp_path / "none"), "target=mine"], ["--bogus", "target=mine"]):
        with pytest.raises(SystemExit):  # in one line: no such target without the folder, no folder, no such option
            main([*wrong, "--json"])


def test_the_pure_models_import_nothing_of_the_pipeline():
    """memory, flops, costs, serving and targets take plain shapes and values (DESIGN §1): imported alone, they load
    no module of target/, data/, drafter/, evaluate/ or train/, nor the plan's adapter (configured, compose, report);
    importing dflash.config (whose eval.serving.gpu is checked against serving's GPU table) loads no more."""
    pure = ["dflash.config", *(f"dflash.plan.{m}" for m in ("memory", "flops", "costs", "serving", "targets"))]
    assert modules_loaded(pure, ("dflash.target", "dflash.data", "dflash.drafter", "dflash.evaluate", "dflash.train",
                                 "dflash.plan.configured", "dflash.plan.compose", "dflash.plan.report")) == []


def test_a_plan_key_that_does_not_parse_is_refused_naming_it(caplog):
    """world_size=eight or gpu_gb=[80,big] stop in one line naming the key and an example (they were a traceback)."""
    for arg, said in (("world_size=eight", "world_size=eight is not a number; e.g. world_size=1"),
                      ("gpu_gb=[80,big]", "gpu_gb=[80,big] is not a list of numbers; e.g. gpu_gb=[80,141]")):
        with pytest.raises(SystemExit):
            main(["experiment=qwen3_8b", arg])
        assert said in caplog.text
