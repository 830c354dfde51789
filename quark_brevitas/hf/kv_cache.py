"""Deprecated since quark_brevitas 0.4.0: the public names of this module moved to
:mod:`quark_brevitas.model_parts.kv_cache` (below the pipeline, which attaches them in its data phase).

A shim so that code written against the old path keeps working (with a ``DeprecationWarning`` naming the new
location); see :mod:`quark_brevitas.public_api` and ``docs/reference/public-api.md``.
"""

from quark_brevitas.public_api import moved_module

__getattr__, __dir__ = moved_module("quark_brevitas.hf.kv_cache")
