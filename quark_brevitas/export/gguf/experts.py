"""Mixture-of-experts decoders (Mixtral, Qwen2-MoE, Qwen3-MoE) in GGUF: llama.cpp's stacked expert tensors and
the metadata its MoE graphs read.

llama.cpp keeps a block's experts as three 3-D tensors, ``blk.N.ffn_gate_exps`` / ``ffn_up_exps`` ``[experts,
expert width, hidden]`` and ``ffn_down_exps`` ``[experts, hidden, expert width]`` (numpy's order; GGUF lists the
dimensions reversed), next to the router ``blk.N.ffn_gate_inp`` ``[experts, hidden]``; Qwen2-MoE adds its shared
expert (``ffn_gate_shexp`` / ``ffn_up_shexp`` / ``ffn_down_shexp``, ordinary 2-D tensors) and the shared expert's
gate ``ffn_gate_inp_shexp``, a vector of ``hidden`` values (llama.cpp's converter squeezes the ``[1, hidden]``
Linear weight; transformers' GGUF loader adds the 1 back). Mixtral is llama.cpp's ``llama`` architecture with
``expert_count`` / ``expert_used_count``; ``qwen2moe`` and ``qwen3moe`` add ``expert_feed_forward_length`` (and
``qwen2moe`` ``expert_shared_feed_forward_length``).

Our quantized experts are :func:`~quark_brevitas.model_parts.moe.unfuse_experts`'s per-expert Linear layers, each with
scales of its own: each is packed on its own (the writer's block packers, never re-quantized) and the experts of one
projection are stacked along a new first axis, so the stacked tensor's blocks are the experts' blocks, in order.
One GGUF tensor has one type: experts of one projection quantized differently are refused by name. Fused experts
(transformers' ``gate_up_proj`` / ``down_proj`` 3-D parameters, not unfused before quantization) are float: they
are written as F32 stacks, with a warning that they were not quantized.

llama.cpp's graphs fix the routing arithmetic per architecture: ``llama`` (Mixtral) and ``qwen3moe`` renormalise the
top-k weights, ``qwen2moe`` does not, and both Qwen graphs have a MoE MLP in every block. A config that asks for
something else (``norm_topk_prob``, ``decoder_sparse_step``, ``mlp_only_layers``) is refused before calibration
(:func:`check_moe_config`): llama.cpp would compute another function.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from torch import nn

from quark_brevitas.export.errors import ExportError

__all__ = ["MOE_FAMILIES", "ExpertStacks", "add_moe_metadata", "check_moe_config", "fused_expert_tensors",
           "refuse_quantized_router", "squeeze_shared_gate"]

logger = logging.getLogger(__name__)

#: Hugging Face model types of the MoE families (their GGUFFamily rows are in the writer's table).
MOE_FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe")
#: Whether llama.cpp's graph of the family renormalises the top-k routing weights (``norm_w`` of its MoE FFN).
_RENORMALISES = {"mixtral": True, "qwen2_moe": False, "qwen3_moe": True}

#: An unfused expert's projection weight: ``<stack>.<index>.<proj>.weight``.
_EXPERT_WEIGHT = re.compile(r"^(?P<stack>.+\.experts)\.(?P<index>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight$")
#: A fused experts module's parameter (transformers 5.x).
_FUSED = re.compile(r"^(?P<stack>.+\.experts)\.(?P<param>gate_up_proj|down_proj)$")


def check_moe_config(config: Any, family_name: str) -> None:
    """Refuse a MoE config whose routing llama.cpp's graph of the family does not compute (see the module
    docstring); nothing for other families."""
    if family_name not in MOE_FAMILIES:
        return
    if family_name != "mixtral":
        renormalise = bool(getattr(config, "norm_topk_prob", False))
        if renormalise != _RENORMALISES[family_name]:
            raise ExportError(f"{family_name} with norm_topk_prob={renormalise}: llama.cpp's "
                              f"{'qwen2moe' if family_name == 'qwen2_moe' else 'qwen3moe'} graph "
                              f"{'renormalises' if _RENORMALISES[family_name] else 'does not renormalise'} the "
                              "top-k routing weights, so the GGUF would compute another model")
        step, dense = int(getattr(config, "decoder_sparse_step", 1) or 1), list(getattr(config, "mlp_only_layers",
                                                                                          None) or [])
        if step != 1 or dense:
            raise ExportError(f"{family_name} with dense MLP blocks (decoder_sparse_step={step}, mlp_only_layers="
                              f"{dense}): llama.cpp's graph has a mixture-of-experts MLP in every block")
    if getattr(config, "num_experts_per_tok", None) is None:
        raise ExportError(f"{family_name} config has no num_experts_per_tok (llama.cpp's expert_used_count)")


def add_moe_metadata(writer: Any, config: Any, family_name: str) -> None:
    """The experts' hyperparameters as llama.cpp's converter writes them; nothing for dense families."""
    if family_name not in MOE_FAMILIES:
        return
    experts = getattr(config, "num_local_experts", None) or getattr(config, "num_experts", None)
    writer.add_expert_count(int(experts))
    writer.add_expert_used_count(int(config.num_experts_per_tok))
    if family_name in ("qwen2_moe", "qwen3_moe"):
        writer.add_expert_feed_forward_length(int(config.moe_intermediate_size))
    if family_name == "qwen2_moe":
        writer.add_expert_shared_feed_forward_length(int(config.shared_expert_intermediate_size))


def refuse_quantized_router(name: str, layer: str) -> None:
    """A quantized router (Qwen2-MoE's ``shared_expert_gate`` is a Linear layer the gguf_* presets quantize) has no
    place in a llama.cpp file: its converter keeps ``ffn_gate_inp*`` in F32 (the shared gate a vector), and
    transformers' loader reshapes the shared gate as such."""
    if ".ffn_gate_inp" in name:
        raise ExportError(f"layer '{layer}' is quantized, but llama.cpp's router tensor '{name}' is float (F32): "
                          f"keep the router in float (exclude '{layer}', or '*shared_expert_gate' as the qwen2_moe "
                          "template does)")


def squeeze_shared_gate(name: str, data: np.ndarray) -> np.ndarray:
    """Qwen2-MoE's float shared-expert gate ``[1, hidden]`` as the vector llama.cpp's files hold."""
    return data.reshape(-1) if name.startswith("blk.") and ".ffn_gate_inp_shexp." in name and data.ndim == 2 \
        and data.shape[0] == 1 else data


@dataclass
class _Stack:
    """The packed experts of one projection, collected until every expert of the module is in."""

    count: int
    pieces: dict[int, tuple[str, str, np.ndarray, np.ndarray | None]] = field(default_factory=dict)


@dataclass
class ExpertStacks:
    """Per-expert tensors of the model being collected, stacked into llama.cpp's 3-D tensors as soon as every
    expert of a projection is in (so a block's stacks come out with the block's other tensors)."""

    model: nn.Module
    prefix: str = ""
    stacks: dict[str, _Stack] = field(default_factory=dict)

    @staticmethod
    def stacked_name(local_name: str) -> tuple[str, int] | None:
        """``(name of the stacked weight, expert index)`` of an unfused expert's weight; ``None`` for any other
        parameter."""
        match = _EXPERT_WEIGHT.match(local_name)
        if match is None:
            return None
        return f"{match['stack']}.{match['proj']}.weight", int(match["index"])

    def add(self, local_name: str, qtype: str, data: np.ndarray, expected: np.ndarray | None
            ) -> tuple[str, str, np.ndarray, np.ndarray | None] | None:
        """Add one expert's packed weight; returns ``(stacked local name, type, data, expected)`` when it completes
        its projection's stack."""
        stacked, index = self.stacked_name(local_name)  # type: ignore[misc]
        module = local_name.rsplit(".", 3)[0]
        stack = self.stacks.setdefault(stacked, _Stack(len(self.model.get_submodule(module))))
        stack.pieces[index] = (self.prefix + local_name.rpartition(".")[0], qtype, data, expected)
        if len(stack.pieces) < stack.count:
            return None
        del self.stacks[stacked]
        pieces = [stack.pieces[i] for i in range(stack.count)]
        types = {qtype for _, qtype, _, _ in pieces}
        if len(types) > 1:
            described = ", ".join(f"{layer}: {qtype}" for layer, qtype, _, _ in pieces)
            raise ExportError(f"the experts of '{self.prefix}{stacked[:-len('.weight')]}' are quantized to different "
                              f"GGUF types ({described}); llama.cpp stacks them into one tensor of one type: "
                              "quantize every expert of a projection with the same spec")
        expected_all = None if pieces[0][3] is None else np.stack([p[3] for p in pieces])  # type: ignore[misc]
        return stacked, types.pop(), np.stack([p[2] for p in pieces]), expected_all

    def check_complete(self) -> None:
        """Every stack started was completed (an expert with no weight in the model would leave a hole)."""
        for stacked, stack in self.stacks.items():
            raise ExportError(f"'{self.prefix}{stacked}': {len(stack.pieces)} of {stack.count} experts have a "
                              "weight to write; llama.cpp's stacked expert tensor needs every one")


def fused_expert_tensors(local_name: str, param: nn.Parameter, prefix: str) -> list[tuple[str, np.ndarray]] | None:
    """A fused (float) experts parameter as the stacked weights it holds (``gate_up_proj`` split into gate and up
    halves), named like unfused stacks; ``None`` for any other parameter."""
    match = _FUSED.match(local_name)
    if match is None or param.dim() != 3:
        return None
    logger.warning("export_gguf: '%s%s' is a fused experts parameter, written in float (not quantized): call "
                   "quark_brevitas.model_parts.moe.unfuse_experts before quantizing to quantize every expert",
                   prefix, local_name)
    data = param.detach().float().cpu().numpy()
    if match["param"] == "down_proj":
        return [(f"{match['stack']}.down_proj.weight", data)]
    half = data.shape[1] // 2
    return [(f"{match['stack']}.gate_proj.weight", np.ascontiguousarray(data[:, :half])),
            (f"{match['stack']}.up_proj.weight", np.ascontiguousarray(data[:, half:]))]
