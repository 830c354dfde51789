"""ModelQuantizer and ModelExporter: the compatibility surface of Quark's Brevitas extension.

``ModelQuantizer(config).quantize_model(model, calib_loader)`` runs the pipeline
pre-quant optimisations -> layer replacement -> calibration -> post-quant algorithms, each stage in
list order, on a *copy* of the caller's model (pass ``inplace=True`` to save memory, at the price
of the caller's model being modified). ``ModelExporter(path).export_onnx_model(model, args)`` writes
an ONNX QCDQ file and checks it in onnxruntime against the PyTorch model; ``export_qonnx_model`` writes
QONNX and checks it with the qonnx package.
"""

from __future__ import annotations

import copy
import logging
import time
from pathlib import Path
from typing import Any

from torch import nn

from quark_brevitas.backend import PlannedLayer
from quark_brevitas.checkpoint import CONFIG_ATTRIBUTE
from quark_brevitas.config import Config, verify_config
from quark_brevitas.container import Container
from quark_brevitas.data import model_device_dtype
from quark_brevitas.errors import CalibrationDataError
from quark_brevitas.resolve import Resolver

logger = logging.getLogger(__name__)

__all__ = ["ModelExporter", "ModelQuantizer"]


class ModelQuantizer:
    """Quantize PyTorch models with Brevitas according to a :class:`~quark_brevitas.config.Config`.

    The config is verified here, before any model is touched. ``container`` swaps the replaceable
    parts (layer map, backend, calibrator); see :mod:`quark_brevitas.container`.
    """

    def __init__(self, config: Config, container: Container | None = None) -> None:
        verify_config(config)
        self.config = config
        self.container = container if container is not None else Container()
        Resolver(config, self.container.layer_map())  # layer-type keys must name quantizable types

    def _backend(self) -> Any:
        return self.container.backends()[self.config.backend.name]

    def _check_model(self, model: Any) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        model_device_dtype(model)

    def _check_inputs(self, calib_loader: Any, activations: bool) -> None:
        needs = [type(a).__name__ for a in [*self.config.pre_quant_opt_config, *self.config.algo_config]
                 if a.needs_data]
        if activations:
            needs.insert(0, "activation calibration")
        if calib_loader is None and needs:
            raise CalibrationDataError(
                f"calib_loader is required by: {', '.join(needs)}. Pass a DataLoader (or any re-iterable "
                "of batches), or use a weight-only config without algorithms."
            )

    def plan(self, model: nn.Module) -> list[PlannedLayer]:
        """Which modules would be quantized and with which config; the model is not modified.

        One :class:`~quark_brevitas.backend.PlannedLayer` per module (name, type, merged config or
        ``None``, and the level each tensor spec came from); print it with
        :func:`~quark_brevitas.backend.plan_table`. Raises :class:`ConfigError` if a layer name,
        pattern, exclude entry or layer type of the config matches nothing in ``model`` (the message
        lists the closest real names), or if a layer's merged config is invalid.
        """
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        return self._backend().plan(model, self.config)

    def quantize_model(self, model: nn.Module, calib_loader: Any = None, *, inplace: bool = False) -> nn.Module:
        """Return a quantized copy of ``model`` (in eval mode).

        - ``calib_loader``: re-iterable batches (a DataLoader or a list): tensors, ``(inputs, target)``
          tuples or dicts of keyword arguments. Needed for activation quantization and for every
          algorithm except Preprocess. Iterated several times by GPTQ/GPFQ (once per layer).
        - ``inplace``: work on ``model`` itself instead of a copy (saves memory; the caller's model is
          then modified, also if an error occurs part-way).
        """
        self._check_model(model)
        # Resolve the hierarchy against the caller's model, before copying or changing anything: a
        # misspelt layer name fails here, and the plan says whether activations need calibration.
        rows = self.plan(model)
        self._backend().require_targets(model, rows)
        activations = any(row.layer_config is not None and (row.layer_config.input_tensors is not None
                                                            or row.layer_config.output_tensors is not None)
                          for row in rows)
        self._check_inputs(calib_loader, activations)
        start = time.perf_counter()
        work = model if inplace else copy.deepcopy(model)
        for algo in self.config.pre_quant_opt_config:
            logger.info("Applying %s", algo.name or type(algo).__name__)
            work = algo.apply(work, calib_loader=calib_loader)
        logger.info("Applying quantization (%s backend)", self.config.backend.name)
        work = self._backend().quantize(work, self.config, check_names=False)
        if activations:
            logger.info("Applying calibration")
            work = self.container.calibrator()(work, calib_loader)
        for algo in self.config.algo_config:
            logger.info("Applying %s", algo.name or type(algo).__name__)
            work = algo.apply(work, calib_loader=calib_loader)
        work.eval()
        # The config travels with the model, so save_quantized can write it next to the weights.
        setattr(work, CONFIG_ATTRIBUTE, copy.deepcopy(self.config))
        logger.info("Quantization done in %.1f s", time.perf_counter() - start)
        return work


class ModelExporter:
    """Export quantized models; every export is checked against the PyTorch model.

    Example::

        ModelExporter("model.onnx").export_onnx_model(quant_model, args=example_batch)
    """

    def __init__(self, export_path: str | Path, container: Container | None = None) -> None:
        self.export_path = Path(export_path)
        self.container = container if container is not None else Container()

    def export_onnx_model(self, model: nn.Module, args: Any) -> Any:
        """Write ONNX QCDQ (onnxruntime) to ``export_path`` and verify it; returns an ExportReport.

        Raises :class:`~quark_brevitas.export.ExportMismatchError` if onnxruntime's output differs
        from the PyTorch model's by more than one quantization step.
        """
        return self.container.onnx_exporter()(model, args, self.export_path)

    def export_qonnx_model(self, model: nn.Module, args: Any) -> Any:
        """Write QONNX (``Quant``/``FloatQuant`` nodes, for FINN and hls4ml) to ``export_path`` and verify it
        by executing the file with the ``qonnx`` package; returns a QONNXExportReport.

        The file has the static input shapes of ``args``. Raises
        :class:`~quark_brevitas.export.ExportMismatchError` if qonnx's output differs from the PyTorch
        model's by more than one quantization step.
        """
        return self.container.qonnx_exporter()(model, args, self.export_path)
