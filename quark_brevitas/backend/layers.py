"""Quantized layers the library adds on top of Brevitas's, where Brevitas's own do not fit PyTorch's callers.

:class:`QuantMultiheadAttention` is Brevitas's quantized attention made a drop-in for
``nn.MultiheadAttention`` inside ``nn.TransformerEncoder`` / ``nn.TransformerDecoder``: those containers
pass ``is_causal=`` and read ``in_proj_weight`` / ``in_proj_bias``, which Brevitas's class lacks, and
their fused fast paths would compute attention with the raw float weights, bypassing the quantizers.

:class:`QuantConv1D` quantizes Hugging Face's ``transformers.pytorch_utils.Conv1D`` (every projection of GPT-2),
a Linear layer that stores its weight transposed; Brevitas has no counterpart.
"""

from __future__ import annotations

from typing import Any

import brevitas.nn as qnn
import torch
from torch import Tensor

__all__ = ["QuantConv1D", "QuantMultiheadAttention"]


class _RuntimeQuantizedParameter(Tensor):
    """A projection weight or bias as PyTorch's fused transformer kernels see it.

    ``nn.TransformerEncoderLayer`` and ``nn.TransformerEncoder`` run a fused C++ kernel with the attention's
    raw ``in_proj_weight`` unless one of those tensors overrides ``__torch_function__``; a quantized layer
    must never take that path (its weights are quantized at run time), so the tensors it exposes do.
    """

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        return super().__torch_function__(func, types, args, kwargs or {})


class QuantMultiheadAttention(qnn.QuantMultiheadAttention):
    """Brevitas's ``QuantMultiheadAttention`` with ``nn.MultiheadAttention``'s full calling convention.

    - ``is_causal=True`` without ``attn_mask`` builds the causal mask (with a mask, it is only a hint,
      as in PyTorch);
    - ``in_proj_weight`` / ``in_proj_bias`` are read-only views of the q/k/v projections (for callers
      that inspect them); they keep PyTorch's fused transformer fast paths away (see
      :class:`_RuntimeQuantizedParameter`);
    - keys and values may have their own widths (``kdim``, ``vdim``);
    - ``key_padding_mask`` may be a float mask (added to the scores), as ``nn.TransformerEncoder`` passes it.
    """

    def forward(self, query: Tensor, key: Tensor, value: Tensor, key_padding_mask: Tensor | None = None,
                need_weights: bool = True, attn_mask: Tensor | None = None, average_attn_weights: bool = True,
                is_causal: bool = False) -> tuple[Tensor, Tensor | None]:
        seq_dim = 1 if self.batch_first and query.dim() == 3 else 0
        target, source = query.shape[seq_dim], key.shape[seq_dim]
        if is_causal and attn_mask is None:
            attn_mask = torch.ones(target, source, dtype=torch.bool, device=query.device).triu(1)
        if key_padding_mask is not None and key_padding_mask.is_floating_point():
            attn_mask = self._merge_float_padding(key_padding_mask, attn_mask, target, source, query.dtype)
            key_padding_mask = None
        return super().forward(query, key, value, key_padding_mask=key_padding_mask, need_weights=need_weights,
                               attn_mask=attn_mask, average_attn_weights=average_attn_weights)

    def _merge_float_padding(self, padding: Tensor, attn_mask: Tensor | None, target: int, source: int,
                             dtype: torch.dtype) -> Tensor:
        """A float ``key_padding_mask`` (added to the scores, as ``nn.TransformerEncoder`` passes it after
        canonicalising a boolean one) folded into a float ``(batch * heads, target, source)`` attention mask:
        Brevitas merges padding masks with ``masked_fill`` and so takes boolean ones only."""
        batch = padding.shape[0] if padding.dim() == 2 else 1
        merged = padding.to(dtype).reshape(batch, 1, 1, source).expand(batch, self.num_heads, target, source)
        merged = merged.reshape(batch * self.num_heads, target, source)
        if attn_mask is None:
            return merged
        if attn_mask.dtype == torch.bool:
            attn_mask = torch.zeros_like(attn_mask, dtype=dtype).masked_fill(attn_mask, float("-inf"))
        return merged + attn_mask.to(dtype)

    def multi_head_attention(self, *args: Any, **kwargs: Any) -> tuple[Tensor, Tensor | None]:
        # With separate q/k/v projections, keys and values may have their own widths (kdim, vdim) as in
        # nn.MultiheadAttention; Brevitas's forward says so only for packed projections.
        if self.in_proj is None:
            kwargs["use_separate_proj_weight"] = True
        return super().multi_head_attention(*args, **kwargs)

    def _projections(self) -> list[Any]:
        return [self.in_proj] if self.in_proj is not None else [self.q_proj, self.k_proj, self.v_proj]

    @property
    def in_proj_weight(self) -> Tensor | None:
        if not self._qkv_same_embed_dim:
            return None  # as in nn.MultiheadAttention with kdim/vdim: no packed weight
        weight = torch.cat([proj.weight.detach() for proj in self._projections()])
        return weight.as_subclass(_RuntimeQuantizedParameter)

    @property
    def in_proj_bias(self) -> Tensor | None:
        biases = [proj.bias for proj in self._projections()]
        if any(bias is None for bias in biases):
            return None
        return torch.cat([bias.detach() for bias in biases]).as_subclass(_RuntimeQuantizedParameter)


class QuantConv1D(qnn.QuantLinear):
    """Hugging Face's ``Conv1D`` (``y = x @ W + b`` with ``W`` of shape ``[nx, nf]``), quantized.

    Inside, the weight is held the way Linear layers hold it (``[nf, nx]``: output channels first), so that
    Brevitas's weight quantizers, the library's algorithms (GPTQ, AWQ, SmoothQuant) and the exporters treat it
    as the Linear layer it is. Its state dict keeps ``Conv1D``'s layout (``weight`` is ``[nx, nf]``), so a float
    GPT-2 state dict and the quantized model's match key for key and shape for shape; loading transposes back.
    ``nf`` and ``nx`` are kept, as ``Conv1D`` has them.
    """

    #: Parameters whose layout differs from the float ``Conv1D``'s: the backend must not adopt the float layer's
    #: ``Parameter`` for them (a square weight would fit and be used transposed).
    float_layout_differs = ("weight",)

    def __init__(self, nf: int, nx: int, bias: bool = True, weight_quant: Any = None, bias_quant: Any = None,
                 input_quant: Any = None, output_quant: Any = None, return_quant_tensor: bool = False,
                 device: Any = None, dtype: Any = None, **kwargs: Any) -> None:
        super().__init__(nx, nf, bias=bias, weight_quant=weight_quant, bias_quant=bias_quant, input_quant=input_quant,
                         output_quant=output_quant, return_quant_tensor=return_quant_tensor, device=device,
                         dtype=dtype, **kwargs)
        self.nf = nf
        self.nx = nx

    def _save_to_state_dict(self, destination: dict[str, Any], prefix: str, keep_vars: bool) -> None:
        super()._save_to_state_dict(destination, prefix, keep_vars)
        key = f"{prefix}weight"
        # keep_vars=True asks for the Parameter objects themselves (torch.jit's tracer maps them by identity;
        # a transposed copy would be traced as a constant), so only detached state dicts get Conv1D's layout.
        if key in destination and not keep_vars:
            destination[key] = destination[key].t()

    def _load_from_state_dict(self, state_dict: dict[str, Any], prefix: str, *args: Any, **kwargs: Any) -> None:
        key = f"{prefix}weight"
        if key in state_dict:
            state_dict = {**state_dict, key: state_dict[key].t().contiguous()}
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)
