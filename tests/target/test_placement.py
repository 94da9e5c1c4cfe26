"""The target's size from its config, and the check that it fits a device."""

import pytest
import torch

from dflash.errors import ConfigError
from dflash.target import placement
from dflash.target.placement import GiB


def test_parameter_count_is_the_loaded_models(tiny_target):
    """Counted on the meta device from the config alone: the loaded model's count (tied weights once)."""
    loaded = sum(p.numel() for p in tiny_target.model.parameters())
    assert placement.parameter_count(tiny_target.model.config) == loaded


def test_fit_check_refuses_naming_the_figures_and_passes_when_it_fits(monkeypatch):
    device = torch.device("cuda", 3)
    parts = {"target t": (50 * GiB, "25 B parameters x 2 bytes"), "drafter and optimizer": (34 * GiB, "its state")}
    monkeypatch.setattr(placement, "device_memory", lambda d: 79.2 * GiB if d == device else None)
    with pytest.raises(ConfigError) as refused:
        placement.check_fits(device, parts, why="it must all be there", fix="Do this instead.")
    message = str(refused.value)
    assert message.startswith("it must all be there, and that does not fit cuda:3: target t 50.0 GiB (25 B "
                              "parameters x 2 bytes) + drafter and optimizer 34.0 GiB (its state) + 2.0 GiB")
    assert "= 86.0 GiB, more than the device's 79.2 GiB" in message and message.endswith("Do this instead.")
    placement.check_fits(device, {"target t": (50 * GiB, "")}, why="", fix="")  # 52 GiB fit
    placement.check_fits(torch.device("cpu"), parts, why="", fix="")  # host memory: not checked


def test_device_memory_is_only_known_for_cuda():
    assert placement.device_memory(torch.device("cpu")) is None
    assert placement.device_memory(torch.device("meta")) is None


def test_small_sizes_are_not_printed_as_zero():
    assert placement.gib(3 * GiB // 2) == "1.5 GiB" and placement.gib(2**20) == "0.000977 GiB"
