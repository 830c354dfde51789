"""Every code block of the documentation runs (see ``tests/helpers/docs_blocks.py`` for the rules a block follows).

One test per page: its Python blocks run in order in one fresh process (a page is one story: later blocks use
earlier names), its shell blocks with bash, its config blocks through ``Config``. ``test_block_census`` prints how
many blocks were found, run and marked (with the reasons), so the count the issue asks for is one command away:
``python -m pytest tests/docs/test_docs.py -q -rA -k census``.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
from helpers.docs_blocks import GIVENS, ROOT, Block, blocks_of, documentation_files

CODE = {"python", "bash", "yaml", "json"}
PAGES = [path for path in documentation_files() if any(b.lang in CODE for b in blocks_of(path))]


def _runnable(block: Block) -> str | None:
    """Why ``block`` does not run here, or ``None`` when it runs."""
    if block.skip:
        return block.skip
    missing = [name for name in block.needs if importlib.util.find_spec(name) is None]
    return f"needs {', '.join(missing)}, not installed" if missing else None


def _is_config(block: Block) -> bool:
    return block.lang in ("yaml", "json") and "global_quant_config" in block.code


def _run(command: list[str], cwd: Path, where: str) -> None:
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
           "HF_HUB_OFFLINE": "1", "MPLBACKEND": "Agg"}
    done = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    if done.returncode:
        pytest.fail(f"{where} failed (exit {done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}")


@pytest.mark.slow
@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_page_code_blocks_run(page: Path, tmp_path: Path) -> None:
    from quark_brevitas.config import Config, verify_config

    blocks = [b for b in blocks_of(page) if b.lang in CODE and _runnable(b) is None]
    for block in blocks:
        if _is_config(block):
            text = block.code
            config = Config.from_json(text) if block.lang == "json" else Config.from_yaml(text)
            verify_config(config)
    python = [b for b in blocks if b.lang == "python"]
    givens = [name for b in blocks for name in b.given]  # a setup a shell block asks for runs first too
    if python or givens:
        unknown = sorted(set(givens) - set(GIVENS))
        assert not unknown, f"{page}: unknown setup {unknown}; known: {sorted(GIVENS)}"
        parts = [GIVENS[name] for name in dict.fromkeys(givens)]
        parts += [f"# --- {b.where}\n{b.code}" for b in python]
        script = tmp_path / "page.py"
        script.write_text("\n".join(parts), encoding="utf-8")
        _run([sys.executable, str(script)], tmp_path, str(page.relative_to(ROOT)))
    for block in (b for b in blocks if b.lang == "bash"):
        _run(["bash", "-euo", "pipefail", "-c", block.code], tmp_path, block.where)


def test_block_census() -> None:
    """Counts blocks found, run and marked; a block in an unknown language or a marker without reason fails."""
    counts: Counter[str] = Counter()
    reasons: Counter[str] = Counter()
    for page in documentation_files():
        for block in blocks_of(page):
            counts["found"] += 1
            if block.lang not in CODE:
                counts["not code (output, text)"] += 1
                assert block.lang in ("", "text", "console", "mermaid"), f"{block.where}: fence {block.lang!r}"
                continue
            if block.lang in ("yaml", "json") and not _is_config(block):
                counts["data (not a config)"] += 1
                continue
            why = _runnable(block)
            if block.skip is not None:
                assert block.skip.strip(), f"{block.where}: a skip marker must say why"
            if why is None:
                counts["run"] += 1
            else:
                counts["marked"] += 1
                reasons[why] += 1
    print(json.dumps({"blocks": dict(counts), "marked": dict(reasons)}, indent=1))
    assert counts["run"] > 0
