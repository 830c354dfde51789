"""Small models covering the layer variants people quantize, for the zoo tests (tests/test_zoo.py).

Each model is tiny (a few thousand parameters) but has the structure of a real one: a ResNet block with
a residual add, grouped and depthwise convolutions and BatchNorm; a 1-D/transposed-convolution
encoder-decoder with a grouped ConvTranspose2d followed by BatchNorm; a causal transformer language model
(``nn.TransformerEncoder``, padding mask, output projection tied to the embedding); a decoder with
cross-attention (``nn.TransformerDecoder``). :data:`ZOO` maps a name to a builder and its calibration
batches; weights are trained for a few steps so that BatchNorm statistics and weights are not at their
initial values.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

__all__ = ["ZOO", "ZooModel"]


class ResNetBlock(nn.Module):
    """conv-bn-relu stem, a residual block (grouped 3x3 + depthwise 3x3 + 1x1), pooling and a classifier."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 16, 3, padding=1, bias=False)
        self.bn0 = nn.BatchNorm2d(16)
        self.conv1 = nn.Conv2d(16, 16, 3, padding=1, groups=4, bias=False)
        self.bn1 = nn.BatchNorm2d(16)
        self.dw = nn.Conv2d(16, 16, 3, padding=1, groups=16)
        self.pw = nn.Conv2d(16, 16, 1)
        self.bn2 = nn.BatchNorm2d(16)
        self.relu = nn.ReLU()
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(16, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.relu(self.bn0(self.stem(x)))
        y = self.relu(self.bn1(self.conv1(x)))
        y = self.bn2(self.pw(self.relu(self.dw(y))))
        x = self.relu(x + y)
        return self.fc(torch.flatten(self.pool(x), 1))


class ConvEncoderDecoder(nn.Module):
    """Conv1d over a signal, then a 2-D decoder: ConvTranspose2d (stride 2) with BatchNorm, a grouped
    ConvTranspose2d followed by BatchNorm, and a ConvTranspose1d head on the averaged rows."""

    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.Conv1d(4, 16, 3, padding=1)
        self.up1 = nn.ConvTranspose2d(4, 8, 2, stride=2)
        self.bn1 = nn.BatchNorm2d(8)
        self.up2 = nn.ConvTranspose2d(8, 8, 3, padding=1, groups=2)
        self.bn2 = nn.BatchNorm2d(8)
        self.head = nn.ConvTranspose1d(8, 2, 4, stride=2, padding=1)
        self.act = nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.act(self.enc(x))                        # (N, 16, 8)
        h = h.reshape(h.shape[0], 4, 4, 8)               # (N, 4, 4, 8)
        h = self.act(self.bn1(self.up1(h)))              # (N, 8, 8, 16)
        h = self.act(self.bn2(self.up2(h)))              # (N, 8, 8, 16)
        return self.head(h.mean(dim=2))                  # (N, 2, 32)


class TinyCausalLM(nn.Module):
    """Token embedding, a 2-layer causal ``nn.TransformerEncoder`` with padding mask, and an output
    projection tied to the embedding (as GPT-2/Llama configs do)."""

    def __init__(self, vocab: int = 64, d: int = 32) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        layer = nn.TransformerEncoderLayer(d, 4, 64, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, vocab, bias=False)
        self.lm_head.weight = self.embed.weight

    def forward(self, input_ids: torch.Tensor, padding_mask: torch.Tensor) -> torch.Tensor:
        length = input_ids.shape[1]
        positions = torch.arange(length, device=input_ids.device)
        causal = positions[None, :] > positions[:, None]  # (not triu: ONNX opset 13 has no Trilu)
        h = self.encoder(self.embed(input_ids), mask=causal, is_causal=True, src_key_padding_mask=padding_mask)
        return self.lm_head(self.norm(h))


class CrossAttentionDecoder(nn.Module):
    """``nn.TransformerDecoder`` (self-attention plus cross-attention to a memory) with input and output
    projections: called with two positional inputs ``(target, memory)``."""

    def __init__(self, d: int = 32) -> None:
        super().__init__()
        self.proj_in = nn.Linear(12, d)
        layer = nn.TransformerDecoderLayer(d, 4, 64, dropout=0.0, batch_first=True)
        self.decoder = nn.TransformerDecoder(layer, 1)
        self.proj_out = nn.Linear(d, 6)

    def forward(self, target: torch.Tensor, memory: torch.Tensor) -> torch.Tensor:
        return self.proj_out(self.decoder(self.proj_in(target), memory))


@dataclass(frozen=True)
class ZooModel:
    """A zoo entry: the float model (trained briefly, eval mode), calibration batches, and the keyword
    arguments of ``quantize_model`` it needs (``batch_to_inputs`` for several positional inputs)."""

    model: nn.Module
    batches: list[Any]
    example: tuple[torch.Tensor, ...]
    quantize_kwargs: dict[str, Any]


def _train(model: nn.Module, batches: list[Any], call: Callable[[nn.Module, Any], torch.Tensor], steps: int = 6
           ) -> nn.Module:
    """A few optimizer steps on an arbitrary target so that weights and BatchNorm statistics move."""
    model.train()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    for step in range(steps):
        batch = batches[step % len(batches)]
        loss = call(model, batch).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return model.eval()


def resnet() -> ZooModel:
    torch.manual_seed(1)  # initial weights
    g = torch.Generator().manual_seed(1)
    batches = [torch.randn(4, 3, 8, 8, generator=g) for _ in range(3)]
    model = _train(ResNetBlock(), batches, lambda m, b: m(b))
    return ZooModel(model, batches, (batches[0],), {})


def conv_encoder_decoder() -> ZooModel:
    torch.manual_seed(2)
    g = torch.Generator().manual_seed(2)
    batches = [torch.randn(4, 4, 8, generator=g) for _ in range(3)]
    model = _train(ConvEncoderDecoder(), batches, lambda m, b: m(b))
    return ZooModel(model, batches, (batches[0],), {})


def causal_lm() -> ZooModel:
    torch.manual_seed(3)
    g = torch.Generator().manual_seed(3)
    batches = []
    for _ in range(3):
        ids = torch.randint(0, 64, (4, 10), generator=g)
        padding = torch.zeros(4, 10, dtype=torch.bool)
        padding[0, 7:] = True  # one padded sequence
        batches.append({"input_ids": ids, "padding_mask": padding})
    model = _train(TinyCausalLM(), batches, lambda m, b: m(**b))
    return ZooModel(model, batches, (batches[0]["input_ids"], batches[0]["padding_mask"]), {})


def cross_attention() -> ZooModel:
    torch.manual_seed(4)
    g = torch.Generator().manual_seed(4)
    batches = [(torch.randn(4, 6, 12, generator=g), torch.randn(4, 9, 32, generator=g)) for _ in range(3)]
    model = _train(CrossAttentionDecoder(), batches, lambda m, b: m(*b))
    return ZooModel(model, batches, batches[0], {"batch_to_inputs": lambda batch: (tuple(batch), {})})


ZOO: dict[str, Callable[[], ZooModel]] = {
    "resnet": resnet,
    "conv_encoder_decoder": conv_encoder_decoder,
    "causal_lm": causal_lm,
    "cross_attention": cross_attention,
}
