"""Deprecated since quark_brevitas 0.3.0: the public names of this module moved to
:mod:`quark_brevitas.export.onnx.blocked` (``quark_brevitas/export/`` is split by target: ``onnx/``, ``hf/``,
``gguf/``).

A shim so that code written against the old path keeps working (with a ``DeprecationWarning`` naming the new
location); see :mod:`quark_brevitas.public_api` and ``docs/reference/public-api.md``.
"""

from quark_brevitas.public_api import moved_module

__getattr__, __dir__ = moved_module("quark_brevitas.export.blocked")
