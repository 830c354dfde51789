"""The same recipes on a CUDA model: device and dtype follow the model (skipped where no GPU is present).

CI has no GPU, so these run on a lent GPU machine (see the README's "GPU" section). Each test quantizes the same
float model on the CPU and on the GPU and compares: the GPU's float arithmetic differs in the last bits (other
summation orders; cuDNN convolutions may use TF32), so scales agree to a tight relative tolerance and the few codes
that sit on a rounding boundary may move by one step; everything the model holds stays on the GPU, and what leaves
it (checkpoints, ONNX files) is the same kind of file a CPU model gives.
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))

from helpers.llm_models import INT4_G32, logits, tiny_llama, token_batches, weight_only_config  # noqa: E402
from helpers.llm_recipes import RECIPES  # noqa: E402

from quark_brevitas import ModelExporter, ModelQuantizer, load_quantized, save_quantized  # noqa: E402
from quark_brevitas.brevitas_adapter import QuantLayer  # noqa: E402
from quark_brevitas.cli.digits import DigitsData, evaluate  # noqa: E402
from quark_brevitas.config import (  # noqa: E402
    AutoRoundConfig,
    Config,
    GPTQConfig,
    QronosConfig,
    QuantizationConfig,
    RotationConfig,
)
from quark_brevitas.config.presets import get_preset  # noqa: E402

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine")

CUDA = torch.device("cuda")


def _on_cuda(model: nn.Module) -> list[str]:
    """Names of the parameters and buffers NOT on the GPU (empty when everything moved)."""
    tensors = list(model.named_parameters()) + list(model.named_buffers())
    return [name for name, tensor in tensors if tensor.device.type != "cuda"]


def _codes(model: nn.Module) -> dict[str, torch.Tensor]:
    with torch.no_grad():
        return {name: layer.quant_weight().int().to(device="cpu", dtype=torch.int32)
                for name, layer in model.named_modules()
                if isinstance(layer, QuantLayer) and getattr(layer, "weight_quant", None) is not None}


def _agreement(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> tuple[float, int]:
    """(share of equal codes, largest code difference) over every quantized layer."""
    assert a.keys() == b.keys() and a
    equal = sum(int((a[k] == b[k]).sum()) for k in a)
    total = sum(a[k].numel() for k in a)
    return equal / total, max(int((a[k] - b[k]).abs().max()) for k in a)


@pytest.fixture(scope="module")
def cuda_digits(digits_model: nn.Module, digits_data: DigitsData) -> dict[str, Any]:
    """The W8A8 preset on the trained digits CNN, quantized once on the CPU and once on the GPU."""
    torch.backends.cudnn.allow_tf32 = False  # the comparison is against the CPU's float32
    cpu = ModelQuantizer(get_preset("w8a8")).quantize_model(copy.deepcopy(digits_model), digits_data.calib)
    gpu = ModelQuantizer(get_preset("w8a8")).quantize_model(copy.deepcopy(digits_model).to(CUDA), digits_data.calib)
    return {"cpu": cpu, "gpu": gpu}


def test_w8a8_on_cuda_stays_on_the_gpu_and_matches_the_cpu(cuda_digits: dict[str, Any],
                                                            digits_data: DigitsData) -> None:
    cpu, gpu = cuda_digits["cpu"], cuda_digits["gpu"]
    assert _on_cuda(gpu) == []
    share, worst = _agreement(_codes(cpu), _codes(gpu))
    assert share > 0.999 and worst <= 1, (share, worst)
    x = next(iter(digits_data.test))[0]
    with torch.no_grad():
        expected, got = cpu(x), gpu(x.to(CUDA)).cpu()
    assert float((expected - got).abs().max()) <= 0.05 * float(expected.abs().max())
    assert abs(evaluate(gpu, digits_data.test) - evaluate(cpu, digits_data.test)) <= 0.005


def test_a_cuda_model_exports_a_verified_onnx_file(cuda_digits: dict[str, Any], digits_data: DigitsData,
                                                   tmp_path: Path) -> None:
    x = next(iter(digits_data.test))[0][:8]
    report = ModelExporter(tmp_path / "gpu.onnx").export_onnx_model(cuda_digits["gpu"], x.to(CUDA))
    assert report.max_abs_diff <= report.tolerance
    assert _on_cuda(cuda_digits["gpu"]) == []  # exporting did not move the caller's model


def test_a_cuda_checkpoint_loads_on_the_cpu(cuda_digits: dict[str, Any], digits_model: nn.Module,
                                            digits_data: DigitsData, tmp_path: Path) -> None:
    gpu = cuda_digits["gpu"]
    x = next(iter(digits_data.test))[0][:8]
    save_quantized(gpu, tmp_path, example_input=x.to(CUDA))
    loaded = load_quantized(copy.deepcopy(digits_model), tmp_path)
    assert _codes(loaded).keys() == _codes(gpu).keys()
    assert all(torch.equal(a, b) for a, b in zip(_codes(loaded).values(), _codes(gpu).values()))
    with torch.no_grad():
        assert torch.allclose(loaded(x), gpu(x.to(CUDA)).cpu(), atol=1e-4, rtol=1e-4)


def test_qat_steps_on_cuda_lower_the_loss(digits_model: nn.Module, digits_data: DigitsData) -> None:
    model = ModelQuantizer(get_preset("w4a8_gptq")).quantize_model(copy.deepcopy(digits_model).to(CUDA),
                                                                  digits_data.calib)
    model.train()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    images, targets = next(iter(digits_data.train))
    images, targets = images.to(CUDA), targets.to(CUDA)
    losses = []
    for _ in range(20):
        optimizer.zero_grad()
        loss = nn.functional.cross_entropy(model(images), targets)
        loss.backward()
        optimizer.step()
        losses.append(float(loss.detach()))
    assert all(p.grad is None or p.grad.device.type == "cuda" for p in model.parameters())
    assert losses[-1] < losses[0], losses


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gptqconfig_block_by_block_on_cuda(dtype: torch.dtype) -> None:
    """GPTQConfig W4 g32 on the tiny Llama: the GPU's codes are the CPU's up to rounding-boundary ties."""
    torch.backends.cuda.matmul.allow_tf32 = False

    def config() -> Config:
        return weight_only_config(INT4_G32, GPTQConfig(sym=True, group_size=32))

    batches = token_batches()
    cpu = ModelQuantizer(config()).quantize_model(tiny_llama(2).to(dtype), batches)
    gpu = ModelQuantizer(config()).quantize_model(tiny_llama(2).to(device=CUDA, dtype=dtype), batches)
    assert _on_cuda(gpu) == []
    assert all(p.dtype == dtype for n, p in gpu.named_parameters() if "quant" not in n)
    share, _ = _agreement(_codes(cpu), _codes(gpu))
    # GPTQ carries each rounding's error into the next columns, so one flipped tie moves later codes too: on the
    # CPU alone, scaling the weights by 1 + 1e-6 noise moves about 4 % of this tiny model's codes.
    assert share > (0.95 if dtype == torch.float32 else 0.9), share
    expected, got = logits(cpu, batches[0]), logits(gpu, batches[0].to(CUDA)).cpu()
    error = float((expected - got).norm() / expected.norm())
    assert error < (1e-2 if dtype == torch.float32 else 5e-2), error


def _w4_g32(*algos: Any, pre: list[Any] | None = None) -> Config:
    return Config(QuantizationConfig(weight=INT4_G32), pre_quant_opt_config=pre or [], algo_config=list(algos),
                  exclude=["lm_head"])


#: Every LLM algorithm: the snapshot's recipes (GPTQConfig, AWQConfig, SmoothQuant W8A8, whole-model GPTQ) and the
#: low-bit ones.
LLM_RECIPES = {
    **RECIPES,
    "qronos_int4_g32": lambda: _w4_g32(QronosConfig(block_size=32)),
    "autoround_int4_g32": lambda: _w4_g32(AutoRoundConfig(iters=20, batch_size=4)),
    "rotation_gptq_int4_g32": lambda: _w4_g32(GPTQConfig(sym=True, group_size=32), pre=[RotationConfig()]),
}


@pytest.mark.parametrize("recipe", sorted(LLM_RECIPES))
def test_llm_algorithms_on_cuda(recipe: str) -> None:
    """Each algorithm on a GPU model: nothing left on the CPU, and the quantized model as close to the float model
    as the CPU's (the GPU's sums differ in the last bits, so a choice near a tie -- an AWQ ratio, a code on a rounding
    boundary -- may differ)."""
    torch.backends.cuda.matmul.allow_tf32 = False
    batches = token_batches()
    reference = logits(tiny_llama(2), batches[0])
    cpu = ModelQuantizer(LLM_RECIPES[recipe]()).quantize_model(tiny_llama(2), batches)
    gpu = ModelQuantizer(LLM_RECIPES[recipe]()).quantize_model(tiny_llama(2).to(CUDA), batches)
    assert _on_cuda(gpu) == []
    share, _ = _agreement(_codes(cpu), _codes(gpu))
    assert share > 0.8, share  # error feedback amplifies last-bit differences (Qronos: 7 % of codes on the CPU alone)
    cpu_error = float((logits(cpu, batches[0]) - reference).norm() / reference.norm())
    gpu_error = float((logits(gpu, batches[0].to(CUDA)).cpu() - reference).norm() / reference.norm())
    assert gpu_error <= 1.2 * cpu_error + 1e-4, (gpu_error, cpu_error)
