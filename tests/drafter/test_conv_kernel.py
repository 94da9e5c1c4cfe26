"""train.conv_kernel: which convolution DFlash 2 trains with (dflash.drafter.build.use_conv_kernel), and on CUDA the
Triton kernels (dflash/drafter/conv_kernel.py) against the torch path. The same comparison runs on CPU under
Triton's interpreter in `make engines` (bench/engines/conv_check.py): the main venv has no triton."""

import sys
import types

import pytest
import torch

from dflash.config import TrainConfig
from dflash.drafter import build
from dflash.drafter.dflash2 import GroupedDynamicConv, grouped_dynamic_conv
from dflash.errors import ConfigError
from tests.drafter.test_dflash2 import make_dflash2
from tests.drafter.test_model import make_drafter

CPU = torch.device("cpu")


def convs(model):
    return [m for m in model.modules() if isinstance(m, GroupedDynamicConv)]


def test_the_key_takes_three_values():
    with pytest.raises(ConfigError, match="train.conv_kernel"):
        TrainConfig(conv_kernel="cuda")


def test_on_a_cpu_auto_keeps_the_torch_path_and_triton_is_refused_with_the_fix(monkeypatch, caplog):
    model = make_dflash2()
    caplog.set_level("INFO", logger="dflash.drafter.build")
    assert build.use_conv_kernel(model, "auto", CPU) == "torch"
    assert "train.conv_kernel=auto: torch" in caplog.text
    assert all(c.conv is grouped_dynamic_conv for c in convs(model))
    with pytest.raises(ConfigError, match="train.conv_kernel=triton cannot run here: .*set train.conv_kernel=torch"):
        build.use_conv_kernel(model, "triton", CPU)
    assert build.use_conv_kernel(model, "torch", CPU) == "torch"
    assert build.use_conv_kernel(make_drafter(), "auto", CPU) == "auto"  # DFlash: no convolution to choose


def test_train_py_refuses_triton_on_a_cpu_before_any_work(tmp_path):
    """train.conv_kernel=triton on a CPU stops at the start of train.py, naming the fix, before data or extraction
    (nothing is written under run.root)."""
    from dflash.train.loop import train
    from tests.train.test_loop import job_for

    job = job_for(tmp_path, "refused", "drafter.kind=dflash2", "train.conv_kernel=triton")
    with pytest.raises(ConfigError, match="train.conv_kernel=triton cannot run here: .*set train.conv_kernel=torch"):
        train(job)
    assert not (tmp_path / "runs").exists() and not (tmp_path / "cache").exists()


@pytest.mark.parametrize("why", ["triton is not installed", "the kernels run on CUDA and the drafter trains on cpu",
                                 "conv_group_size=12 is not a power of two"])
def test_each_reason_the_kernel_cannot_run_is_named(monkeypatch, why):
    import importlib.util

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    found = None if why.startswith("triton") else object()
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: found)
    device = torch.device("cuda") if "power of two" in why else CPU
    assert why in build._conv_kernel_blocker(12 if "power" in why else 16, device)


def test_where_the_kernel_can_run_every_convolution_goes_through_it(monkeypatch):
    """auto picks the kernel module's function for every convolution of the drafter, and the forward calls it (a
    stand-in module here: the real one needs triton)."""
    calls = []

    def kernel(*args):
        calls.append(args[-1])
        return grouped_dynamic_conv(*args)

    monkeypatch.setitem(sys.modules, "dflash.drafter.conv_kernel", types.SimpleNamespace(grouped_dynamic_conv=kernel))
    monkeypatch.setattr(build, "_conv_kernel_blocker", lambda group_size, device: None)
    model = make_dflash2()
    assert build.use_conv_kernel(make_dflash2(), "auto", CPU, compiled=True) == "torch"  # inductor fuses torch's
    assert build.use_conv_kernel(model, "auto", CPU) == "triton"
    assert all(c.conv is kernel for c in convs(model)) and len(convs(model)) == 4
    from tests.drafter.test_model import inputs

    with torch.no_grad():
        model(*inputs())
    assert len(calls) == 2 * len(convs(model))  # each convolution's two passes (around the sublayer)


needs_triton_cuda = pytest.mark.skipif(
    not torch.cuda.is_available() or build._conv_kernel_blocker(16, torch.device("cuda")) is not None,
    reason="needs CUDA and triton")


@pytest.mark.gpu
@needs_triton_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_triton_convolution_equals_the_torch_path_at_the_27b_shape(dtype):
    """Qwen3.6-27B's DFlash 2 drafter (hidden 5120, groups of 16, k = 2, 512 blocks of 8): the forward and the three
    gradients by bench.dflash2_conv's rule (the conv check's, which runs the kernels interpreted on CPU)."""
    from bench.dflash2_conv import QWEN3_6_27B, compare
    from dflash.drafter import conv_kernel

    row = compare(conv_kernel.grouped_dynamic_conv, grouped_dynamic_conv, QWEN3_6_27B, dtype, torch.device("cuda"))
    assert row["ok"], row
