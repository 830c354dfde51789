"""Checkpoints and exports of every preset on the digits CNN and every LLM recipe on a tiny Llama, both ways,
against digests recorded before the block-by-block path and the in-memory path became one pipeline (issue 28).

Both ways: *in memory* is ``ModelQuantizer.quantize_model`` (which walks the Llama's blocks itself), then
``save_quantized`` and the exporters of a model; *block by block* is ``quantize_pretrained`` from the model's
Hugging Face folder, then the exporters of a streamed checkpoint. The digits CNN has no block stack, so it runs
in memory only. What is compared is the SHA-256 of every tensor (name, dtype, shape and bytes) of each checkpoint
and each exported file, read back from disk; file metadata that holds paths, versions or times is left out on
purpose (a checkpoint's manifest records library versions, an ONNX file its producer), the tensors are the
result. ``PYTHONPATH=. python tests/orchestration/test_one_pipeline_snapshot.py`` from the repository root
re-records the digests (only ever from code known to be right).
"""

from __future__ import annotations

import hashlib
import json
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")
pytest.importorskip("gguf")

from helpers.llm_models import tiny_llama, token_batches  # noqa: E402

from quark_brevitas.api import ModelExporter, ModelQuantizer  # noqa: E402
from quark_brevitas.checkpoint import read_weights, save_quantized  # noqa: E402
from quark_brevitas.config import (  # noqa: E402
    AutoRoundConfig,
    AWQConfig,
    Config,
    GPTQConfig,
    QronosConfig,
    QuantizationConfig,
    QuantizationSpec,
    RotationConfig,
    SmoothQuantConfig,
)
from quark_brevitas.config.enums import Dtype, QSchemeType, ScaleType  # noqa: E402
from quark_brevitas.config.presets import get_preset  # noqa: E402
from quark_brevitas.export import export_gguf, export_safetensors  # noqa: E402
from quark_brevitas.hf.export_streamed import export_gguf_streamed, export_safetensors_streamed  # noqa: E402
from quark_brevitas.hf.streaming import quantize_pretrained  # noqa: E402

SNAPSHOT = Path(__file__).resolve().parents[1] / "data" / "one_pipeline_digests.json"

#: The digits presets (the LLM, BERT and GGUF presets quantize Linear layers of transformers only).
CNN_PRESETS = ("w8a8", "w8a8_per_channel", "w4a8_gptq", "w4_weight_only", "fp8", "finn_w8a8", "finn_w4a4",
               "finn_w2a2")
#: Presets whose model exports to ONNX QCDQ (FINN's bit widths export to QONNX, FP8 to neither).
CNN_QCDQ = ("w8a8", "w8a8_per_channel", "w4a8_gptq", "w4_weight_only")
INT8_CHANNEL = QuantizationSpec(qscheme=QSchemeType.per_channel)
#: GGUF Q4_0's grid (int4 per group of 32, float16 scales, codes -8..7), as the preset ``gguf_q4_0`` sets it.
Q4_0 = QuantizationSpec(dtype=Dtype.int4, qscheme=QSchemeType.per_group, group_size=32, scale_type=ScaleType.float16,
                        narrow_range=False)


def _llm(algo: list[Any] | None = None, pre: list[Any] | None = None, weight: QuantizationSpec = Q4_0,
         act: QuantizationSpec | None = None) -> Config:
    return Config(QuantizationConfig(weight=weight, input_tensors=act), pre_quant_opt_config=pre or [],
                  algo_config=algo or [], exclude=["lm_head"])


#: Every LLM recipe the command line and the templates offer, on GGUF Q4_0's grid (
#: each is exported to GGUF too) except SmoothQuant's W8A8 (compressed-tensors and Quark only).
LLM_RECIPES: dict[str, Callable[[], Config]] = {
    "rtn": lambda: _llm(),
    "gptq": lambda: _llm([GPTQConfig(sym=True, group_size=32)]),
    "awq": lambda: _llm([AWQConfig(group_size=32)]),
    "smoothquant": lambda: _llm(pre=[SmoothQuantConfig(alpha=0.5)], weight=INT8_CHANNEL, act=QuantizationSpec()),
    "rotation_gptq": lambda: _llm([RotationConfig(r1=True, r2=True, random_r1=True),
                                   GPTQConfig(sym=True, group_size=32)]),
    "qronos": lambda: _llm([QronosConfig()]),
    "autoround": lambda: _llm([AutoRoundConfig(iters=4, batch_size=2)]),
}
NO_GGUF = ("smoothquant",)


# ===================================================================== digests
def tensor_digest(tensor: torch.Tensor) -> str:
    """SHA-256 of a tensor's dtype, shape and bytes (row-major)."""
    data = tensor.detach().cpu().contiguous()
    head = f"{data.dtype}|{list(data.shape)}|".encode()
    raw = data.reshape(-1).view(torch.uint8).numpy().tobytes() if data.numel() else b""
    return hashlib.sha256(head + raw).hexdigest()


def digests(tensors: dict[str, torch.Tensor]) -> dict[str, str]:
    return {name: tensor_digest(tensors[name]) for name in sorted(tensors)}


def safetensors_folder(folder: Path) -> dict[str, str]:
    """Every tensor of every safetensors file of an exported folder, and its ``quantization_config``."""
    from safetensors.torch import load_file

    tensors: dict[str, torch.Tensor] = {}
    for path in sorted(folder.glob("*.safetensors")):
        tensors.update(load_file(str(path)))
    found = digests(tensors)
    quantization = json.loads((folder / "config.json").read_text()).get("quantization_config")
    found["config.json:quantization_config"] = hashlib.sha256(
        json.dumps(quantization, sort_keys=True).encode()).hexdigest()
    return found


def gguf_file(path: Path) -> dict[str, str]:
    """Every tensor of a GGUF file (its type, shape and stored bytes) and the file's key-value metadata."""
    from gguf import GGUFReader

    reader = GGUFReader(str(path))
    found = {f"{t.name}:{t.tensor_type.name}": hashlib.sha256(
        f"{list(t.shape)}|".encode() + bytes(t.data.tobytes())).hexdigest() for t in reader.tensors}
    fields = {name: [bytes(part.tobytes()).hex() for part in (field.parts[i] for i in field.data)]
              for name, field in reader.fields.items()}
    found["metadata"] = hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()
    return found


def onnx_file(path: Path) -> dict[str, str]:
    """Every initializer of an ONNX file and its nodes' operator types in order."""
    import onnx
    from onnx import numpy_helper

    model = onnx.load(str(path))
    found = {f"init:{i.name}": hashlib.sha256(numpy_helper.to_array(i).tobytes()).hexdigest()
             for i in model.graph.initializer}
    found["nodes"] = hashlib.sha256("|".join(n.op_type for n in model.graph.node).encode()).hexdigest()
    return found


# ===================================================================== runs
def cnn_run(preset: str, model: torch.nn.Module, calib: list[torch.Tensor], tmp: Path) -> dict[str, dict[str, str]]:
    quantized = ModelQuantizer(get_preset(preset)).quantize_model(model, calib)
    out = save_quantized(quantized, tmp / f"{preset}-ckpt")
    found = {"checkpoint": digests(read_weights(out))}
    if preset in CNN_QCDQ:
        onnx_path = tmp / f"{preset}.onnx"
        ModelExporter(onnx_path).export("qcdq", quantized, calib[0][:1])
        found["qcdq"] = onnx_file(onnx_path)
    return found


def llm_exports(recipe: str, write: Callable[[str, Path], Path], tmp: Path) -> Iterator[tuple[str, dict[str, str]]]:
    for fmt in ("compressed-tensors", "quark"):
        yield fmt, safetensors_folder(write(fmt, tmp / fmt))
    if recipe not in NO_GGUF:
        yield "gguf", gguf_file(write("gguf", tmp / "gguf"))


def llm_in_memory(recipe: str, folder: Path, calib: list[torch.Tensor], tmp: Path) -> dict[str, dict[str, str]]:
    float_model = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    quantized = ModelQuantizer(LLM_RECIPES[recipe]()).quantize_model(float_model, calib)
    found = {"checkpoint": digests(read_weights(save_quantized(quantized, tmp / "ckpt")))}

    def write(fmt: str, out: Path) -> Path:
        if fmt == "gguf":
            return export_gguf(quantized, out)
        return export_safetensors(quantized, out, fmt)

    found.update(llm_exports(recipe, write, tmp))
    return found


def llm_block_by_block(recipe: str, folder: Path, calib: list[torch.Tensor], tmp: Path) -> dict[str, dict[str, str]]:
    checkpoint = quantize_pretrained(folder, LLM_RECIPES[recipe](), calib, tmp / "ckpt")
    found = {"checkpoint": digests(read_weights(checkpoint))}

    def write(fmt: str, out: Path) -> Path:
        if fmt == "gguf":
            return export_gguf_streamed(checkpoint, out)
        return export_safetensors_streamed(checkpoint, out, fmt)

    found.update(llm_exports(recipe, write, tmp))
    return found


def llama_folder(tmp: Path) -> Path:
    folder = tmp / "llama"
    tiny_llama(2).save_pretrained(folder)
    return folder


def llm_calibration() -> list[torch.Tensor]:
    return token_batches(count=2, batch=2, length=16)


def cnn_calibration(loader: Any) -> list[torch.Tensor]:
    images = [images for images, _ in loader]
    return [images[0][:32], images[1][:32]]


# ===================================================================== tests
@pytest.fixture(scope="module")
def recorded() -> dict[str, Any]:
    return json.loads(SNAPSHOT.read_text())


def _same(found: dict[str, dict[str, str]], expected: dict[str, dict[str, str]], label: str) -> None:
    assert sorted(found) == sorted(expected), f"{label}: artefacts {sorted(found)} != {sorted(expected)}"
    for artefact, tensors in expected.items():
        assert found[artefact].keys() == tensors.keys(), f"{label} {artefact}: other tensors"
        different = [name for name in tensors if found[artefact][name] != tensors[name]]
        assert not different, f"{label} {artefact}: {len(different)} tensors differ, first {different[:3]}"


@pytest.mark.slow
def test_every_digits_preset_gives_the_recorded_checkpoint_and_export(recorded, digits_model, digits_data,
                                                                      tmp_path) -> None:
    calib = cnn_calibration(digits_data.calib)
    for preset in CNN_PRESETS:
        _same(cnn_run(preset, digits_model, calib, tmp_path), recorded["cnn"][preset], f"cnn {preset}")


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory) -> Path:
    torch.set_num_threads(1)
    return llama_folder(tmp_path_factory.mktemp("one-pipeline"))


@pytest.mark.slow
@pytest.mark.parametrize("recipe", list(LLM_RECIPES))
def test_every_llm_recipe_gives_the_recorded_checkpoint_and_exports_both_ways(recipe, recorded, llama_dir,
                                                                               tmp_path) -> None:
    calib = llm_calibration()
    expected = recorded["llm"][recipe]
    _same(llm_in_memory(recipe, llama_dir, calib, tmp_path / "memory"), expected["in_memory"],
          f"{recipe} in memory")
    _same(llm_block_by_block(recipe, llama_dir, calib, tmp_path / "blocks"), expected["block_by_block"],
          f"{recipe} block by block")
    # One pipeline: the two ways are the same run from different block sources into different sinks.
    assert expected["in_memory"] == expected["block_by_block"]


def record() -> None:
    """Write :data:`SNAPSHOT` from the code as it is (run from the repository root)."""
    import tempfile

    from quark_brevitas.cli.digits import load_digits_data, train_digits_cnn

    torch.set_num_threads(1)
    snapshot: dict[str, Any] = {"cnn": {}, "llm": {}}
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        data = load_digits_data()
        model = train_digits_cnn(data)
        calib = cnn_calibration(data.calib)
        for preset in CNN_PRESETS:
            snapshot["cnn"][preset] = cnn_run(preset, model, calib, tmp / "cnn")
        folder = llama_folder(tmp)
        for recipe in LLM_RECIPES:
            snapshot["llm"][recipe] = {
                "in_memory": llm_in_memory(recipe, folder, llm_calibration(), tmp / recipe / "memory"),
                "block_by_block": llm_block_by_block(recipe, folder, llm_calibration(), tmp / recipe / "blocks"),
            }
    SNAPSHOT.write_text(json.dumps(snapshot, indent=0, sort_keys=True) + "\n")
    print(f"wrote {SNAPSHOT}")


if __name__ == "__main__":
    record()
