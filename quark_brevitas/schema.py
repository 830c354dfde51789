"""Deprecated since quark_brevitas 0.2.0: the public names of this module moved to
:mod:`quark_brevitas.config.schema`.

A shim so that code written against the old path keeps working (with a ``DeprecationWarning`` naming the new
location); see :mod:`quark_brevitas.public_api` and ``docs/reference/public-api.md``.
"""

from quark_brevitas.public_api import moved_module

__getattr__, __dir__ = moved_module("quark_brevitas.schema")

if __name__ == "__main__":  # ``python -m quark_brevitas.schema [PATH]``, as the README once documented
    import runpy
    import warnings

    warnings.warn("python -m quark_brevitas.schema moved to python -m quark_brevitas.config.schema in "
                  "quark_brevitas 0.2.0", DeprecationWarning, stacklevel=1)
    runpy.run_module("quark_brevitas.config.schema", run_name="__main__", alter_sys=True)
