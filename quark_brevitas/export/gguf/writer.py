"""GGUF export (llama.cpp's file format) of weight-only quantized decoder LMs, written from our own integer codes.

:func:`export_gguf` (Quark's name and arguments) writes one ``.gguf`` file with the architecture metadata,
the tokenizer and every tensor of a quantized Hugging Face decoder: quantized Linear weights packed block by
block from :func:`~quark_brevitas.export.intweights.integer_weights` (never re-quantized), everything else as F32.
GGUF block types hold one float16 scale (Q4_1: and one float16 offset) per 32 consecutive input channels:

- ``Q8_0``: int8 symmetric weights per group of 32;
- ``Q4_0``: int4 symmetric weights per group of 32 (stored as ``code + 8``);
- ``Q4_1``: uint4 asymmetric weights per group of 32 (``d * q + m`` with ``m = -zero_point * scale``).

The presets ``gguf_q4_0``, ``gguf_q4_1`` and ``gguf_q8_0`` (``scale_type=float16``) make those scales float16
numbers, so the file is exact: the ``gguf`` package dequantizes every block to the quantized model's weight bit
for bit, and the exporter checks that before it writes. The K-quants ``Q6_K`` / ``Q3_K`` hold int6 / int3
symmetric weights per group of 16 whose scales are, per 256 input channels, integer multiples of one float16
number: ``scale_type=gguf_k`` (presets ``gguf_q6_k`` / ``gguf_q3_k``) makes them so, and gives rows of no whole
256 the grid of the 32-channel type llama.cpp falls back to (:mod:`quark_brevitas.export.gguf.kquants`).

Families: Llama, Mistral, Qwen2 and GPT-2 (whose Conv1D weights, stored ``[in, out]``, are written ``[out, in]`` as
llama.cpp's converter writes them), issue 30's families and the mixture-of-experts Mixtral, Qwen2-MoE and Qwen3-MoE
(experts stacked as llama.cpp stores them: :mod:`quark_brevitas.export.gguf.experts`). A head tied to the
embedding is written as its own tensor (``output``), with its quantized weight. A model GGUF cannot hold (another
weight format, quantized activations, a layer with no GGUF tensor, a family llama.cpp's graph does not compute as
configured) raises one :class:`ExportError` naming the layer
and what fits.
The output folder is written through :mod:`quark_brevitas.outputs` (complete or untouched).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from quark_brevitas.brevitas_adapter import iter_quantizers
from quark_brevitas.brevitas_adapter.kquant import is_kquant_layer
from quark_brevitas.config.kquants import KQUANT_BY_BITS, KQUANT_SUPER_BLOCK, KQUANT_TYPES
from quark_brevitas.errors import QuarkBrevitasError
from quark_brevitas.export.errors import ExportArgumentError, ExportError, ExportMismatchError
from quark_brevitas.export.gguf.bert import BERT_DROPPED, add_bert_architecture, add_wordpiece_tokenizer
from quark_brevitas.export.gguf.experts import (
    ExpertStacks,
    add_moe_metadata,
    check_moe_config,
    fused_expert_tensors,
    refuse_quantized_router,
    squeeze_shared_gate,
)
from quark_brevitas.export.gguf.families import add_family_metadata, rope_freqs, rope_theta
from quark_brevitas.export.gguf.kquants import KQUANT_FALLBACK, KQUANT_PACKERS, kquant_fallback
from quark_brevitas.export.gguf.q5 import Q5_PACKERS
from quark_brevitas.export.gguf.tokenizer import add_tokenizer, check_tokenizer_fits, tokenizer_dir_of
from quark_brevitas.export.hf.models import refuse_online_rotations
from quark_brevitas.export.intweights import IntegerWeight, integer_weights
from quark_brevitas.export.readback import verify_gguf_file
from quark_brevitas.extras import require
from quark_brevitas.outputs import output_dir as atomic_output_dir

__all__ = ["GGUF_FAMILIES", "GGUF_FILE_NAME", "GGUF_WEIGHT_TYPES", "GGUFFamily", "GGUFPlan", "GGUFTensor",
           "check_gguf_blocks", "check_tokenizer_fits", "collect_checked", "collect_gguf_tensors", "export_gguf",
           "float16_weights", "plan_gguf", "refuse_activation_quantizers", "tokenizer_dir_of", "write_gguf"]

logger = logging.getLogger(__name__)

#: The file written into ``output_dir``.
GGUF_FILE_NAME = "model.gguf"
#: GGUF block size of the legacy types written here (elements per scale).
BLOCK = 32

#: (format, symmetric) of an integer weight -> GGUF type name.
GGUF_WEIGHT_TYPES: dict[tuple[str, bool], str] = {("int8", True): "Q8_0", ("int4", True): "Q4_0",
                                                   ("uint4", False): "Q4_1", ("int6", True): "Q6_K",
                                                   ("int3", True): "Q3_K", ("int5", True): "Q5_0",
                                                   ("uint5", False): "Q5_1"}
#: GGUF type -> (input channels per scale, input channels a row must be a whole number of).
_LAYOUTS = {**{name: (BLOCK, BLOCK) for name in ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1")},
            **{name: (t.group_size, KQUANT_SUPER_BLOCK) for name, t in KQUANT_TYPES.items()}}
_FITS = ("Q8_0 (int8 symmetric, groups of 32), Q4_0 / Q5_0 (int4 / int5 symmetric, groups of 32) or Q4_1 / Q5_1 "
         "(uint4 / uint5 asymmetric, groups of 32), all with float16 scales: presets gguf_q8_0 / gguf_q4_0 / "
         "gguf_q4_1, or bit_width=5 with scale_type=float16; K-quants Q2_K .. Q6_K "
         "(int2 .. int6 symmetric, groups of 16 or 32, scale_type=gguf_k: presets gguf_q2_k .. gguf_q6_k)")


@dataclass(frozen=True)
class GGUFFamily:
    """How one Hugging Face model type is written: the llama.cpp architecture, whether Q/K rows are permuted
    (llama.cpp's rotary layout for Llama-style attention, which transformers' loader undoes), which metadata its
    hyperparameters take (``"llama"``: rotary, RMSNorm; ``"gpt2"``: learned positions, LayerNorm), the
    tokenizer's pre-tokenizer name, and what llama.cpp adds to the norms' weights (Gemma's ``(1 + weight)``
    RMSNorm: 1, see :mod:`quark_brevitas.export.gguf.families`)."""

    arch: str
    permute_qk: bool
    metadata: str = "llama"
    tokenizer_pre: str = "default"
    norm_offset: float = 0.0
    dropped: tuple[str, ...] = ()  # parameter-name prefixes llama.cpp's converter leaves out
    display_name: str | None = None  # general.name (None: the model_type)


#: model_type -> how it is written (the families transformers' GGUF loader reads back).
GGUF_FAMILIES: dict[str, GGUFFamily] = {
    "llama": GGUFFamily("llama", True),
    # llama.cpp's converter writes Mistral as its llama architecture, named after the model ("Mistral 7B v0.1").
    # transformers' GGUF loader turns a llama file whose general.name is exactly "mistral" into model_type
    # "mistral", then looks that up in gguf-py's architectures, which have none (Unknown gguf model_type); under
    # any other name it loads the file as the Llama that computes the same function (Mistral's sliding window
    # aside, which llama.cpp's llama architecture does not apply either).
    "mistral": GGUFFamily("llama", True, display_name="Mistral"),
    "qwen2": GGUFFamily("qwen2", False),
    # issue 30's families, NEOX-style rotary in llama.cpp (no Q/K permutation), metadata in gguf_families
    "qwen3": GGUFFamily("qwen3", False),
    "phi3": GGUFFamily("phi3", False),
    "gemma2": GGUFFamily("gemma2", False, norm_offset=1.0),
    "gemma3_text": GGUFFamily("gemma3", False, norm_offset=1.0),
    # Mixture of experts (quark_brevitas.export.gguf.experts): Mixtral is llama.cpp's llama architecture with
    # stacked experts (general.name "Mixtral"), the Qwen MoEs have architectures of their own.
    "mixtral": GGUFFamily("llama", True, display_name="Mixtral"),
    "qwen2_moe": GGUFFamily("qwen2moe", False),
    "qwen3_moe": GGUFFamily("qwen3moe", False),
    # GPT-2's projections are Conv1D (weight [in, out]); GGUF holds them as [out, in], as llama.cpp's converter
    # writes them and transformers' loader transposes back (our QuantConv1D already holds that layout).
    "gpt2": GGUFFamily("gpt2", False, metadata="gpt2", tokenizer_pre="gpt-2"),
    # BERT sentence encoders (llama.cpp's embedding models): WordPiece vocabulary, pooling, no pooler tensor.
    "bert": GGUFFamily("bert", False, metadata="bert", dropped=BERT_DROPPED),
}


# ===================================================================== weights
def gguf_type(name: str, entry: IntegerWeight, kquant: bool = False) -> str:
    """The GGUF type of a quantized layer's weight (``kquant``: its scales are ``scale_type=gguf_k`` ones), or the
    ExportError saying what fits."""
    symmetric = entry.zero_point.numel() == 1 and not entry.zero_point.any()
    qtype = GGUF_WEIGHT_TYPES.get((entry.format, symmetric))
    if kquant and symmetric and entry.format in {f"int{bits}" for bits in KQUANT_BY_BITS}:
        qtype = KQUANT_BY_BITS[entry.bit_width].name
    elif kquant and entry.offset_dequantization and entry.format in {
            f"uint{t.bit_width}" for t in KQUANT_TYPES.values() if t.with_minimum}:
        qtype = KQUANT_BY_BITS[entry.bit_width].name  # asymmetric K grid: d * sc * q - dmin * m
    layout = (f"per group of {entry.group_size}" if entry.group_size else
              "per channel" if entry.axis is not None else "per tensor")
    group, row = _LAYOUTS.get(qtype, (0, 0))
    if qtype is None or entry.group_size != group or entry.axis != 1 or entry.int_weight.dim() != 2:
        raise ExportError(f"layer '{name}' has {entry.format} {'symmetric' if symmetric else 'asymmetric'} weights "
                          f"{layout}, which no GGUF type holds; GGUF types that fit: {_FITS}")
    if entry.int_weight.shape[1] % row and qtype not in KQUANT_FALLBACK:
        raise ExportError(f"layer '{name}' has {entry.int_weight.shape[1]} input channels, not a multiple of "
                          f"{row} (the GGUF block); {qtype} needs whole blocks")
    return qtype


def _float16_exact(name: str, what: str, values: torch.Tensor) -> np.ndarray:
    """``values`` as float16, refused unless that is exact (GGUF stores scales as float16)."""
    half = values.to(torch.float16)
    if not torch.equal(half.to(values.dtype), values):
        raise ExportError(f"layer '{name}': its {what} are not float16 numbers, so GGUF cannot store them exactly; "
                          "quantize with scale_type=float16 (presets gguf_q8_0 / gguf_q4_0 / gguf_q4_1)")
    return half.numpy()


def pack_gguf_tensor(name: str, entry: IntegerWeight, qtype: str) -> np.ndarray:
    """The GGUF blocks of one weight as ``uint8 [rows, bytes per row]`` (llama.cpp's layout: float16 scale
    (Q4_1: then offset), then the 32 codes; 4-bit codes two per byte, element ``j`` low and ``j + 16`` high)."""
    if qtype in KQUANT_PACKERS:
        return KQUANT_PACKERS[qtype](name, entry)
    if qtype in Q5_PACKERS:
        return Q5_PACKERS[qtype](name, entry)
    rows, cols = entry.int_weight.shape
    scale = entry.scale.detach().float().reshape(-1, 1)
    d = _float16_exact(name, "scales", scale).view(np.uint8)
    codes = entry.int_weight.to(torch.int32).reshape(-1, BLOCK)
    if qtype == "Q8_0":
        return np.concatenate([d, codes.to(torch.int8).numpy().view(np.uint8)], axis=1).reshape(rows, -1)
    if qtype == "Q4_0":
        nibbles = (codes + 8).to(torch.uint8).numpy()
        parts = [d]
    else:
        nibbles = codes.to(torch.uint8).numpy()
        offset = -entry.zero_point.float().reshape(-1, 1) * scale
        parts = [d, _float16_exact(name, "offsets (-zero_point * scale)", offset).view(np.uint8)]
    packed = nibbles[:, :16] | (nibbles[:, 16:] << np.uint8(4))
    return np.concatenate([*parts, packed], axis=1).reshape(rows, -1)


def _permute_rows(array: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's Q/K row order for rotary embeddings (its ``permute``): within each head, the two halves of
    the head dimension interleaved. Applied to packed blocks too: it moves whole rows."""
    rows = array.shape[0]
    return (array.reshape(heads, 2, rows // heads // 2, *array.shape[1:]).swapaxes(1, 2)
            .reshape(array.shape))


# ===================================================================== model checks and metadata
def refuse_activation_quantizers(model: nn.Module) -> None:
    for site in iter_quantizers(model):
        if site.kind != "weight":
            raise ExportError(f"layer '{site.layer_name or '(model)'}' quantizes its {site.attribute} "
                              f"({site.kind}); GGUF holds weight-only models: float activations with weights in "
                              f"{_FITS}")


def _config_value(config: Any, *names: str, default: Any = None) -> Any:
    for name in names:
        value = getattr(config, name, None)
        if value is not None:
            return value
    rope = getattr(config, "rope_parameters", None) or {}
    for name in names:
        if isinstance(rope, dict) and rope.get(name) is not None:
            return rope[name]
    return default


def _add_architecture(writer: Any, config: Any, family_name: str, family: GGUFFamily) -> None:
    if family.metadata == "gpt2":
        _add_gpt2_architecture(writer, config, family_name)
        return
    heads = int(config.num_attention_heads)
    head_dim = _config_value(config, "head_dim", default=config.hidden_size // heads)
    writer.add_name(family.display_name or family_name)
    writer.add_context_length(int(config.max_position_embeddings))
    writer.add_embedding_length(int(config.hidden_size))
    writer.add_block_count(int(config.num_hidden_layers))
    writer.add_feed_forward_length(int(config.intermediate_size))
    writer.add_head_count(heads)
    writer.add_head_count_kv(int(_config_value(config, "num_key_value_heads", default=heads)))
    writer.add_rope_dimension_count(int(head_dim))
    writer.add_rope_freq_base(rope_theta(config, family_name, float(_config_value(config, "rope_theta",
                                                                                  default=10000.0))))
    writer.add_layer_norm_rms_eps(float(config.rms_norm_eps))
    writer.add_vocab_size(int(config.vocab_size))
    add_family_metadata(writer, config, family_name)
    add_moe_metadata(writer, config, family_name)


#: What transformers' GGUF loader assumes of a GPT-2 file instead of reading it: GPT2Config's defaults.
_GPT2_LOADER_POSITIONS = 1024


def _add_gpt2_architecture(writer: Any, config: Any, family_name: str) -> None:
    """GPT-2's hyperparameters as llama.cpp's ``gpt2`` architecture names them (learned positions, LayerNorm)."""
    width = int(config.n_embd)
    inner = getattr(config, "n_inner", None) or 4 * width
    writer.add_name(family_name)
    writer.add_context_length(int(config.n_positions))
    writer.add_embedding_length(width)
    writer.add_block_count(int(config.n_layer))
    writer.add_feed_forward_length(int(inner))
    writer.add_head_count(int(config.n_head))
    writer.add_layer_norm_eps(float(config.layer_norm_epsilon))
    writer.add_vocab_size(int(config.vocab_size))
    differ = [f"n_positions={config.n_positions}"] if int(config.n_positions) != _GPT2_LOADER_POSITIONS else []
    differ += [f"n_inner={inner}"] if inner != 4 * width else []
    if differ:
        logger.warning("export_gguf: this GPT-2 has %s; llama.cpp reads them from the file, but transformers' GGUF "
                       "loader assumes n_positions=%d and n_inner=4*n_embd (and takes the vocabulary size from the "
                       "tokenizer)", ", ".join(differ), _GPT2_LOADER_POSITIONS)


# ===================================================================== tensors
@dataclass(frozen=True)
class GGUFTensor:
    """One tensor of the file, packed, with what its blocks must dequantize to."""

    name: str  # GGUF name
    data: np.ndarray
    qtype: str  # "F32", "F16" or a GGUF block type
    expected: np.ndarray | None = None  # quantized: the weight the blocks must dequantize to (GGUF's row order)
    digest: str | None = None  # SHA-256 of ``data`` when it was proven (set when ``data`` moves out of memory)


def _gguf_name(name_map: Any, hf_name: str) -> str | None:
    module, _, leaf = hf_name.rpartition(".")
    mapped = name_map.get_name(module)
    return None if mapped is None else f"{mapped}.{leaf}"


def _required_name(name_map: Any, hf_name: str, family: GGUFFamily, quantized: bool) -> str:
    """The GGUF name of ``hf_name``, or the ExportError saying the architecture has no such tensor."""
    name = _gguf_name(name_map, hf_name)
    if name is None:
        what = "quantized layer" if quantized else "tensor"
        raise ExportError(f"{what} '{hf_name}' has no GGUF tensor in llama.cpp's '{family.arch}' architecture; "
                          "GGUF holds the layers of that architecture only")
    return name


def _float_conv1d(module: nn.Module) -> bool:
    """Hugging Face's float ``Conv1D`` (GPT-2), whose weight is stored ``[in, out]`` (our QuantConv1D is a Linear)."""
    return type(module).__name__ == "Conv1D" and hasattr(module, "nf") and not isinstance(module, nn.Linear)


def _refuse_float_conv1d(model: nn.Module, prefix: str, weights: dict[str, IntegerWeight]) -> None:
    """A GPT-2 (block) whose Conv1D projections are all float: the GGUF would be a float model with a quantized
    head, which is what the ``gguf_*`` presets give GPT-2 (they quantize ``nn.Linear`` layers only)."""
    floats = [prefix + name for name, module in model.named_modules() if _float_conv1d(module)]
    if floats and not any(type(model.get_submodule(name)).__name__ == "QuantConv1D" for name in weights):
        raise ExportError(f"GPT-2's Conv1D projections ({', '.join(floats[:4])}{', ...' if len(floats) > 4 else ''}) "
                          "are not quantized, so the GGUF would hold them as F32; the gguf_* presets quantize "
                          "nn.Linear layers only. Quantize Conv1D too: layer_type_quant_config={\"Linear\": layer, "
                          "\"Conv1D\": layer} with the preset's QuantizationConfig as layer")


def collect_gguf_tensors(model: nn.Module, family: GGUFFamily, name_map: Any, config: Any, prefix: str = "",
                         skip: str | None = None) -> list[GGUFTensor]:
    """The GGUF tensors of ``model`` (the whole model, or one block of it whose parameter names start with
    ``prefix`` in the whole model), packed from its integer codes; parameters under ``skip`` are left out (the
    block stack, when the rest of a model is written without it). A parameter shared by two layers (a head tied
    to the embedding) is written under each name: the head's own GGUF tensor holds its quantized weight."""
    weights = integer_weights(model, embeddings=True)
    if family.metadata == "gpt2":
        _refuse_float_conv1d(model, prefix, weights)
    heads, kv_heads = int(config.num_attention_heads), int(_config_value(config, "num_key_value_heads",
                                                                         default=config.num_attention_heads))
    tensors, written, stacks = [], set(), ExpertStacks(model, prefix)
    for local_name, param in model.named_parameters(remove_duplicate=False):
        if skip is not None and local_name.startswith(f"{skip}."):
            continue
        if (prefix + local_name).startswith(family.dropped):
            continue
        layer, _, leaf = local_name.rpartition(".")
        inside = [q for q in weights if local_name.startswith(f"{q}.") and local_name != f"{q}.weight"]
        if inside and not (layer in weights and leaf == "bias"):
            continue  # quantizer internals (scales, zero points) of a quantized layer
        fused = fused_expert_tensors(local_name, param, prefix)
        if fused is not None:  # transformers' fused (float) experts: llama.cpp's stacks as they are
            tensors += [GGUFTensor(_required_name(name_map, prefix + stacked, family, False), data, "F32")
                        for stacked, data in fused]
            continue
        expert = stacks.stacked_name(local_name)  # an unfused expert: one slice of llama.cpp's stacked tensor
        hf_name = prefix + (expert[0] if expert else local_name)
        name = _gguf_name(name_map, hf_name)
        if name is None and id(param) in written and layer not in weights:
            continue  # a float head tied to the embedding, in an architecture that reads token_embd (Gemma 2)
        name = _required_name(name_map, hf_name, family, layer in weights)
        rows_heads = heads if ".attn_q." in name else kv_heads if ".attn_k." in name else None
        if layer in weights and leaf == "weight":
            refuse_quantized_router(name, prefix + layer)
            entry = weights[layer]
            qtype = gguf_type(prefix + layer, entry, is_kquant_layer(model.get_submodule(layer)))
            if qtype in KQUANT_FALLBACK and entry.int_weight.shape[1] % KQUANT_SUPER_BLOCK:
                entry, qtype = kquant_fallback(prefix + layer, entry, qtype)
            expected = entry.dequantize().detach().float().numpy()
            data = expected if qtype == "F32" else pack_gguf_tensor(prefix + layer, entry, qtype)
        else:
            qtype, data, expected = "F32", param.detach().float().cpu().numpy(), None
            if leaf == "weight" and _float_conv1d(model.get_submodule(layer)):
                data = data.T  # [in, out] -> [out, in], as for a quantized Conv1D
            if family.norm_offset and name.endswith("norm.weight"):
                data = data + np.float32(family.norm_offset)  # llama.cpp stores Gemma's (1 + weight)
            data = squeeze_shared_gate(name, data)
        written.add(id(param))
        if expert is not None:
            stacked = stacks.add(local_name, qtype, data, expected)
            if stacked is None:
                continue  # the stack is written once its last expert is in
            _, qtype, data, expected = stacked
        if family.permute_qk and rows_heads is not None:
            data = _permute_rows(data, rows_heads)
            expected = None if expected is None else _permute_rows(expected, rows_heads)
        tensors.append(GGUFTensor(name, np.ascontiguousarray(data), qtype, expected))
    stacks.check_complete()
    return tensors


def check_gguf_blocks(gguf: Any, tensors: list[GGUFTensor]) -> None:
    """Prove every packed weight: the ``gguf`` package's own dequantization gives the quantized weight exactly."""
    for tensor in tensors:
        if tensor.expected is None:
            continue
        decoded = gguf.quants.dequantize(tensor.data, gguf.GGMLQuantizationType[tensor.qtype])
        diff = float(np.abs(decoded - tensor.expected).max()) if decoded.size else 0.0
        if decoded.shape != tensor.expected.shape or diff != 0.0:
            raise ExportMismatchError(f"GGUF tensor '{tensor.name}' ({tensor.qtype}) does not dequantize to the "
                                      f"quantized weight (max difference {diff:.3g}); please report this",
                                      max_abs_diff=diff, tolerance=0.0, path=Path(GGUF_FILE_NAME))


# ===================================================================== entry point
def float16_weights(tensors: list[GGUFTensor]) -> list[GGUFTensor]:
    """``tensors`` with every float (not quantized) matrix (and stack of expert matrices) as F16, vectors (norms,
    biases) kept F32: the F16 file llama.cpp's converter writes (``--outtype f16``)."""
    return [GGUFTensor(t.name, t.data.astype(np.float16), "F16") if t.qtype == "F32" and t.expected is None
            and t.data.ndim >= 2 else t for t in tensors]


def export_gguf(quant_model: nn.Module, output_dir: str | os.PathLike[str], model_type: str | None = None,
                tokenizer_path: str | os.PathLike[str] | None = None, *, overwrite: bool = False,
                float_type: str = "F32") -> Path:
    """Write ``output_dir/model.gguf`` for llama.cpp (and transformers' ``gguf_file=`` loader); returns its path.

    Args:
        quant_model: A weight-only quantized Hugging Face decoder (Llama incl. 3.x, Mistral, Qwen2, Qwen3, Gemma 2,
            Gemma 3 text, Phi-3, GPT-2; Mixtral, Qwen2-MoE, Qwen3-MoE with unfused experts) whose quantized
            Linear weights are int8/int4 symmetric or uint4 asymmetric per group of 32 with float16 scales
            (presets ``gguf_q8_0``, ``gguf_q4_0``, ``gguf_q4_1``; GPTQ/AWQ may choose the codes). GPT-2's
            projections are Conv1D layers, which the presets do not quantize: give ``"Conv1D"`` the preset's layer
            config in ``layer_type_quant_config`` too (a GPT-2 whose Conv1D layers all stay float is refused).
        output_dir: The folder to write; written whole or not at all (a folder holding files quark_brevitas did
            not write is refused).
        model_type: The family (a key of :data:`GGUF_FAMILIES`: ``"llama"``, ``"qwen3"``, ``"gemma2"``, ...);
            ``None``: the model config's
            ``model_type``.
        tokenizer_path: A folder with the model's ``tokenizer.json`` (byte-level BPE); ``None``: the model's own
            folder if it has one, else the file has no tokenizer (a warning says so).
        overwrite: Write into a folder holding files quark_brevitas did not write (only ours are replaced).
        float_type: ``"F32"`` or ``"F16"``: the type of the weight matrices that are not quantized (a float model
            as an F16 file, as llama.cpp's converter writes it; vectors stay F32 either way).
    """
    if float_type not in ("F32", "F16"):
        raise ExportArgumentError(f"float_type must be 'F32' or 'F16', got {float_type!r}")
    if not isinstance(quant_model, nn.Module):
        raise ExportArgumentError(f"quant_model must be a torch.nn.Module, got {type(quant_model).__name__}")
    config = getattr(quant_model, "config", None)
    plan = plan_gguf(config, model_type, tokenizer_dir_of(quant_model, tokenizer_path))
    refuse_online_rotations(quant_model, "GGUF")
    refuse_activation_quantizers(quant_model)
    with torch.no_grad():
        tensors = collect_checked(lambda: collect_gguf_tensors(quant_model, plan.family, plan.name_map, config))
    if float_type == "F16":
        tensors = float16_weights(tensors)
    check_gguf_blocks(plan.gguf, tensors)
    path = write_gguf(plan, config, tensors, output_dir, overwrite=overwrite)
    logger.info("Wrote %s (%d tensors, %d quantized)", path, len(tensors), sum(t.expected is not None for t in tensors))
    return path


@dataclass(frozen=True)
class GGUFPlan:
    """What writing one model needs: the ``gguf`` package, the family, llama.cpp's tensor names and the
    tokenizer folder (``None``: no tokenizer)."""

    gguf: Any
    family_name: str
    family: GGUFFamily
    name_map: Any
    tokenizer_dir: Path | None


def plan_gguf(config: Any, model_type: str | None, tokenizer_dir: Path | None) -> GGUFPlan:
    """Check the family (``model_type``, else the config's) and prepare its tensor name map."""
    family_name = model_type if model_type is not None else getattr(config, "model_type", None)
    if config is None or family_name not in GGUF_FAMILIES:
        raise ExportError(f"model_type {family_name!r} cannot be written as GGUF; supported: "
                          f"{', '.join(GGUF_FAMILIES)} (Hugging Face models with a config)")
    check_moe_config(config, family_name)
    gguf = require("gguf", "GGUF export")
    family = GGUF_FAMILIES[family_name]
    arch = next(key for key, value in gguf.MODEL_ARCH_NAMES.items() if value == family.arch)
    name_map = gguf.get_tensor_name_map(arch, int(config.num_hidden_layers))
    return GGUFPlan(gguf, family_name, family, name_map, tokenizer_dir)


def collect_checked(collect: Any) -> list[GGUFTensor]:
    """``collect()``, with a project error from the integer weights reported as the ExportError it is here."""
    try:
        return collect()
    except ExportError:
        raise
    except QuarkBrevitasError as exc:
        raise ExportError(f"GGUF export: {exc}") from exc


def write_gguf(plan: GGUFPlan, config: Any, tensors: list[GGUFTensor], output_dir: str | os.PathLike[str], *,
               overwrite: bool = False, sources: tuple[str | os.PathLike[str], ...] = ()) -> Path:
    """Write ``output_dir/model.gguf`` (atomically) from checked tensors; their data may be memory-mapped (then
    ``digest`` holds the SHA-256 of the proven bytes). The complete file is read back with ``gguf``'s reader and
    checked against the tensors (:func:`~quark_brevitas.export.readback.verify_gguf_file`) before it is moved into
    place."""
    gguf = plan.gguf
    factors = rope_freqs(config, plan.family_name)
    if factors is not None:  # Llama 3.x's rope scaling, as llama.cpp's converter writes it
        tensors = [*tensors, GGUFTensor(f"{gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.ROPE_FREQS]}.weight", factors, "F32")]
    with atomic_output_dir(output_dir, overwrite=overwrite, sources=sources) as work:
        writer = gguf.GGUFWriter(str(work / GGUF_FILE_NAME), plan.family.arch)
        if plan.family.metadata == "bert":
            add_bert_architecture(writer, gguf, config, plan.family_name, plan.tokenizer_dir)
            if plan.tokenizer_dir is not None:
                add_wordpiece_tokenizer(writer, gguf, plan.tokenizer_dir, config)
        else:
            _add_architecture(writer, config, plan.family_name, plan.family)
        if plan.tokenizer_dir is not None and plan.family.metadata != "bert":
            add_tokenizer(writer, gguf, plan.tokenizer_dir, plan.family.tokenizer_pre,
                           _config_value(config, "vocab_size", default=None))
        for tensor in tensors:
            raw = None if tensor.qtype in ("F32", "F16") else gguf.GGMLQuantizationType[tensor.qtype]
            writer.add_tensor(tensor.name, tensor.data, raw_dtype=raw)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        verify_gguf_file(gguf, work / GGUF_FILE_NAME, Path(output_dir) / GGUF_FILE_NAME, tensors)
    return Path(output_dir) / GGUF_FILE_NAME
