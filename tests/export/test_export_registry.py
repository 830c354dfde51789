"""One table of export formats (issue 28 item 2): adding a format is one module plus one registry row.

The toy format below lives in a module written into the test's temporary folder and is registered from the test:
no file of the package changes, yet the command line offers and lists it, ``ModelExporter.export`` reaches it, and
``quark-brevitas export --format toy`` writes a checkpoint with it.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from torch import nn

from quark_brevitas import ModelExporter, ModelQuantizer, save_quantized
from quark_brevitas.cli import main
from quark_brevitas.config.presets import get_preset
from quark_brevitas.export import ExportArgumentError
from quark_brevitas.export.registry import (
    FORMATS,
    ExportFormat,
    UnknownFormatError,
    format_names,
    get_format,
    register_format,
)

TOY_MODULE = '''
import json
from pathlib import Path

CALLS = []


def write_model(model, output, *, example=None, overwrite=False, tokenizer_dir=None, **options):
    """The toy format: which layers are quantized, as JSON."""
    CALLS.append({"output": str(output), "overwrite": overwrite, "options": options})
    output = Path(output)
    output.parent.mkdir(parents=True, exist_ok=True)
    layers = {name: type(module).__name__ for name, module in model.named_children()}
    output.write_text(json.dumps({"layers": layers}))
    return output
'''


@pytest.fixture
def toy(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[ExportFormat]:
    (tmp_path / "toy_format_module.py").write_text(TOY_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    saved = dict(FORMATS)
    row = register_format(ExportFormat(
        name="toy", summary="the layers as JSON", holds="anything", layout="file", suffix=".json", hf_lm=True,
        model_writer="toy_format_module:write_model"))
    try:
        yield row
    finally:
        FORMATS.clear()
        FORMATS.update(saved)
        sys.modules.pop("toy_format_module", None)


def _quantized() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4))
    return ModelQuantizer(get_preset("w8a8")).quantize_model(model, [torch.randn(4, 8) for _ in range(2)])


def test_the_cli_offers_and_lists_a_registered_format(toy: ExportFormat, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["list", "formats"]) == 0
    listed = capsys.readouterr().out
    assert "toy" in listed and "anything" in listed
    for command in (["export", "--help"], ["quantize", "--help"]):
        assert main(command) == 0
        assert "toy" in capsys.readouterr().out, command


def test_model_exporter_reaches_a_registered_format(toy: ExportFormat, tmp_path: Path) -> None:
    target = tmp_path / "out" / "model.json"
    written = ModelExporter(target).export("toy", _quantized(), flavour="plain")
    assert written == target
    assert json.loads(target.read_text())["layers"]["0"] == "QuantLinear"
    calls = sys.modules["toy_format_module"].CALLS
    assert calls[-1]["options"] == {"flavour": "plain"}  # the format's own options reach its writer


def test_cli_export_writes_a_checkpoint_in_a_registered_format(toy: ExportFormat, tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "toy_arch.py").write_text("from torch import nn\n\ndef make():\n"
                                          "    return nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4))\n")
    save_quantized(_quantized(), tmp_path / "ckpt", example_input=torch.randn(1, 8))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))
    code = main(["export", str(tmp_path / "ckpt"), "--format", "toy", "--output", str(tmp_path / "toy.json"),
                 "--model", "toy_arch:make"])
    assert code == 0, capsys.readouterr().err
    assert json.loads((tmp_path / "toy.json").read_text())["layers"] == {
        "0": "QuantLinear", "1": "ReLU", "2": "QuantLinear"}
    sys.modules.pop("toy_arch", None)


def test_the_built_in_rows_dispatch_to_the_writers_they_name(tmp_path: Path) -> None:
    from quark_brevitas.export import export_onnx_qcdq

    model = _quantized()
    example = torch.randn(2, 8)
    report = ModelExporter(tmp_path / "via_registry.onnx").export("onnx", model, example)  # alias of qcdq
    direct = export_onnx_qcdq(model, example, tmp_path / "direct.onnx")
    assert report.path.read_bytes() == direct.path.read_bytes()
    assert report.max_abs_diff <= report.tolerance


def test_names_aliases_and_errors() -> None:
    assert get_format("onnx") is get_format("qcdq")
    assert format_names() == list(FORMATS)
    assert "onnx" in format_names(aliases=True) and "qonnx" not in format_names(hf_lm=True)
    with pytest.raises(UnknownFormatError, match="unknown export format 'tiff'.*qcdq, onnx, qonnx"):
        get_format("tiff")
    with pytest.raises(ValueError, match="'gguf' already registered"):
        register_format(ExportFormat(name="gguf", summary="", holds="", layout="folder", model_writer=print))
    with pytest.raises(ValueError, match="'onnx' already registered.*format 'qcdq'"):
        register_format(ExportFormat(name="onnx2", aliases=("onnx",), summary="", holds="", layout="file",
                                     model_writer=print))
    with pytest.raises(ValueError, match="layout must be"):
        ExportFormat(name="x", summary="", holds="", layout="zip", model_writer=print)  # type: ignore[arg-type]


def test_a_format_without_a_block_by_block_writer_says_so() -> None:
    from quark_brevitas.export import ExportError

    with pytest.raises(ExportError, match="'qcdq' has no block-by-block writer"):
        get_format("qcdq").write_streamed("ckpt", "out")


def test_the_contract_refuses_arguments_a_format_cannot_use(tmp_path: Path) -> None:
    with pytest.raises(ExportArgumentError, match="traced: pass the example input"):
        get_format("qcdq").write(_quantized(), tmp_path / "m.onnx")
    with pytest.raises(ExportArgumentError, match="nothing is traced"):
        get_format("gguf").write(_quantized(), tmp_path / "g", example=torch.randn(1, 8))


def test_the_docs_list_every_built_in_format() -> None:
    text = (Path(__file__).resolve().parents[2] / "docs" / "how-to" / "cli.md").read_text()
    listing = text.split("$ quark-brevitas list formats", 1)[1].split("```", 1)[0]
    documented = {line.split()[0].rstrip(",") for line in listing.strip().splitlines()[1:]}
    assert documented == set(FORMATS), "docs/how-to/cli.md's format listing differs from the registry"


def test_a_container_can_supply_its_own_format_table(tmp_path: Path) -> None:
    from quark_brevitas import Container

    only = ExportFormat(name="only", summary="", holds="", layout="file",
                        model_writer=lambda model, output, **options: ("only", output, options))
    container = Container()
    container.formats.override({"only": only})
    exporter = ModelExporter(tmp_path / "x", container)
    assert exporter.export("only", nn.Linear(2, 2), level=3) == ("only", tmp_path / "x", {"level": 3})
    with pytest.raises(UnknownFormatError, match="formats: only$"):
        exporter.export("qcdq", nn.Linear(2, 2))
    assert Container().formats() is FORMATS
