"""heron/config.py: the defaults that depend on the device."""

from types import SimpleNamespace

import pytest
import torch

from heron.config import SchedulerConfig, default_max_num_seqs

GiB = 2**30


@pytest.mark.parametrize(
    ("name", "memory", "seqs"),
    [
        ("NVIDIA H200", 140 * GiB, 512),
        ("NVIDIA H100 80GB HBM3", 79 * GiB, 512),
        ("NVIDIA A100-SXM4-80GB", 79 * GiB, 256),  # as vLLM's: larger defaults were slower there
        ("NVIDIA L4", 22 * GiB, 256),
    ],
)
def test_max_num_seqs_by_gpu(monkeypatch, name: str, memory: int, seqs: int) -> None:
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda _: SimpleNamespace(name=name, total_memory=memory))
    assert default_max_num_seqs(torch.device("cuda", 0)) == seqs


def test_max_num_seqs_is_256_on_the_cpu() -> None:
    assert default_max_num_seqs(torch.device("cpu")) == 256


def test_max_num_seqs_left_to_the_device_or_at_least_one() -> None:
    SchedulerConfig().verify()  # None: chosen by the engine for its device
    with pytest.raises(ValueError, match="max_num_seqs must be at least 1"):
        SchedulerConfig(max_num_seqs=0).verify()
