"""Python's cyclic garbage collector during a run: the objects that existed before it are not walked again.

A run builds a few hundred objects per quantized layer (Brevitas's quantizers, the injectors' state) and many more
per calibration batch, so the collector runs often; every tenth collection of the middle generation may become a
full one, which walks every object the process holds: torch's, transformers' and Brevitas's modules and classes,
the user's model. On the 4-block Llama of ``benchmarks.llm --only roofline`` one such collection took 0.25 s of a
4.2 s run, for nothing: those objects were alive before the run and stay alive after it.

:func:`existing_objects_frozen` moves them, for the duration of the run, to the collector's permanent generation
(:func:`gc.freeze`); objects the run creates are collected as usual (a dropped block's quantizer cycles included),
and at the end they all go back to the oldest generation (:func:`gc.unfreeze`). A process that freezes objects
itself (a forking server, say), or has the collector off, is left as it is: unfreezing would undo its own freeze.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator

__all__ = ["existing_objects_frozen"]


@contextlib.contextmanager
def existing_objects_frozen() -> Iterator[bool]:
    """While the context lasts, the collector skips the objects that existed when it was entered (see the module
    docstring); yields whether it froze them (``False``: the process manages the collector itself)."""
    if not gc.isenabled() or gc.get_freeze_count() > 0:
        yield False
        return
    gc.freeze()
    try:
        yield True
    finally:
        gc.unfreeze()
