"""What every Hugging Face checkpoint format that :func:`~quark_brevitas.export.export_safetensors` writes shares:
the exact per-layer codes (:class:`LayerCodes`), the format as a strategy (:class:`HFFormat`), the refusal that
names the layer and what the format holds (:class:`UnfitLayerError`), and the folder helpers.

Why a strategy: the walk over the model, the proof that each layer's codes are its quantized weight, the
untying, sharding (streamed checkpoints) and the atomic folder are the same for every consumer; only the tensor
names / packing and the ``quantization_config`` differ. A format is one :class:`HFFormat` value
(compressed-tensors in :mod:`~quark_brevitas.export.hf.checkpoints`, AMD Quark's in
:mod:`~quark_brevitas.export.hf.quark`). This module imports neither, so both can import it.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from quark_brevitas.export.errors import ExportArgumentError, ExportError
from quark_brevitas.export.tokenizer_files import TOKENIZER_COPIED, TOKENIZER_FILES

__all__ = ["TOKENIZER_COPIED", "TOKENIZER_FILES", "HFFormat", "LayerCodes", "TensorFormat", "UnfitLayerError",
           "config_json", "untie", "write_tokenizer"]


@dataclass(frozen=True)
class TensorFormat:
    """One quantized tensor's format (compressed-tensors' ``QuantizationArgs`` terms, which every format maps)."""

    type: str  # "int" | "float"
    num_bits: int
    symmetric: bool
    strategy: str  # "tensor" | "channel" | "group" | "token"
    group_size: int | None = None
    dynamic: bool = False

    def args(self) -> dict[str, Any]:
        """The keyword arguments of ``compressed_tensors.quantization.QuantizationArgs``."""
        args: dict[str, Any] = {"num_bits": self.num_bits, "type": self.type, "symmetric": self.symmetric,
                                "strategy": self.strategy, "dynamic": self.dynamic}
        if self.group_size is not None:
            args["group_size"] = self.group_size
        if not self.symmetric:
            args["zp_dtype"] = torch.int8
        if self.type == "int" and self.strategy == "group":
            args["actorder"] = None
        return args


@dataclass
class LayerCodes:
    """A quantized Linear layer's exact codes, before a format encodes them.

    ``codes``: signed int8 codes (``[out, in]``) or ``float8_e4m3fn`` values; ``scale`` / ``zero_point``: ``[1]``,
    ``[out, 1]`` or ``[out, groups]`` (``zero_point`` signed int8, ``None`` when symmetric). ``(codes - zero_point)
    * scale`` is the layer's quantized weight exactly. Signed codes with signed zero points are not a loss: an
    unsigned code ``u`` with zero point ``z`` is stored as ``u - 2^(b-1)``, ``z - 2^(b-1)`` (same differences), and
    a format with unsigned types shifts both back.
    """

    name: str
    weight: TensorFormat
    codes: torch.Tensor
    scale: torch.Tensor
    zero_point: torch.Tensor | None
    activation: TensorFormat | None = None
    input_scale: torch.Tensor | None = None
    input_zero_point: torch.Tensor | None = None
    bias: torch.Tensor | None = None
    pack_zero_point: bool = False

    def dequantize(self) -> torch.Tensor:
        """The weight the consumer computes with (group scales expanded along the input dimension)."""
        codes = self.codes.float()
        scale = self.scale.float()
        zero = self.zero_point.float() if self.zero_point is not None else torch.zeros_like(scale)
        if self.weight.strategy == "group":
            size = int(self.weight.group_size or 0)
            scale = scale.repeat_interleave(size, dim=1)[:, :codes.shape[1]]
            zero = zero.repeat_interleave(size, dim=1)[:, :codes.shape[1]]
        return (codes - zero) * scale


class UnfitLayerError(ExportError):
    """A layer the format cannot hold; the message names the layer, why, and what the format holds."""

    def __init__(self, layer: str, why: str, fits: str) -> None:
        super().__init__(f"layer '{layer}': {why}; {fits}")
        self.layer, self.why = layer, why


@dataclass(frozen=True)
class HFFormat:
    """One Hugging Face checkpoint format: how it stores a layer and what its ``quantization_config`` says.

    ``fits``: one sentence saying what the format holds (the end of every refusal). ``check``: raises
    :class:`UnfitLayerError` for a layer the exact codes describe but the format cannot hold. ``encode``: the
    layer's tensors under the format's names (without the layer prefix). ``quantization_config``: ``config.json``'s
    ``quantization_config`` from every written layer and the float Linear layers.
    """

    name: str
    fits: str
    encode: Callable[[LayerCodes], dict[str, torch.Tensor]]
    quantization_config: Callable[[list[LayerCodes], list[str]], dict[str, Any]]
    check: Callable[[LayerCodes], None] = field(default=lambda entry: None)

    def refuse(self, layer: str, why: str) -> UnfitLayerError:
        return UnfitLayerError(layer, why, self.fits)


def untie(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """safetensors refuses tensors that share memory (tied embeddings): keep the first name of each storage."""
    seen: set[tuple[int, int]] = set()
    kept: dict[str, torch.Tensor] = {}
    for key, tensor in tensors.items():
        ident = (tensor.untyped_storage().data_ptr(), tensor.storage_offset()) if tensor.numel() else (id(tensor), 0)
        if ident in seen and tensor.numel():
            continue
        seen.add(ident)
        kept[key] = tensor.contiguous().cpu()
    return kept


def config_json(hf_config: Any, quantization_config: Mapping[str, Any], architecture: str | None = None) -> str:
    """``config.json`` of a written folder. ``architecture``: the model's class, recorded in ``architectures`` when
    the config does not list it (as ``save_pretrained`` does): readers that build the model from the folder (Quark's
    ``import_model_from_safetensors(None, ...)``, vLLM) find the class there."""
    data = copy.deepcopy(hf_config.to_dict())
    if architecture is not None and not data.get("architectures"):
        data["architectures"] = [architecture]
    data["quantization_config"] = dict(quantization_config)
    return json.dumps(data, indent=2, sort_keys=True, default=str) + "\n"


def write_tokenizer(tokenizer: Any, work: Path, shown: Path | None = None) -> None:
    """Write the tokenizer into the folder being built (``work``, which becomes ``shown``).

    ``tokenizer`` a folder (path): its tokenizer files are copied byte for byte, not re-serialised (transformers
    re-saves some tokenizers as other ones: Qwen2's gains an ``<|endoftext|>`` id), then read back and compared with
    the source files before the folder is moved into place. A loaded tokenizer (``save_pretrained``) is saved by
    transformers, and every JSON file it wrote is read back and parsed."""
    from quark_brevitas.export.readback import ReadBackError, verify_copied_files

    if tokenizer is None:
        return
    shown = work if shown is None else shown
    if isinstance(tokenizer, str | os.PathLike):
        source = Path(tokenizer)
        names = [name for name in TOKENIZER_COPIED if (source / name).is_file()]
        if not any(name in TOKENIZER_FILES for name in names):
            raise ExportArgumentError(f"tokenizer folder {str(source)!r} has no tokenizer (none of "
                                      f"{', '.join(TOKENIZER_FILES)})")
        for name in names:
            shutil.copyfile(source / name, work / name)
        verify_copied_files(work, shown, source, names)
        return
    if not hasattr(tokenizer, "save_pretrained"):
        raise ExportArgumentError(f"tokenizer must be a folder or have save_pretrained (a transformers tokenizer), "
                                  f"got {type(tokenizer).__name__}")
    written = tokenizer.save_pretrained(str(work))
    for path in map(Path, written or ()):
        if path.suffix == ".json" and path.is_file():
            try:
                json.loads(path.read_text(encoding="utf-8"))
            except ValueError as exc:
                raise ReadBackError(shown / path.name, None, f"is not valid JSON ({exc})") from exc
