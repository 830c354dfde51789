"""GGUF files (llama.cpp): the writer, the K-quant packers and the tokenizer part (the check of a plan before
calibration quantizes stand-ins with the api, so it is :func:`quark_brevitas.hf.plan_checks.check_gguf_plan`).

:mod:`quark_brevitas.export.gguf` was one module before 0.3.0; its names stay importable from
here (the writer is :mod:`quark_brevitas.export.gguf.writer`)."""

# The writer's own list is the package's: one list, so a name added there is importable here too.
from quark_brevitas.export.gguf.writer import *  # noqa: F403
from quark_brevitas.export.gguf.writer import __all__  # noqa: F401
