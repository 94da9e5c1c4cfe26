"""bench/gpu/profile.py: the classes of kernel and op names, and one step's profile by class (on CPU, a tiny
drafter's step; the GPU check records the same at the Qwen3.6-27B drafter's size)."""

import pytest
import torch

from bench.gpu.profile import CLASSES, classify, classify_in, profile_step, summarize


@pytest.mark.parametrize("name, cls", [
    # CPU ops
    ("aten::mm", "matmul"), ("aten::addmm", "matmul"), ("aten::bmm", "matmul"), ("aten::matmul", "matmul"),
    ("aten::linear", "matmul"), ("aten::scaled_dot_product_attention", "attention"),
    ("aten::_scaled_dot_product_flash_attention_for_cpu", "attention"), ("aten::cross_entropy_loss", "loss"),
    ("aten::_log_softmax", "loss"), ("aten::nll_loss_nd", "loss"), ("Optimizer.step#AdamW.step", "optimizer"),
    ("aten::_foreach_norm", "optimizer"), ("aten::_fused_adamw_", "optimizer"), ("aten::mul", "elementwise"),
    ("aten::add_", "elementwise"), ("aten::silu", "elementwise"), ("aten::copy_", "elementwise"),
    ("aten::_fused_rms_norm", "elementwise"), ("aten::empty", "other"), ("aten::view", "other"),
    ("c10d::allreduce_", "communication"),
    # CUDA kernels
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1", "matmul"),
    ("nvjet_tst_128x256_64x4_1x2_h_bz_coopA_TNT", "matmul"),
    ("void cutlass::Kernel2<cutlass_80_tensorop_bf16_s16816gemm_relu_bf16_64x64_64x4_tn_align8>", "matmul"),
    ("triton_tem_fused_0", "attention"), ("triton_tem_fused_zeros_1", "attention"),
    ("void flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128, 128, 64, 4>>", "attention"),
    ("void cutlass::device_kernel<flash::FlashAttnFwdSm90<...>>", "attention"),
    ("void at::native::(anonymous namespace)::cunn_SoftMaxForward<4, float, float, float, "
     "at::native::(anonymous namespace)::LogSoftMaxForwardEpilogue>", "loss"),
    ("void at::native::nll_loss_forward_reduce_cuda_kernel_2d<float, float, long>", "loss"),
    ("void at::native::(anonymous namespace)::multi_tensor_apply_kernel<FusedAdamMathFunctor<float, 4>>",
     "optimizer"),
    ("ncclDevKernel_AllReduce_Sum_bf16_RING_LL(ncclDevKernelArgsStorage<4096ul>)", "communication"),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<float>>", "elementwise"),
    ("triton_poi_fused__to_copy_mul_0", "elementwise"), ("triton_red_fused_add_mean_pow_1", "elementwise"),
    ("Memcpy DtoD (Device -> Device)", "elementwise"), ("Memset (Device)", "elementwise"),
    ("void at::native::index_elementwise_kernel<128, 4>", "elementwise"), ("some_custom_kernel", "other"),
])
def test_kernel_and_op_names_map_to_their_class(name, cls):
    assert classify(name) == cls


def test_an_enclosing_op_gives_its_class_and_the_name_comes_next():
    """Ops and kernels under AdamW's step are the optimizer's, under an sdpa attention's, the loss's under
    cross entropy; elsewhere a kernel is classed by its name, then by the op that launched it."""
    assert classify_in("aten::mul", ["Optimizer.step#AdamW.step"]) == "optimizer"
    assert classify_in("aten::_softmax", ["aten::_scaled_dot_product_attention_math",
                                          "aten::scaled_dot_product_attention"]) == "attention"
    assert classify_in("aten::exp", ["aten::_log_softmax", "aten::log_softmax", "aten::cross_entropy_loss"]) == "loss"
    assert classify_in("some_custom_kernel", ["aten::mm", "aten::linear"]) == "matmul"
    assert classify_in("sm90_xmma_gemm_bf16", ["aten::mm", "autograd::engine::evaluate_function: MmBackward0"]) \
        == "matmul"
    assert classify_in("aten::view", []) == "other"


def test_summarize_sums_classes_and_ranks_names():
    out = summarize([("aten::mm", 600.0, "matmul"), ("aten::mm", 400.0, "matmul"), ("aten::add", 500.0, "elementwise"),
                     ("aten::view", 500.0, "other")], step_ms=2.5, top=2)
    assert out["total_ms"] == 2.0 and out["step_ms"] == 2.5 and set(out["classes"]) == set(CLASSES)
    assert out["classes"]["matmul"] == {"ms": 1.0, "share": 0.5} and out["classes"]["loss"] == {"ms": 0.0, "share": 0}
    assert out["top"][0] == {"name": "aten::mm", "ms": 1.0, "calls": 2, "class": "matmul"} and len(out["top"]) == 2


def _check_profile_shape(p: dict, device: str):
    assert p["activity"] == device and "error" not in p, p
    assert set(p["classes"]) == set(CLASSES)
    assert sum(v["ms"] for v in p["classes"].values()) == pytest.approx(p["total_ms"], rel=1e-3, abs=0.01)
    assert sum(v["share"] for v in p["classes"].values()) == pytest.approx(1, abs=2e-3)
    assert 0 < p["total_ms"] <= p["step_ms"] * 1.05  # the ops' self times cover the step at most once
    assert 1 <= len(p["top"]) <= 10 and all(t["class"] in CLASSES for t in p["top"])
    assert [t["ms"] for t in p["top"]] == sorted((t["ms"] for t in p["top"]), reverse=True)
    assert p["seconds"] >= p["step_ms"] / 1e3


def test_a_small_training_step_profiled_on_cpu():
    """A linear, an sdpa, a cross entropy and AdamW: each in its class, the classes summing to the total."""
    torch.manual_seed(0)
    lin = torch.nn.Linear(64, 64)
    opt = torch.optim.AdamW(lin.parameters(), foreach=True)
    x, y = torch.randn(2, 4, 32, 64), torch.randint(0, 64, (2 * 4 * 32,))

    def step():
        h = lin(x)
        a = torch.nn.functional.scaled_dot_product_attention(h, h, h)
        loss = torch.nn.functional.cross_entropy(torch.nn.functional.silu(a + h).reshape(-1, 64), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()
    p = profile_step(step, torch.device("cpu"))
    _check_profile_shape(p, "cpu")
    for cls in ("matmul", "attention", "loss", "optimizer", "elementwise"):
        assert p["classes"][cls]["ms"] > 0, (cls, p)
    assert p["classes"]["communication"]["ms"] == 0


@pytest.mark.parametrize("kind", ["dflash", "dflash2"])
def test_the_preset_step_records_its_profile(tiny_targets, kind):
    """qwen3_6_step's and qwen3_6_dflash2_step's code path at a tiny size: the result's `profile` and the
    verdict's line about it; with no budget left the profile is skipped and says so."""
    from bench.gpu.steps import preset_step
    from bench.gpu.verdicts import preset_verdict

    overrides = ["target=tiny_qwen3", "drafter=tiny", "drafter.layer_types=[sliding_attention,full_attention]",
                 "drafter.sliding_window=64", "train.attention=sdpa", "train.mixed_precision=no",
                 "train.num_anchors=8", "data.max_length=128", f"drafter.kind={kind}", "drafter.selector_rank=32"]
    out = preset_step(torch.device("cpu"), overrides, repeat=1, budget_s=600)
    p = out["profile"]
    _check_profile_shape(p, "cpu")
    for cls in ("matmul", "attention", "loss", "optimizer", "elementwise"):
        assert p["classes"][cls]["ms"] > 0, (cls, p)
    summary = preset_verdict(out)["summary"]
    assert "; profile (cpu " in summary and "matmul " in summary, summary
    spent = preset_step(torch.device("cpu"), overrides, repeat=1, budget_s=1)
    assert "budget left" in spent["profile"]["skipped"] and "classes" not in spent["profile"]
    assert "profile: " in preset_verdict(spent)["summary"]

