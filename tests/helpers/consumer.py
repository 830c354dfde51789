"""Test helper: load files we wrote in a fresh Python process that cannot import quark_brevitas, as a user of the
file (transformers, amd-quark's importer) would, and bring back what it computed."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

#: Every consumer script starts here: quark_brevitas must not be importable, and ``tokens`` come from ``argv[1]``.
_PROLOGUE = textwrap.dedent("""
    import sys
    try:
        import quark_brevitas  # noqa: F401
    except ImportError:
        pass
    else:
        raise SystemExit("quark_brevitas is importable in the consumer process")
    import torch
    from transformers import AutoModelForCausalLM
    tokens = torch.load(sys.argv[1])
    result = {}
""")

#: ... and ends here: ``result`` (filled by the body, per folder of ``argv[3:]``) goes back through ``argv[2]``.
_EPILOGUE = textwrap.dedent("""
    assert "quark_brevitas" not in sys.modules
    torch.save(result, sys.argv[2])
""")


#: A consumer body: each folder loaded with ``AutoModelForCausalLM`` (compressed-tensors folders through the
#: compressed-tensors package), its first block's experts module's class name and its logits on ``tokens``.
MOE_LOGITS = """
    for folder in sys.argv[3:]:
        model = AutoModelForCausalLM.from_pretrained(folder).eval()
        result["experts"] = type(model.model.layers[0].mlp.experts).__name__
        with torch.no_grad():
            result["logits"] = model(tokens).logits
"""


def run_consumer(body: str, folders: Sequence[Path], tokens: torch.Tensor, work: Path, *, python: str,
                 pythonpath: str, timeout: int = 600) -> dict[str, Any]:
    """Run ``body`` (a loop over ``sys.argv[3:]`` filling ``result``) with ``python -S`` and only ``pythonpath`` on
    the path; returns ``result``."""
    script, inputs, outputs = work / "consumer.py", work / "tokens.pt", work / "result.pt"
    script.write_text(_PROLOGUE + textwrap.dedent(body) + _EPILOGUE)
    torch.save(tokens, inputs)
    env = {"PYTHONPATH": pythonpath, "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin",
           "HOME": os.environ.get("HOME", "/"), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error",
           "TQDM_DISABLE": "1"}
    run = subprocess.run([python, "-S", str(script), str(inputs), str(outputs), *map(str, folders)],
                         cwd=work, env=env, capture_output=True, text=True, timeout=timeout)
    assert run.returncode == 0, run.stderr[-3000:]
    return torch.load(outputs)


def quark_interpreter() -> tuple[str, str] | None:
    """An interpreter with amd-quark (the current one, or the one ``QUARK_PYTHON`` names) and the directories its
    consumer process needs (``-S``: no site hooks, so no editable install of quark_brevitas), or ``None``."""
    python = os.environ.get("QUARK_PYTHON") or (sys.executable if importlib.util.find_spec("quark") else None)
    if python is None:
        return None
    probe = ("import os, quark, transformers, torch; print(os.pathsep.join(sorted({os.path.dirname(os.path.dirname("
             "m.__file__)) for m in (quark, transformers, torch)})))")
    run = subprocess.run([python, "-c", probe], capture_output=True, text=True, timeout=600, cwd="/")
    return (python, run.stdout.strip().splitlines()[-1]) if run.returncode == 0 and run.stdout.strip() else None
