"""Models shared by the benchmarks."""

from __future__ import annotations

import torch
from torch import nn


class EncoderLayer(nn.Module):
    """Post-norm transformer encoder layer (ReLU feed-forward), as ``nn.TransformerEncoderLayer`` computes in
    eval mode, written with the layers quark_brevitas quantizes (MultiheadAttention, Linear)."""

    def __init__(self, d_model: int = 128, nhead: int = 4, dim_feedforward: int = 256) -> None:
        super().__init__()
        self.self_attn = nn.MultiheadAttention(d_model, nhead, batch_first=True)
        self.linear1 = nn.Linear(d_model, dim_feedforward)
        self.relu = nn.ReLU()
        self.linear2 = nn.Linear(dim_feedforward, d_model)
        self.norm1 = nn.LayerNorm(d_model)
        self.norm2 = nn.LayerNorm(d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.norm1(x + self.self_attn(x, x, x, need_weights=False)[0])
        return self.norm2(x + self.linear2(self.relu(self.linear1(x))))
