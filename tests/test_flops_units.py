"""Model FLOPs utilisation: the FLOPs a sample (a model's own formula, or counted), a
device's peak (a GPU's datasheet, a measured and cached CPU matmul, ``trainer.peak_flops``)
and the MFU of a training loop."""

from __future__ import annotations

import json
import time

import pytest
import torch
from torch import nn

from ddp_utils import flops
from ddp_utils.flops import (
    Utilisation,
    counting,
    gpu_peak_flops,
    peak_flops,
    training_flops_per_sample,
)
from ddp_utils.models.gpt import GPT

CPU = torch.device("cpu")


@pytest.fixture(autouse=True)
def own_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))


def test_the_gpts_flops_are_nanogpts_count_and_what_torch_counts():
    """nanoGPT's estimate (6 a parameter and token, the position table left out, and 12 x
    layers x width x block a token for attention) equals 3 x the forward's counted FLOPs,
    and the counted forward and backward (whose attention backward counts 5 products, not
    4), within 2%."""
    layers, heads, width, block = 4, 4, 128, 64
    model = GPT(vocab_size=128, block_size=block, n_layer=layers, n_head=heads, n_embd=width)
    n = sum(p.numel() for p in model.parameters()) - model.wpe.weight.numel()
    analytic = (6 * n + 12 * layers * heads * (width // heads) * block) * block
    assert model.flops_per_sample() == analytic
    x = torch.zeros(2, block, dtype=torch.long)
    with counting() as forward:
        model(x)
    with counting() as both:
        model(x).sum().backward()
    assert training_flops_per_sample(model, forward.get_total_flops() / 2) == analytic
    for counted in (3 * forward.get_total_flops() / 2, both.get_total_flops() / 2):
        assert abs(counted / analytic - 1) < 0.02, (counted, analytic)


def test_a_model_without_a_formula_counts_three_forwards():
    model = nn.Linear(64, 32, bias=False)
    with counting() as forward:
        model(torch.zeros(5, 64))
    assert forward.get_total_flops() == 2 * 5 * 64 * 32
    assert training_flops_per_sample(model, forward.get_total_flops() / 5) == 3 * 2 * 64 * 32


def matmul_mfu(width: int, steps: int = 20, batch: int = 256) -> float:
    """The MFU of SGD steps of one square matmul layer, as a run computes it."""
    torch.manual_seed(0)
    model = nn.Linear(width, width, bias=False)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(batch, width, requires_grad=True)  # a layer inside a model: 3 products
    with counting() as forward:
        model(x)
    usage = Utilisation(training_flops_per_sample(model, forward.get_total_flops() / batch),
                        *peak_flops(CPU, "32", None), world_size=1)  # fmt: skip
    for _ in range(3):  # warm-up
        model(x).square().mean().backward()
    start = time.perf_counter()
    for _ in range(steps):
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
    return usage.of(steps * batch / (time.perf_counter() - start))


def test_a_matmul_reports_a_plausible_mfu_higher_for_a_larger_one():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        small, large = matmul_mfu(16), matmul_mfu(512)
    finally:
        torch.set_num_threads(threads)
    print(f"mfu: {small:.3f} at 16 x 16, {large:.3f} at 512 x 512")
    assert 0 < small < large < 1


def test_a_cpus_peak_is_measured_once_and_cached(monkeypatch, tmp_path):
    calls = []

    def measure(device, dtype, seconds):
        calls.append(dtype)
        return 1.5e11

    monkeypatch.setattr(flops, "measure_matmul_flops", measure)
    monkeypatch.setattr(flops, "busy", lambda: 0.0)
    assert peak_flops(CPU, "32", None) == (1.5e11, "a matmul measured on this machine")
    assert peak_flops(CPU, "32", None)[0] == 1.5e11
    assert peak_flops(CPU, "bf16", None)[0] == 1.5e11
    assert calls == [torch.float32, torch.bfloat16]  # once a dtype
    cached = json.loads((tmp_path / "cache" / "ddp-recipes" / "peak_flops.json").read_text())
    assert len(cached) == 2 and all("threads" in key for key in cached)
    assert peak_flops(CPU, "32", 2e12) == (2e12, "trainer.peak_flops")


def test_gpu_peaks_come_from_the_datasheet_table():
    assert gpu_peak_flops("NVIDIA H100 80GB HBM3", "bf16", True) == 989e12
    assert gpu_peak_flops("NVIDIA H100 PCIe", "bf16", True) == 756e12
    assert gpu_peak_flops("NVIDIA A100-SXM4-80GB", "32", True) == 156e12  # TF32
    assert gpu_peak_flops("NVIDIA A100-SXM4-80GB", "32", False) == 19.5e12
    assert gpu_peak_flops("NVIDIA L4", "fp16", False) == 121e12
    assert gpu_peak_flops("Some Future GPU", "bf16", True) is None  # then measured


def test_a_peak_measured_on_a_busy_machine_is_measured_again_when_it_is_quieter(
    monkeypatch, tmp_path
):
    speeds, load = iter([1e10, 2e11, 1e11]), {"now": 2.0}
    monkeypatch.setattr(flops, "measure_matmul_flops", lambda d, t, s: next(speeds))
    monkeypatch.setattr(flops, "busy", lambda: load["now"])
    assert peak_flops(CPU, "32", None)[0] == 1e10  # all cores busy: every round slow
    assert peak_flops(CPU, "32", None)[0] == 1e10  # still as busy: kept
    load["now"] = 0.1
    assert peak_flops(CPU, "32", None)[0] == 2e11  # quieter: measured again, the faster kept
    assert peak_flops(CPU, "32", None)[0] == 2e11  # measured on a quiet machine: kept
    # a cache written before the load was kept is measured again once, the faster kept
    path = tmp_path / "cache" / "ddp-recipes" / "peak_flops.json"
    key = next(iter(json.loads(path.read_text())))
    path.write_text(json.dumps({key: 3e11}))
    assert peak_flops(CPU, "32", None)[0] == 3e11
    assert json.loads(path.read_text())[key] == {"flops": 3e11, "load": 0.1}
