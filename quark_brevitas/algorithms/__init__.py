"""Algorithm handlers: what each algorithm config of :mod:`quark_brevitas.algos` does to a model.

Importing this package registers the library's handlers; :func:`handler_for` finds the handler of a
config, :func:`register` adds one for a new algorithm (see :mod:`quark_brevitas.algorithms.base`), and
:func:`apply_algorithm` runs one algorithm on a model outside ``quantize_model``.
"""

from quark_brevitas.algorithms import correction, equalization, gpxq, preprocess
from quark_brevitas.algorithms.base import (
    AlgorithmHandler,
    SavedStructure,
    apply_algorithm,
    handler_for,
    register,
    registered_handlers,
)

__all__ = ["AlgorithmHandler", "SavedStructure", "apply_algorithm", "correction", "equalization", "gpxq", "handler_for",
           "preprocess", "register", "registered_handlers"]
