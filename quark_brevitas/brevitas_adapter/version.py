"""The Brevitas release the package runs on, and Brevitas's FX tracing.

Every other module of the adapter assumes a Brevitas inside :data:`SUPPORTED_BREVITAS`: the adapter's
``__init__`` checks it once (:func:`check_supported_version`) before importing them, so a wrong release
fails with an install command instead of an ``ImportError`` or ``AttributeError`` deep inside a run.
Brevitas's graph transforms need its own FX backport, which offers a custom tracer only through a private
function; :func:`symbolic_trace` is the one place that calls it.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import brevitas
import torch
from packaging.version import Version
from torch import nn

from quark_brevitas.errors import QuarkBrevitasError

__all__ = ["SUPPORTED_BREVITAS", "brevitas_version", "check_supported_version", "is_graph_module", "symbolic_trace"]

#: The Brevitas releases this adapter was written and tested against: ``(lowest, first unsupported)``.
SUPPORTED_BREVITAS = ("0.13", "0.14")


def brevitas_version() -> str:
    """The installed Brevitas version."""
    return str(brevitas.__version__)


def check_supported_version() -> None:
    """Raise if the installed Brevitas is outside :data:`SUPPORTED_BREVITAS`: the adapter relies on its
    internals, which change between releases (the package's ``__init__`` calls this before any other
    submodule imports Brevitas)."""
    low, high = (Version(v) for v in SUPPORTED_BREVITAS)
    installed = Version(brevitas_version())
    if not low <= installed < high:
        raise QuarkBrevitasError(
            f"quark_brevitas supports Brevitas >= {low}, < {high}; Brevitas {installed} is installed. "
            f"Install a supported release: pip install 'brevitas>={low},<{high}'"
        )


def symbolic_trace(model: nn.Module, is_leaf: Callable[[nn.Module, str], bool] | None = None) -> nn.Module:
    """FX-trace ``model`` with Brevitas's tracer (its graph transforms need its backported FX classes).

    ``is_leaf(module, qualified_name)`` keeps more modules whole than the default tracer does (which
    keeps only ``torch.nn`` modules); Brevitas offers a custom tracer only through its private
    ``_symbolic_trace``. Brevitas's FX backport reads ``treespec.children_specs``, which torch 2.13
    deprecates with a FutureWarning on every trace; that one warning is silenced here (nothing the user
    can act on), all others pass.
    """
    from brevitas.fx import Tracer
    from brevitas.fx.brevitas_tracer import _symbolic_trace

    class _Tracer(Tracer):
        def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
            leaf = super().is_leaf_module(m, module_qualified_name)
            return leaf or (is_leaf is not None and is_leaf(m, module_qualified_name))

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"`treespec\.children_specs` is deprecated", category=FutureWarning)
        return _symbolic_trace(_Tracer(), model, None)


def is_graph_module(model: nn.Module) -> bool:
    """Whether ``model`` is an FX graph module (torch's or Brevitas's backport)."""
    from brevitas.fx import GraphModule as BrevitasGraphModule

    return isinstance(model, torch.fx.GraphModule | BrevitasGraphModule)
