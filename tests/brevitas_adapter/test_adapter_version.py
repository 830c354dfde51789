"""Canaries of the adapter: the version gate and FX tracing (quark_brevitas/brevitas_adapter/version.py).

Each test names the Brevitas internal it guards, so that a Brevitas release that renames or changes it fails
here, clearly, rather than somewhere deep in a quantization run.
"""

from __future__ import annotations

import brevitas
import pytest
from packaging.version import Version
from torch import nn

from quark_brevitas import brevitas_adapter as adapter
from quark_brevitas.errors import QuarkBrevitasError


def test_supported_version_range_is_installed() -> None:
    low, high = (Version(v) for v in adapter.SUPPORTED_BREVITAS)
    assert low <= Version(brevitas.__version__) < high, "the adapter's SUPPORTED_BREVITAS must include the install"


def test_private_symbolic_trace_accepts_a_custom_tracer() -> None:
    class MyLinear(nn.Linear):
        pass

    model = nn.Sequential(MyLinear(4, 4), nn.ReLU())
    traced = adapter.symbolic_trace(model, lambda m, _: isinstance(m, MyLinear))
    assert adapter.is_graph_module(traced)
    assert any(node.op == "call_module" and node.target == "0" for node in traced.graph.nodes), \
        "brevitas.fx.brevitas_tracer._symbolic_trace no longer keeps leaf modules of a custom tracer"


def test_brevitas_tracer_still_warns_about_children_specs() -> None:
    """Canary for the one filter in symbolic_trace: when Brevitas stops reading treespec.children_specs,
    this fails and the filter can go."""
    import warnings

    from brevitas.fx import Tracer
    from brevitas.fx.brevitas_tracer import _symbolic_trace

    model = nn.Sequential(nn.Linear(2, 2))
    with warnings.catch_warnings(record=True) as raw:
        warnings.simplefilter("always")
        _symbolic_trace(Tracer(), model, None)
    assert any(issubclass(w.category, FutureWarning) and "children_specs" in str(w.message) for w in raw)
    with warnings.catch_warnings(record=True) as ours:
        warnings.simplefilter("always")
        adapter.symbolic_trace(model)
    assert not any("children_specs" in str(w.message) for w in ours)


def test_an_unsupported_brevitas_fails_with_an_install_command(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(brevitas, "__version__", "0.12.1")
    expected = r"Brevitas 0\.12\.1 is installed.*pip install 'brevitas>=0\.13,<0\.14'"
    with pytest.raises(QuarkBrevitasError, match=expected):
        adapter.check_supported_version()
    monkeypatch.setattr(brevitas, "__version__", "0.13.4")
    adapter.check_supported_version()


_IMPORT_ALONE = """
import sys, types, warnings
package = types.ModuleType("quark_brevitas")  # the adapter package alone, without quark_brevitas/__init__.py
package.__path__ = [sys.argv[1]]
sys.modules["quark_brevitas"] = package
import quark_brevitas.brevitas_adapter
import brevitas.graph.equalize  # where Brevitas warns about the missing CUDA kernel package
"""


@pytest.mark.slow
def test_the_adapter_imports_alone_and_silences_the_fast_hadamard_warning() -> None:
    """The top-level package may import the adapter lazily: the adapter's own ``__init__`` installs the filter
    before its first Brevitas import, and imports Brevitas in an order that avoids Brevitas's import cycle.
    Checked in a fresh interpreter with every warning shown."""
    import inspect
    import subprocess
    import sys
    from pathlib import Path

    import brevitas.graph.equalize

    import quark_brevitas

    message = "fast_hadamard_transform package not found"
    assert message in inspect.getsource(brevitas.graph.equalize), "Brevitas no longer warns: drop the filter"
    package_dir = str(Path(quark_brevitas.__file__).parent)
    command = [sys.executable, "-W", "always", "-c", _IMPORT_ALONE, package_dir]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert message not in done.stderr
