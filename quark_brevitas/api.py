"""ModelQuantizer and ModelExporter: the compatibility surface of Quark's Brevitas extension.

``ModelQuantizer(config).quantize_model(model, calib_loader)`` runs the pipeline
(:mod:`quark_brevitas.pipeline`): pre-quant optimisations -> layer replacement -> calibration ->
post-quant algorithms, each stage in list order, on a *copy* of the caller's model (pass
``inplace=True`` to save memory, at the price of the caller's model being modified).
``ModelExporter(path).export_onnx_model(model, args)`` writes an ONNX QCDQ file and checks it in
onnxruntime against the PyTorch model; ``export_qonnx_model`` writes QONNX and checks it with the qonnx
package; ``export(format, model, args)`` writes any format of :mod:`quark_brevitas.export.registry` (GGUF,
compressed-tensors, Quark's format, a format registered by the user, ...).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import torch
from torch import nn

from quark_brevitas.backend import PlannedLayer
from quark_brevitas.calibration.data import BatchToInputs
from quark_brevitas.config import Config
from quark_brevitas.container import Container
from quark_brevitas.errors import UnsupportedArgumentError
from quark_brevitas.pipeline import Pipeline, require_quantized

logger = logging.getLogger(__name__)

__all__ = ["ModelExporter", "ModelQuantizer", "freeze"]


class ModelQuantizer:
    """Quantize PyTorch models with Brevitas according to a :class:`~quark_brevitas.config.Config`.

    The config is verified here, before any model is touched. ``container`` swaps the replaceable
    parts (layer map, backend, calibrator); see :mod:`quark_brevitas.container`. The stages themselves
    live in :class:`~quark_brevitas.pipeline.Pipeline`.
    """

    def __init__(self, config: Config, container: Container | None = None) -> None:
        self.pipeline = Pipeline(config, container)
        self.config = config
        self.container = self.pipeline.container

    def plan(self, model: nn.Module) -> list[PlannedLayer]:
        """Which modules would be quantized and with which config; the model is not modified.

        One :class:`~quark_brevitas.backend.PlannedLayer` per module (name, type, merged config or
        ``None``, and the level each tensor spec came from); print it with
        :func:`~quark_brevitas.backend.plan_table`. Raises :class:`ConfigError` if a layer name,
        pattern, exclude entry or layer type of the config matches nothing in ``model`` (the message
        lists the closest real names), or if a layer's merged config is invalid.
        """
        return self.pipeline.plan(model)

    def quantize_model(self, model: nn.Module, calib_loader: Any = None, *, inplace: bool = False,
                       batch_to_inputs: BatchToInputs | None = None, blocks: str | bool | None = None,
                       offload: str | os.PathLike[str] | None = None, distributed: bool | None = None) -> nn.Module:
        """Return a quantized copy of ``model`` (in eval mode).

        - ``calib_loader``: batches (a DataLoader, a list, or a generator, which is read once and kept):
          tensors, ``(inputs, target)`` tuples or dicts of keyword arguments. Needed for activation
          quantization and for every algorithm except Preprocess.
        - ``inplace``: work on ``model`` itself instead of a copy (saves memory; the caller's model is
          then modified, also if an error occurs part-way).
        - ``batch_to_inputs``: ``batch -> (args, kwargs)`` for batches the default conventions read
          wrongly, e.g. ``lambda b: ((b[0], b[1]), {})`` for a model with two positional inputs.
        - ``blocks``: calibrate a model made of repeated blocks one block at a time on cached block inputs
          (work linear in depth; see :mod:`quark_brevitas.blocks`). ``None`` (default): when the
          model's stack is known (Hugging Face decoder/encoder stacks, or an algorithm's
          ``model_decoder_layers``); ``False``: always the whole model; a name such as ``"model.layers"``:
          that ``nn.ModuleList``. Block by block, the caller's model is copied one block at a time.
        - ``offload``: where cached block inputs go: ``None`` (memory, spilling to a temporary directory
          beyond half of the available memory), ``"disk"`` (a temporary directory) or a directory path.
          To quantize a model larger than memory, start from its folder:
          :func:`quark_brevitas.hf.streaming.quantize_pretrained`.
        - ``distributed``: shard the calibration batches over ``torch.distributed`` processes (``None``:
          when a process group of several processes is initialised); statistics are combined so every
          process ends with the same model.
        """
        return self.pipeline.quantize(model, calib_loader, inplace=inplace, batch_to_inputs=batch_to_inputs,
                                      blocks=blocks, offload=offload, distributed=distributed)

    @staticmethod
    def freeze(model: nn.Module, quantize: bool | None = None, runtime_options: Any = None) -> nn.Module:
        """Fix a quantized model for inference and export (Quark 0.13's ``quantizer.freeze(model)``): eval mode,
        no parameter requires a gradient; returns ``model``. ``layer.weight`` keeps the float weight (``quantize``:
        ``None`` or ``False``); see :func:`freeze`."""
        return freeze(model, quantize, runtime_options)


def freeze(model: nn.Module, quantize: bool | None = None, runtime_options: Any = None) -> nn.Module:
    """``ModelQuantizer.freeze(model)`` (Quark 0.13): fix the quantized ``model`` in place and return it.

    In Quark, freezing replaces each fake quantizer by a frozen one that no longer observes, and by default writes
    the fake-quantized weight into ``layer.weight``. Here calibration has ended when ``quantize_model`` returns, so
    freezing fixes what can still move: the model leaves training mode (a QAT model's learned scales and weights
    stop changing, Dropout and BatchNorm statistics too) and no parameter requires a gradient any more (the flags
    are stored in a checkpoint and restored by ``load_quantized``).

    - ``quantize``: Quark's "write the fake-quantized weight into ``layer.weight``". ``None`` (the default) and
      ``False`` keep the float weight: Brevitas quantizes it in every forward call, and the exporters read the
      integer codes from the layer's own quantizer (writing the rounded weight back would make a re-quantization of
      it choose another scale for the full-range grids); the quantized weight is ``layer.quant_weight()``.
      ``True`` is refused.
    - ``runtime_options``: Quark's native inference kernels; only ``None``.
    """
    model = require_quantized(model, "ModelQuantizer.freeze")
    if quantize is not None and not isinstance(quantize, bool):
        raise UnsupportedArgumentError("ModelQuantizer.freeze", "quantize", quantize, "is not a bool",
                                       "None or False")
    if quantize:
        raise UnsupportedArgumentError(
            "ModelQuantizer.freeze", "quantize", quantize,
            "asks for the fake-quantized weight in layer.weight; quark_brevitas keeps the float weight there "
            "(Brevitas quantizes it in forward, the exporters read the codes from its quantizer) and gives the "
            "quantized one as layer.quant_weight()", "None or False")
    if runtime_options is not None:
        raise UnsupportedArgumentError("ModelQuantizer.freeze", "runtime_options", type(runtime_options).__name__,
                                       "selects Quark's native inference kernels, which quark_brevitas does not have "
                                       "(its quantized model runs on plain PyTorch)", "None")
    model.eval()
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.requires_grad_(False)
    logger.info("Froze %s (eval mode, no gradients)", type(model).__name__)
    return model


class ModelExporter:
    """Export quantized models; every export is checked against the PyTorch model.

    Example::

        ModelExporter("model.onnx").export_onnx_model(quant_model, args=example_batch)
    """

    def __init__(self, export_path: str | Path, container: Container | None = None) -> None:
        self.export_path = Path(export_path)
        self.container = container if container is not None else Container()

    def export_onnx_model(self, model: nn.Module, args: Any, *, past_key_values: bool = False,
                          int4_kernel: str = "matmulnbits", quantized_cache: bool | None = None) -> Any:
        """Write ONNX QCDQ (onnxruntime) to ``export_path`` and verify it; returns an ExportReport.

        ``past_key_values=True`` exports a decoder LM with its key/value cache as graph inputs and outputs
        (``past_key_values.{i}.key`` / ``present.{i}.key`` ...) for incremental decoding; ``args`` is then the
        prompt batch (see :func:`~quark_brevitas.export.export_onnx_qcdq`). ``int4_kernel``: weight-only
        Linear layers as onnxruntime's ``MatMulNBits`` (``"matmulnbits"``, default) or as standard ONNX
        ``DequantizeLinear`` + ``MatMul`` (``"dequantize"``), see ``export_onnx_qcdq``. ``quantized_cache``: whether
        a quantized KV cache is stored as int8 / FP8 codes between steps (default: where it is quantized after RoPE),
        see ``export_onnx_qcdq``.

        Raises :class:`~quark_brevitas.export.ExportMismatchError` if onnxruntime's output differs
        from the PyTorch model's by more than one quantization step.
        """
        options: dict[str, Any] = {"past_key_values": True} if past_key_values else {}
        if int4_kernel != "matmulnbits":  # a registered custom exporter need not know the option
            options["int4_kernel"] = int4_kernel
        if quantized_cache is not None:
            options["quantized_cache"] = quantized_cache
        return self.container.onnx_exporter()(model, args, self.export_path, **options)

    def export_qonnx_model(self, model: nn.Module, args: Any) -> Any:
        """Write QONNX (``Quant``/``FloatQuant`` nodes, for FINN and hls4ml) to ``export_path`` and verify it
        by executing the file with the ``qonnx`` package; returns a QONNXExportReport.

        The file has the static input shapes of ``args``. Raises
        :class:`~quark_brevitas.export.ExportMismatchError` if qonnx's output differs from the PyTorch
        model's by more than one quantization step.
        """
        return self.container.qonnx_exporter()(model, args, self.export_path)

    def export(self, format: str, model: nn.Module, args: Any = None, **options: Any) -> Any:
        """Write ``model`` to ``export_path`` in ``format``, any row of the container's format table
        (:mod:`quark_brevitas.export.registry`: ``qcdq``/``onnx``, ``qonnx``, ``gguf``, ``compressed-tensors``,
        ``quark``, and whatever :func:`~quark_brevitas.export.registry.register_format` added), and return what
        its writer returns (a verified report for ONNX formats, the path written for the others). ``model`` may
        also be the path of a checkpoint written block by block (``quantize_pretrained``): the format's
        block-by-block writer then writes the same file without the whole model in memory.

        ``args``: the example input of a traced format (ONNX); ``options``: the format's own keyword arguments
        (``tokenizer_dir=``, ``overwrite=``, ``opset=``, ...). ``export_onnx_model`` / ``export_qonnx_model``
        stay the container-overridable ONNX entries (``container.onnx_exporter``); this one reads
        ``container.formats``.
        """
        from quark_brevitas.export.registry import get_format

        row = get_format(format, self.container.formats())
        if args is not None:
            options["example"] = args
        return row.export(model, self.export_path, **options)
