"""Algorithm handlers: what each algorithm config of :mod:`quark_brevitas.algos` does to a model.

Importing this package registers the library's handlers; :func:`handler_for` finds the handler of a
config, :func:`register` adds one for a new algorithm (see :mod:`quark_brevitas.algorithms.base`), and
:func:`apply_algorithm` runs one algorithm on a model outside ``quantize_model``. :func:`describe_algorithms`
says what each algorithm of a config will work on in a model (the inferred decoder and scaling layers).
"""

from quark_brevitas.algorithms import (
    autoround,
    awq,
    correction,
    equalization,
    gptq,
    gpxq,
    preprocess,
    qronos,
    rotation,
    smoothquant,
)
from quark_brevitas.algorithms.base import (
    AlgorithmHandler,
    BlockStep,
    SavedStructure,
    apply_algorithm,
    describe_algorithms,
    handler_for,
    register,
    registered_handlers,
)
from quark_brevitas.algorithms.blocks import BlockwiseHandler

__all__ = ["AlgorithmHandler", "BlockStep", "BlockwiseHandler", "SavedStructure", "apply_algorithm", "autoround", "awq",
           "correction", "describe_algorithms", "equalization", "gptq", "gpxq", "handler_for", "preprocess", "qronos",
           "register", "registered_handlers", "rotation", "smoothquant"]
