"""Dependency-injection wiring of the pipeline's replaceable parts.

The pipeline stages are plain functions and classes; this container only says which ones
:class:`~quark_brevitas.api.ModelQuantizer` uses, so that a user can swap or extend one of them
without patching the library. For example, to quantize a custom layer type::

    from quark_brevitas import Container, DEFAULT_LAYER_MAP, LayerMapping

    container = Container()
    container.layer_map.override({**DEFAULT_LAYER_MAP, MyConv: LayerMapping(MyQuantConv)})
    quant_model = ModelQuantizer(config, container=container).quantize_model(model, loader)

Replaceable parts: ``layer_map`` (float class -> LayerMapping), ``backends`` (one per
:class:`~quark_brevitas.config.Backend` name), ``calibrator`` (``(model, data) -> model``, where ``data`` is a
:class:`~quark_brevitas.calibration.data.CalibrationData`: iterating it yields the batches),
``onnx_exporter`` and ``qonnx_exporter`` (``(model, args, path) -> report``, what
``ModelExporter.export_onnx_model`` / ``export_qonnx_model`` call), ``formats`` (the table of export formats
:meth:`~quark_brevitas.api.ModelExporter.export` reads; default the live
:data:`quark_brevitas.export.registry.FORMATS`, so a format registered later is reachable too).
"""

from __future__ import annotations

from dependency_injector import containers, providers

from quark_brevitas.backend import DEFAULT_LAYER_MAP, LayerwiseBackend
from quark_brevitas.calibration import calibrate
from quark_brevitas.export.registry import FORMATS


def _graph_backend(layer_map):  # imported lazily: the graph backend imports the FX machinery
    from quark_brevitas.backend.graph import GraphBackend

    return GraphBackend(layer_map)


def _onnx_exporter():  # imported lazily: onnx/onnxruntime are only needed when exporting
    from quark_brevitas.export import export_onnx_qcdq

    return export_onnx_qcdq


def _qonnx_exporter():  # imported lazily: qonnx is only needed when exporting QONNX
    from quark_brevitas.export.onnx.qonnx import export_qonnx

    return export_qonnx


class Container(containers.DeclarativeContainer):
    """The replaceable parts of the quantization pipeline."""

    layer_map = providers.Object(DEFAULT_LAYER_MAP)
    backends = providers.Dict(layerwise=providers.Factory(LayerwiseBackend, layer_map=layer_map),
                              graph=providers.Factory(_graph_backend, layer_map=layer_map))
    calibrator = providers.Object(calibrate)
    onnx_exporter = providers.Callable(_onnx_exporter)
    qonnx_exporter = providers.Callable(_qonnx_exporter)
    formats = providers.Object(FORMATS)


__all__ = ["Container"]
