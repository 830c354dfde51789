"""Pickling of quantized models: a clear error instead of Brevitas's ``PicklingError``.

A config becomes Brevitas quantizers through ``Base.let(...)``, which makes injector classes at run time; ``pickle``
(``torch.save(model)``, multiprocessing) cannot re-create them by name and fails with a message that names only the
quantizer class. :func:`register_pickling` routes the pickling of every injector class through
:func:`reduce_injector`, which keeps importable quantizers pickled by reference and names the supported way to save
everything else.
"""

from __future__ import annotations

import copyreg
import sys
from typing import Any

from quark_brevitas.errors import NotPicklableError

__all__ = ["reduce_injector", "register_pickling"]


def reduce_injector(injector: type) -> str:
    """``pickle``'s reduction of a Brevitas quantizer (an injector class): one importable by its name (a
    Brevitas quantizer such as ``Int8WeightPerTensorFloat``) pickles by reference as before; one made at run
    time cannot be re-created by name: say what to use instead."""
    module = sys.modules.get(injector.__module__)
    found: Any = module
    for part in injector.__qualname__.split("."):
        found = getattr(found, part, None)
    if found is injector:
        return injector.__qualname__  # pickle's "a global of the object's module"
    raise NotPicklableError(
        f"a quantized model cannot be pickled (torch.save(model), pickle, multiprocessing): its quantizer "
        f"{injector.__qualname__} was made at run time from the config and cannot be re-created by name. Save "
        "it with quark_brevitas.save_quantized(model, directory) and load it with "
        "quark_brevitas.load_quantized(float_model, directory); or torch.save(model.state_dict())"
    )


def register_pickling() -> None:
    """Route the pickling of every Brevitas injector class through :func:`reduce_injector` (``copyreg`` is
    consulted by type, here the injectors' metaclass; ``copy.deepcopy`` copies classes by reference and is
    unaffected)."""
    from _dependencies.injector import _InjectorType
    from brevitas.inject import _ExtendedInjectorType

    for metaclass in (_InjectorType, _ExtendedInjectorType):
        copyreg.pickle(metaclass, reduce_injector)
