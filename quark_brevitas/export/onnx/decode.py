"""Greedy decoding in onnxruntime with a file exported with ``past_key_values=True``, float or quantized cache.

Why a helper: a decoding loop feeds each step's ``present.*`` outputs back as the next step's ``past_key_values.*``
inputs, and a quantized cache (:mod:`~quark_brevitas.export.onnx.kv_quant`) holds ``INT8`` or ``FLOAT8E4M3FN`` codes
that numpy cannot hold (FP8). :func:`greedy_decode` keeps the cache in onnxruntime's own ``OrtValue`` buffers between
steps, so whatever element type the file stores travels unchanged, at its size: what a serving loop does.
"""

from __future__ import annotations

import pathlib
import time
from dataclasses import dataclass

import numpy as np
import torch

from quark_brevitas.export.args import PathLike, past_name
from quark_brevitas.export.errors import ExportError
from quark_brevitas.export.onnx.kv_quant import run_session, to_torch

__all__ = ["DecodeResult", "greedy_decode", "torch_greedy_decode"]

#: torch dtype of an empty past of each ONNX element type the cache may have.
_EMPTY = {"tensor(float)": torch.float32, "tensor(int8)": torch.int8, "tensor(float8e4m3fn)": torch.float8_e4m3fn}


@dataclass(frozen=True)
class DecodeResult:
    """``logits``: the last position's logits of each step (``[batch, vocab]``, float32; step 0 is the prompt's);
    ``tokens``: the greedy tokens ``[batch, steps + 1]``; ``seconds``: wall time of each ``run`` call;
    ``cache_bytes``: bytes of the last step's presents (the cache of the ``prompt + steps`` tokens fed to the model;
    the last greedy token is never fed), at the element size the file stores."""

    logits: list[torch.Tensor]
    tokens: torch.Tensor
    seconds: list[float]
    cache_bytes: int


def greedy_decode(path: PathLike, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, *,
                  steps: int, session: object | None = None) -> DecodeResult:
    """Decode ``steps`` tokens greedily after ``input_ids`` (``[batch, prompt]``) with the file at ``path``: a prompt
    step on empty pasts, then one token per step, presents fed back as pasts (the last position's argmax). Rows of
    ``attention_mask`` with zeros at the start are left-padded prompts. ``session``: an onnxruntime session of the
    file to reuse (else one is made)."""
    from quark_brevitas.export.onnx.runtime import create_ort_session

    if steps < 0:
        raise ExportError(f"steps must be >= 0; got {steps}")
    session = session if session is not None else create_ort_session(pathlib.Path(path))
    inputs = {i.name: i for i in session.get_inputs()}
    pasts = [n for n in inputs if past_name(n) is not None]
    if not pasts or "input_ids" not in inputs or "attention_mask" not in inputs:
        raise ExportError(f"{path}: greedy_decode needs a file exported with past_key_values=True (inputs input_ids, "
                          f"attention_mask, past_key_values.*); it takes {', '.join(inputs)}")
    batch = int(input_ids.shape[0])
    mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask
    feed: dict[str, object] = {"input_ids": input_ids, "attention_mask": mask}
    for name in pasts:
        shape = inputs[name].shape
        if not (isinstance(shape[1], int) and isinstance(shape[3], int)):
            raise ExportError(f"{path}: {name} has no static heads / head_dim ({shape})")
        dtype = _EMPTY.get(inputs[name].type)
        if dtype is None:
            raise ExportError(f"{path}: {name} is {inputs[name].type}; greedy_decode takes float, int8 or float8e4m3fn")
        feed[name] = torch.zeros((batch, shape[1], 0, shape[3]), dtype=dtype)
    logits, tokens, seconds = [], [], []
    for _ in range(steps + 1):
        start = time.perf_counter()
        outputs = run_session(session, feed)
        seconds.append(time.perf_counter() - start)
        last = to_torch(outputs["logits"])[:, -1].float()
        logits.append(last)
        token = last.argmax(-1)
        tokens.append(token)
        for name in pasts:
            feed[name] = outputs[name.replace("past_key_values.", "present.", 1)]
        feed["input_ids"] = token[:, None].to(torch.int64)
        mask = torch.cat([mask, torch.ones((batch, 1), dtype=mask.dtype)], dim=1)
        feed["attention_mask"] = mask
    cache_bytes = sum(_bytes(feed[n]) for n in pasts)  # the last presents: prompt + steps tokens
    return DecodeResult(logits, torch.stack(tokens, dim=1), seconds, cache_bytes)


def _bytes(value: object) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    shape = value.shape()  # an OrtValue
    size = {"tensor(float)": 4, "tensor(int8)": 1, "tensor(float8e4m3fn)": 1}.get(value.data_type(), 4)
    return int(np.prod(shape)) * size


def torch_greedy_decode(model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                        *, steps: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """What :func:`greedy_decode` is compared with: ``model``'s own incremental greedy decoding in PyTorch (its
    cache fed back, one token a step, the attention mask grown by one). Returns the greedy tokens
    ``[batch, steps + 1]`` and each step's logits ``[batch, tokens fed, vocab]`` (step 0: the prompt's)."""
    from quark_brevitas.calibration.data import cache_keyword, output_cache

    if steps < 0:
        raise ValueError(f"steps must be >= 0; got {steps}")
    ids, cache, tokens, logits = input_ids, None, [], []
    mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask
    with torch.no_grad():
        for _ in range(steps + 1):
            out = model(input_ids=ids, attention_mask=mask, use_cache=True, **{cache_keyword(model): cache})
            cache = output_cache(out)
            logits.append(out.logits)
            ids = out.logits[:, -1].argmax(-1)[:, None]
            tokens.append(ids[:, 0])
            mask = torch.cat([mask, torch.ones_like(ids)], dim=1)
    return torch.stack(tokens, dim=1), logits
