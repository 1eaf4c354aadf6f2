"""`usable_device`: a device this machine lacks is one ValueError naming it, what torch sees
and what to pass, whatever the machine (torch's CUDA answers are stood in for)."""

from __future__ import annotations

import pytest
import torch

from pdserve.engine.device import usable_device


@pytest.fixture
def gpus(monkeypatch):
    """Make torch report a CUDA build with `n` GPUs."""
    def have(n: int) -> None:
        monkeypatch.setattr(torch.backends.cuda, "is_built", lambda: True)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: n)
    return have


def test_the_cpu_is_always_usable():
    assert usable_device("cpu") == torch.device("cpu")


@pytest.mark.parametrize("name", ["gpu", "cuda:", "cuda:x", "CPU", "cuda:-1", "", None])
def test_a_malformed_device_names_the_forms(name):
    with pytest.raises(ValueError, match=r"device must be cpu, cuda or cuda:N, got"):
        usable_device(name)


def test_cuda_on_a_torch_without_cuda_says_to_use_the_cpu(monkeypatch):
    monkeypatch.setattr(torch.backends.cuda, "is_built", lambda: False)
    with pytest.raises(ValueError, match=r"device cuda needs a CUDA build of torch.*--device cpu"):
        usable_device("cuda")


def test_cuda_with_no_gpu_in_sight_says_to_use_the_cpu(gpus):
    gpus(0)
    with pytest.raises(ValueError, match=r"device cuda:0: torch sees no GPU here.*--device cpu"):
        usable_device("cuda:0")


@pytest.mark.parametrize("n, name, have", [(1, "cuda:1", r"1 GPU \(cuda:0\)"),
                                           (2, "cuda:7", r"2 GPUs \(cuda:0 to cuda:1\)")])
def test_a_gpu_past_the_count_names_the_ones_there(gpus, n, name, have):
    gpus(n)
    with pytest.raises(ValueError, match=rf"device {name} is not here: torch sees {have}; pass one of those"):
        usable_device(name)


def test_a_gpu_in_range_is_usable(gpus):
    gpus(2)
    assert usable_device("cuda") == torch.device("cuda")
    assert usable_device("cuda:1") == torch.device("cuda", 1)
