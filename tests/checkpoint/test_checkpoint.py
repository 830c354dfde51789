"""Tests of quark_brevitas.checkpoint: save_quantized / load_quantized, and the CLI's export from a checkpoint.

Done-when checks: a quantized model saved and loaded (also in a fresh process) gives bit-identical
outputs without calibration data; a checkpoint that does not fit the model names the first
mismatch; QAT and PTQ continue from a loaded checkpoint exactly as from the original model.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

from quark_brevitas import (
    DEFAULT_LAYER_MAP,
    CheckpointError,
    Config,
    Container,
    LayerMapping,
    ModelQuantizer,
    QLayerConfig,
    QTensorConfig,
    QuantType,
    algos,
    load_quantized,
    save_quantized,
)
from quark_brevitas.algorithms import apply_algorithm
from quark_brevitas.checkpoint import CONFIG_ATTRIBUTE, read_checkpoint
from quark_brevitas.cli import main
from quark_brevitas.cli.digits import DigitsCNN, example_input
from quark_brevitas.outputs import MARKER_FILE
from quark_brevitas.types import Dtype, QSchemeType, RoundType, ZeroPointType

W8A8 = QLayerConfig(weight=QTensorConfig(), input_tensors=QTensorConfig(), bias=QTensorConfig(bit_width=32))
W4PC_ASYM = QLayerConfig(weight=QTensorConfig(bit_width=4, qscheme=QSchemeType.per_channel, symmetric=False),
                         input_tensors=QTensorConfig(), bias=QTensorConfig(bit_width=32))
FP8 = QTensorConfig(quant_type=QuantType.float_quant, exponent_bit_width=4, mantissa_bit_width=3)
CONFIGS = {
    "w8a8": Config(global_quant_config=W8A8),
    "w4pc_asym_gptq_bias_correction": Config(global_quant_config=W4PC_ASYM,
                                             algo_config=[algos.GPTQ(), algos.BiasCorrection()]),
    "act_equalization": Config(global_quant_config=W8A8,
                               pre_quant_opt_config=[algos.Preprocess(), algos.ActivationEqualization()]),
    "fp8_output": Config(global_quant_config=QLayerConfig(weight=FP8, input_tensors=FP8, output_tensors=FP8)),
    # Asymmetric activations (their zero point is created by calibration), per-group / MX weights, dynamic and
    # MX activations, float zero points and rounding methods.
    "int4_g32_asym_acts": Config(global_quant_config=QLayerConfig(  # padded groups (1-/16-channel convs) asked for
        weight=QTensorConfig(dtype=Dtype.int4, qscheme=QSchemeType.per_group, group_size=32, pad_groups=True),
        input_tensors=QTensorConfig(dtype=Dtype.uint8, zero_point_type=ZeroPointType.float32, percentile=99.0,
                                    round_method=RoundType.round))),
    "mxfp4_mx_acts": Config(global_quant_config=QLayerConfig(
        weight=QTensorConfig(dtype=Dtype.mx, mx_element_dtype=Dtype.fp4),
        input_tensors=QTensorConfig(dtype=Dtype.mx, mx_element_dtype=Dtype.fp8_e4m3),
        output_tensors=QTensorConfig(is_dynamic=True))),
}



def _fresh_digits(seed: int = 123) -> nn.Module:
    """The digits architecture with other (untrained) weights: the checkpoint must supply them all."""
    torch.manual_seed(seed)
    return DigitsCNN()


def _test_images(digits_data, count: int = 64) -> torch.Tensor:
    return digits_data.test.dataset.tensors[0][:count]


@pytest.fixture(scope="module")
def quantized(digits_model, digits_data) -> dict[str, nn.Module]:
    return {name: ModelQuantizer(config).quantize_model(digits_model, digits_data.calib)
            for name, config in CONFIGS.items()}


# ===================================================================== round trip
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_round_trip_is_bit_identical(quantized, digits_data, tmp_path: Path, name: str) -> None:
    model = quantized[name]
    images = _test_images(digits_data)
    assert save_quantized(model, tmp_path / "ckpt", example_input=example_input(digits_data)) == tmp_path / "ckpt"
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == [
        MARKER_FILE, "config.json", "example_input.safetensors", "manifest.json", "model.safetensors"]
    float_model = _fresh_digits()
    before = {k: v.clone() for k, v in float_model.state_dict().items()}
    loaded = load_quantized(float_model, tmp_path / "ckpt")
    with torch.no_grad():
        expected, actual = model(images), loaded(images)
    assert torch.equal(actual, expected)
    assert not loaded.training
    assert loaded is not float_model
    assert all(torch.equal(v, before[k]) for k, v in float_model.state_dict().items())  # caller's model untouched
    assert getattr(loaded, CONFIG_ATTRIBUTE) == CONFIGS[name]
    assert [n for n, _ in loaded.named_modules()] == [n for n, _ in model.named_modules()]


def test_files_are_safetensors_and_json(quantized, digits_data, tmp_path: Path) -> None:
    model = quantized["w4pc_asym_gptq_bias_correction"]
    save_quantized(model, tmp_path, example_input=example_input(digits_data))
    tensors = load_file(str(tmp_path / "model.safetensors"))
    assert tensors.keys() == model.state_dict().keys()
    assert any(k.endswith("scaling_impl.value") for k in tensors)  # scales are stored, not recomputed
    assert any(k.endswith("zero_point_impl.value") for k in tensors)  # asymmetric weights: zero points too
    assert not any(k.endswith("weight_orig") for k in tensors)  # GPTQ leaves no float weight copies behind
    assert Config.from_json((tmp_path / "config.json").read_text()) == CONFIGS["w4pc_asym_gptq_bias_correction"]
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    assert manifest["modules"]["fc1"] == "QuantLinear" and manifest["modules"]["conv1"] == "QuantConv2d"
    assert manifest["tensors"]["fc1.weight"] == {"shape": [64, 512], "dtype": "float32"}
    assert manifest["example_input"]["tensors"] == [{"name": "input", "shape": [8, 1, 8, 8], "dtype": "float32"}]
    assert manifest["versions"]["brevitas"].startswith("0.13")
    assert not any(p.suffix == ".tmp" for p in tmp_path.iterdir())
    info = read_checkpoint(tmp_path)
    assert torch.equal(info.example_input, example_input(digits_data))


def test_weight_only_model_without_preprocess(tmp_path: Path) -> None:
    """A bare layer, no tracing, no activation quantizers (their values are absent from the state dict)."""
    torch.manual_seed(0)
    layer = nn.Linear(6, 3)
    config = Config(global_quant_config=QLayerConfig(weight=QTensorConfig(bit_width=3)), pre_quant_opt_config=[])
    quant = ModelQuantizer(config).quantize_model(layer)
    save_quantized(quant, tmp_path)
    assert not (tmp_path / "example_input.safetensors").exists()
    loaded = load_quantized(nn.Linear(6, 3), tmp_path)
    x = torch.randn(4, 6)
    assert torch.equal(loaded(x), quant(x))


def test_bias_added_by_bias_correction_is_recreated(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8, bias=False), nn.ReLU(), nn.Linear(8, 4, bias=False))
    calib = [torch.randn(16, 8) for _ in range(4)]
    config = Config(global_quant_config=QLayerConfig(weight=QTensorConfig(bit_width=4), input_tensors=QTensorConfig()),
                    algo_config=[algos.BiasCorrection()])
    quant = ModelQuantizer(config).quantize_model(model, calib)
    assert dict(quant.named_modules())["0"].bias is not None  # bias correction gave the bias-free layer a bias
    save_quantized(quant, tmp_path)
    fresh = nn.Sequential(nn.Linear(8, 8, bias=False), nn.ReLU(), nn.Linear(8, 4, bias=False))
    loaded = load_quantized(fresh, tmp_path)
    assert torch.equal(loaded(calib[0]), quant(calib[0]))


# ===================================================================== resuming
def _sgd_step(model: nn.Module, optimizer: torch.optim.Optimizer, images: torch.Tensor, target: torch.Tensor) -> None:
    optimizer.zero_grad()
    nn.functional.cross_entropy(model(images), target).backward()
    optimizer.step()


def test_qat_resumes_from_checkpoint(digits_model, digits_data, tmp_path: Path) -> None:
    images, target = (t[:64] for t in digits_data.train.dataset.tensors)
    model = ModelQuantizer(CONFIGS["w8a8"]).quantize_model(digits_model, digits_data.calib)
    model.train()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    for _ in range(2):
        _sgd_step(model, optimizer, images, target)
    save_quantized(model, tmp_path)
    loaded = load_quantized(_fresh_digits(), tmp_path)
    assert loaded.training
    assert torch.equal(loaded(images), model(images))
    assert [n for n, _ in loaded.named_parameters()] == [n for n, _ in model.named_parameters()]
    _sgd_step(model, optimizer, images, target)  # plain SGD has no optimizer state to carry over
    _sgd_step(loaded, torch.optim.SGD(loaded.parameters(), lr=0.05), images, target)
    for (name, a), (_, b) in zip(model.named_parameters(), loaded.named_parameters()):
        assert torch.equal(a, b), name
    assert torch.equal(loaded(images), model(images))
    scale = "fc1.input_quant.fused_activation_quant_proxy.tensor_quant.scaling_impl.value"
    assert dict(loaded.named_parameters())[scale].requires_grad  # learned activation scales keep training


def test_ptq_resumes_from_checkpoint(digits_model, digits_data, tmp_path: Path) -> None:
    """A calibrated model saved before the post-quant algorithms continues with them after loading."""
    images = _test_images(digits_data)
    calib = list(digits_data.calib)[:2]
    model = ModelQuantizer(Config(global_quant_config=W4PC_ASYM)).quantize_model(digits_model, calib)
    save_quantized(model, tmp_path)
    loaded = load_quantized(_fresh_digits(), tmp_path)
    for algo in (algos.GPTQ(), algos.BiasCorrection()):
        model = apply_algorithm(algo, model, calib)
        loaded = apply_algorithm(algo, loaded, calib)
    with torch.no_grad():
        assert torch.equal(loaded(images), model(images))


# ===================================================================== mismatches
class Wider(DigitsCNN):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(32 * 4 * 4, 48)
        self.fc2 = nn.Linear(48, 10)


class Deeper(DigitsCNN):
    def __init__(self) -> None:
        super().__init__()
        self.fc3 = nn.Linear(10, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc3(super().forward(x))


class Shallower(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        source = DigitsCNN()
        for name in ("conv1", "bn1", "relu1", "conv2", "bn2", "relu2", "pool", "flatten", "fc1"):
            setattr(self, name, getattr(source, name))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.relu1(self.bn1(self.conv1(x)))
        x = self.relu2(self.bn2(self.conv2(x)))
        return self.fc1(self.flatten(self.pool(x)))


@pytest.fixture(scope="module")
def w8a8_checkpoint(quantized, digits_data, tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("w8a8")
    save_quantized(quantized["w8a8"], directory, example_input=example_input(digits_data))
    return directory


@pytest.mark.parametrize(("float_model", "message"), [
    (Wider, r"tensor 'fc1\.weight' has shape \[64, 512\] in the checkpoint but \[48, 512\]"),
    (Deeper, r"rebuilt model has module 'fc3' \(QuantLinear\) that the checkpoint does not have"),
    (Shallower, r"module 'relu3' \(ReLU\) of the checkpoint is missing from the rebuilt model"),
])
def test_architecture_mismatch_names_first_difference(w8a8_checkpoint: Path, float_model, message: str) -> None:
    with pytest.raises(CheckpointError, match=message) as info:
        load_quantized(float_model(), w8a8_checkpoint)
    assert f"does not fit {float_model.__name__}" in str(info.value)


def test_different_config_is_named(w8a8_checkpoint: Path) -> None:
    other = Config(global_quant_config=QLayerConfig(weight=QTensorConfig(bit_width=4), input_tensors=QTensorConfig(),
                                                    bias=QTensorConfig(bit_width=32)))
    with pytest.raises(CheckpointError, match=r"global_quant_config\.weight\.bit_width is 8 in the checkpoint, 4 in"):
        load_quantized(_fresh_digits(), w8a8_checkpoint, config=other)
    assert load_quantized(_fresh_digits(), w8a8_checkpoint, config=CONFIGS["w8a8"]) is not None


def test_edited_config_file_does_not_load(w8a8_checkpoint: Path, tmp_path: Path) -> None:
    """A config.json that does not belong to the weights (per-channel scales instead of per-tensor)."""
    for file in w8a8_checkpoint.iterdir():
        (tmp_path / file.name).write_bytes(file.read_bytes())
    data = json.loads((tmp_path / "config.json").read_text())
    data["global_quant_config"]["weight"]["qscheme"] = "per_channel"
    (tmp_path / "config.json").write_text(json.dumps(data))
    with pytest.raises(CheckpointError, match=r"tensor 'conv1\.weight_quant\..*scaling_impl\.value' has shape \[\] "
                                              r"in the checkpoint but \[16, 1, 1, 1\]"):
        load_quantized(_fresh_digits(), tmp_path)


def test_float_dtype_mismatch(w8a8_checkpoint: Path) -> None:
    with pytest.raises(CheckpointError, match=r"'conv1\.weight' is float32 in the checkpoint but float64.*"
                                              r"\.to\(float32\)"):
        load_quantized(_fresh_digits().double(), w8a8_checkpoint)


class MyLinear(nn.Linear):
    """A user layer that only quantizes through a registered mapping."""


def test_custom_layer_needs_the_same_container(tmp_path: Path) -> None:
    import brevitas.nn as qnn

    container = Container()
    container.layer_map.override({**DEFAULT_LAYER_MAP, MyLinear: LayerMapping(qnn.QuantLinear)})
    model = nn.Sequential(MyLinear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    config = Config(global_quant_config=QLayerConfig(weight=QTensorConfig()), pre_quant_opt_config=[])
    quant = ModelQuantizer(config, container=container).quantize_model(model)
    save_quantized(quant, tmp_path)
    with pytest.raises(CheckpointError, match=r"module '0' is a QuantLinear in the checkpoint but a MyLinear .*"
                                              r"container="):
        load_quantized(model, tmp_path)
    loaded = load_quantized(model, tmp_path, container=container)
    x = torch.randn(3, 4)
    assert torch.equal(loaded(x), quant(x))


def test_activation_equalization_loads_without_an_example(quantized, tmp_path: Path) -> None:
    """The scale modules activation equalization inserts are recreated from the checkpoint's record of the
    model (its handler's restore), without data or an example input."""
    save_quantized(quantized["act_equalization"], tmp_path)  # no example input stored
    loaded = load_quantized(_fresh_digits(), tmp_path)
    assert any(type(m).__name__ == "EqualizedModule" for m in loaded.modules())
    x = torch.randn(5, 1, 8, 8)
    with torch.no_grad():
        assert torch.equal(loaded(x), quantized["act_equalization"](x))
    with pytest.warns(DeprecationWarning, match="example_input"):
        load_quantized(_fresh_digits(), tmp_path, example_input=torch.zeros(2, 1, 8, 8))


def test_checkpoint_with_gptq_float_weight_copies_still_loads(quantized, tmp_path: Path) -> None:
    """Checkpoints written before GPTQ/GPFQ stopped leaving their float weight copies (``weight_orig``)
    hold those tensors; the GPxQ handler recreates the buffers so that they load."""
    model = quantized["w4pc_asym_gptq_bias_correction"]
    save_quantized(model, tmp_path)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    tensors["fc1.weight_orig"] = torch.randn(64, 512)
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "quark_brevitas.checkpoint"})
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    del manifest["checksums"]  # such checkpoints predate checksums too
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))
    loaded = load_quantized(_fresh_digits(), tmp_path)
    x = torch.randn(5, 1, 8, 8)
    with torch.no_grad():
        assert torch.equal(loaded(x), model(x))


def test_unreadable_checkpoints(w8a8_checkpoint: Path, tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="does not exist"):
        load_quantized(_fresh_digits(), tmp_path / "nowhere")
    with pytest.raises(CheckpointError, match=r"manifest\.json is missing"):
        load_quantized(_fresh_digits(), tmp_path)
    for file in w8a8_checkpoint.iterdir():
        (tmp_path / file.name).write_bytes(file.read_bytes())
    (tmp_path / "model.safetensors").write_bytes(b"not safetensors")
    with pytest.raises(CheckpointError, match=r"model\.safetensors has changed since it was written"):
        load_quantized(_fresh_digits(), tmp_path)  # its checksum no longer matches the manifest's
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    del manifest["checksums"]  # a checkpoint written before checksums: the file itself is checked
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match=r"model\.safetensors is not a readable safetensors file .*truncated "
                                              r"or damaged; write the checkpoint again"):
        load_quantized(_fresh_digits(), tmp_path)
    (tmp_path / "manifest.json").write_text(json.dumps({**manifest, "format_version": 99}))
    with pytest.raises(CheckpointError, match="format version 99 is not supported"):
        load_quantized(_fresh_digits(), tmp_path)


def test_save_needs_a_config(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="carries no quark_brevitas Config.*config="):
        save_quantized(nn.Linear(2, 2), tmp_path)
    with pytest.raises(CheckpointError, match="example_input must be a tensor"):
        save_quantized(nn.Linear(2, 2), tmp_path, config=CONFIGS["w8a8"], example_input="x")
    (tmp_path / "file").write_text("")
    with pytest.raises(CheckpointError, match="is not a directory"):
        save_quantized(nn.Linear(2, 2), tmp_path / "file", config=CONFIGS["w8a8"])


# ===================================================================== fresh process
_CHILD = textwrap.dedent("""
    import sys
    import torch
    from safetensors.torch import load_file, save_file
    from quark_brevitas import load_quantized
    from quark_brevitas.cli.digits import DigitsCNN

    torch.set_num_threads(int(sys.argv[1]))
    images = load_file(sys.argv[2])["images"]
    outputs = {}
    for directory in sys.argv[4:]:
        model = load_quantized(DigitsCNN(), directory)
        with torch.no_grad():
            outputs[directory] = model(images)
    save_file({str(i): outputs[d] for i, d in enumerate(sys.argv[4:])}, sys.argv[3])
""")


@pytest.mark.slow
def test_fresh_process_loads_bit_identical(quantized, digits_data, tmp_path: Path) -> None:
    images = digits_data.test.dataset.tensors[0]  # the whole test split, 450 images
    names = sorted(CONFIGS)
    example = example_input(digits_data)
    directories = [str(save_quantized(quantized[name], tmp_path / name, example_input=example)) for name in names]
    save_file({"images": images.contiguous()}, str(tmp_path / "images.safetensors"))
    result = subprocess.run(
        [sys.executable, "-c", _CHILD, str(torch.get_num_threads()), str(tmp_path / "images.safetensors"),
         str(tmp_path / "outputs.safetensors"), *directories],
        capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stderr
    outputs = load_file(str(tmp_path / "outputs.safetensors"))
    for index, name in enumerate(names):
        with torch.no_grad():
            expected = quantized[name](images)
        assert torch.equal(outputs[str(index)], expected), name


# ===================================================================== command line
@pytest.mark.slow
def test_cli_quantize_saves_checkpoint_and_export_uses_it(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    checkpoint = tmp_path / "ckpt"
    assert main(["quantize", "--output", str(tmp_path / "out"), "--epochs", "3", "--save-checkpoint",
                 str(checkpoint)]) == 0
    assert read_checkpoint(checkpoint).example_input.shape == (8, 1, 8, 8)
    capsys.readouterr()
    for fmt in ("qcdq", "qonnx"):
        target = tmp_path / "exports" / f"digits_{fmt}.onnx"
        assert main(["export", str(checkpoint), "--format", fmt, "--output", str(target)]) == 0
        assert target.is_file()
        stdout = capsys.readouterr().out
        assert "stored in the checkpoint" in stdout
        assert ("qonnx - PyTorch" if fmt == "qonnx" else "onnxruntime - PyTorch") in stdout
    assert sorted(p.name for p in (tmp_path / "exports").iterdir()) == ["digits_qcdq.onnx", "digits_qonnx.onnx"]
    target = tmp_path / "one.onnx"
    assert main(["export", str(checkpoint), "--output", str(target), "--input-shape", "1,1,8,8"]) == 0
    assert "random, shape [1, 1, 8, 8]" in capsys.readouterr().out


def test_cli_export_errors(w8a8_checkpoint: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["export", str(tmp_path / "missing"), "--output", str(tmp_path / "a.onnx")]) == 2
    assert "error: checkpoint directory" in capsys.readouterr().err
    output = str(tmp_path / "a.onnx")
    assert main(["export", str(w8a8_checkpoint), "--output", output, "--model", "nowhere:Nothing"]) == 2
    assert "error: --model 'nowhere:Nothing': cannot import it" in capsys.readouterr().err
    assert main(["export", str(w8a8_checkpoint), "--output", str(tmp_path / "a.onnx"), "--input-shape", "1,x"]) == 2
    assert "expected comma-separated positive integers" in capsys.readouterr().err
    assert main(["export", str(w8a8_checkpoint), "--output", str(tmp_path / "a.onnx"),
                 "--model", "torch.nn:Identity"]) == 2
    assert "error: cannot rebuild the quantized model" in capsys.readouterr().err
    assert not (tmp_path / "a.onnx").exists()


@pytest.mark.slow
def test_checkpoint_example_runs(tmp_path: Path) -> None:
    script = Path(__file__).resolve().parents[2] / "examples" / "checkpoint_qonnx.py"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300, env=env,
                            cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "bit-identical on 64 test images: True" in result.stdout
    assert "max |qonnx - PyTorch|" in result.stdout
    assert list(tmp_path.iterdir()) == []  # the example writes to a temporary directory only
