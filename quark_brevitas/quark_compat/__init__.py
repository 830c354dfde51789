"""Quark 0.13's top-level functions (``from quark.torch import ...``) under their names, arguments and defaults,
mapped onto quark_brevitas: code written for Quark 0.13 runs after changing ``quark.torch`` to ``quark_brevitas``.

- :func:`~quark_brevitas.api.freeze` (``ModelQuantizer.freeze``, defined with it in the api): fixes a quantized
  model for inference and export.
- :func:`~quark_brevitas.quark_compat.exporting.export_safetensors` (Quark's format, ``custom_mode="quark"``),
  :func:`~quark_brevitas.quark_compat.exporting.export_onnx`,
  :func:`~quark_brevitas.quark_compat.exporting.export_gguf`.
- :func:`~quark_brevitas.quark_compat.importing.import_model_from_safetensors`: a folder ``export_safetensors``
  wrote, back as the quantized model.
- :func:`~quark_brevitas.quark_compat.params.save_params` / :func:`~quark_brevitas.quark_compat.params.load_params`.

Every argument is Quark's. A value quark_brevitas honours does what Quark's documentation says (on our
implementation: the exporters prove each file they write); a value it cannot honour is one error naming the
argument and the values allowed, never ignored. ``docs/migrating-from-quark.md`` lists them all.
"""

from __future__ import annotations

from quark_brevitas.api import freeze
from quark_brevitas.quark_compat.exporting import export_gguf, export_onnx, export_safetensors
from quark_brevitas.quark_compat.importing import import_model_from_safetensors
from quark_brevitas.quark_compat.params import load_params, save_params

__all__ = ["export_gguf", "export_onnx", "export_safetensors", "freeze", "import_model_from_safetensors",
           "load_params", "save_params"]
