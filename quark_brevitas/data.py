"""Calibration data plumbing: any loader, any batch shape, checked and moved to the model.

Every loop over user data in the library goes through :func:`run_batches`, so every loop gets the
same batch conventions, the same checks (non-finite values, empty loaders, batches the model
rejects — all reported with the batch index) and a tqdm progress bar.

Batch conventions (one batch = one forward call):

- a tensor: ``model(batch)``;
- a tuple or list: Quark's ``(inputs, target)`` convention, the first element is the input
  (a tensor, a tuple/list of positional tensors, or a dict of keyword arguments);
- a mapping (e.g. a Hugging Face tokenizer's ``BatchEncoding``): ``model(**batch)``.

Floating-point tensors are cast to the model's floating dtype; integer tensors (token ids,
attention masks) keep their dtype. Everything moves to the model's device.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from brevitas.utils.torch_utils import StopFwdException
from torch import nn
from tqdm.auto import tqdm

from quark_brevitas.errors import CalibrationDataError, ModelError

logger = logging.getLogger(__name__)

ALLOWED_BATCHES = "a tensor, an (inputs, target) tuple/list, or a dict of keyword arguments"


def model_device_dtype(model: nn.Module) -> tuple[torch.device, torch.dtype]:
    """Device and floating dtype of the model, taken from its first floating parameter or buffer."""
    for tensor in list(model.parameters()) + list(model.buffers()):
        if tensor.is_floating_point():
            return tensor.device, tensor.dtype
    raise ModelError(f"{type(model).__name__} has no floating-point parameters or buffers: nothing to quantize")


def _move(value: Any, device: torch.device, dtype: torch.dtype, index: int, where: str) -> Any:
    if isinstance(value, torch.Tensor):
        if value.is_floating_point():
            if not torch.isfinite(value).all():
                bad = int((~torch.isfinite(value)).sum())
                raise CalibrationDataError(
                    f"calibration batch {index}: {where} contains {bad} NaN/Inf value(s); "
                    "calibration data must be finite"
                )
            return value.to(device=device, dtype=dtype)
        return value.to(device=device)
    if isinstance(value, Mapping):
        return {k: _move(v, device, dtype, index, f"{where}[{k!r}]") for k, v in value.items()}
    if isinstance(value, tuple | list):
        return type(value)(_move(v, device, dtype, index, f"{where}[{i}]") for i, v in enumerate(value))
    return value


def split_batch(batch: Any, index: int) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Turn one batch into ``(args, kwargs)`` for the model's forward call."""
    if isinstance(batch, torch.Tensor):
        return (batch,), {}
    if isinstance(batch, Mapping):
        return (), dict(batch)
    if isinstance(batch, tuple | list):
        if len(batch) == 0:
            raise CalibrationDataError(f"calibration batch {index}: empty {type(batch).__name__}; expected "
                                       f"{ALLOWED_BATCHES}")
        first = batch[0]
        if isinstance(first, Mapping):
            return (), dict(first)
        if isinstance(first, tuple | list):
            return tuple(first), {}
        if isinstance(first, torch.Tensor):
            return (first,), {}
        raise CalibrationDataError(
            f"calibration batch {index}: first element is a {type(first).__name__}; expected a tensor, "
            "a tuple of tensors or a dict of keyword arguments"
        )
    raise CalibrationDataError(f"calibration batch {index}: got a {type(batch).__name__}; expected {ALLOWED_BATCHES}")


def prepare_batch(batch: Any, index: int, device: torch.device, dtype: torch.dtype
                  ) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Split, check and move one batch; see the module docstring for the conventions."""
    args, kwargs = split_batch(batch, index)
    return _move(args, device, dtype, index, "input"), _move(kwargs, device, dtype, index, "input")


def forward_batch(model: nn.Module, batch: Any, index: int) -> Any:
    """Run the model on one batch; a failure is re-raised naming the batch index."""
    device, dtype = model_device_dtype(model)
    args, kwargs = prepare_batch(batch, index, device, dtype)
    try:
        return model(*args, **kwargs)
    except StopFwdException:
        raise  # Brevitas's GPxQ algorithms stop the forward pass on purpose.
    except Exception as exc:
        raise CalibrationDataError(
            f"calibration batch {index}: the model rejected it ({type(exc).__name__}: {exc})"
        ) from exc


def run_batches(model: nn.Module, loader: Iterable[Any] | None, desc: str) -> int:
    """Forward every batch of ``loader`` through ``model`` without gradients; return the count.

    Raises :class:`CalibrationDataError` for a missing or empty loader and for bad batches.
    """
    if loader is None:
        raise CalibrationDataError(f"{desc} needs calibration data: pass calib_loader")
    count = 0
    with torch.no_grad():
        for index, batch in enumerate(tqdm(loader, desc=desc, leave=False, disable=None)):
            forward_batch(model, batch, index)
            count += 1
    if count == 0:
        raise CalibrationDataError(f"{desc}: the calibration loader yielded no batches")
    logger.debug("%s: %d batches", desc, count)
    return count


__all__ = ["forward_batch", "model_device_dtype", "prepare_batch", "run_batches", "split_batch"]
