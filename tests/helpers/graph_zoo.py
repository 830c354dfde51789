"""Networks people bring to a whole-network (FINN) flow, for the graph backend's tests
(tests/backend/test_graph_backend.py,
tests/backend/test_graph_finn.py) and benchmarks/graph.py: an MLP, a residual CNN with BatchNorm, a depthwise-separable
MobileNet-style net with ReLU6 and global average pooling, a concat/upsampling encoder-decoder and a 1-D conv net.
Each takes digit-sized inputs (``input_shape``), so the benchmark can train them on scikit-learn's digits."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from quark_brevitas.backend.graph import FINN_QAT_RECIPE, recipes
from quark_brevitas.config import Config

__all__ = ["GRAPH_ZOO", "QAT_RECIPE", "finn_config", "input_batch"]

#: QAT after ``finn_config`` on digits: the shipped recipe (quark_brevitas.backend.graph.FINN_QAT_RECIPE).
QAT_RECIPE = FINN_QAT_RECIPE


def finn_config(bits: int, model: nn.Module, output_bits: int | None = None) -> Config:
    """The ``finn_w{bits}a{bits}`` preset for ``model`` as the zoo's runs use it: at 2 bits with FINN's usual
    practice for 2-bit networks (first layer's input and weights and last layer's weights 8-bit,
    ``finn_config(..., ends_bits=8)``); ``output_bits``: a quantizer on the model's output."""
    return recipes.finn_config(bits, model, ends_bits=8 if bits == 2 else None, output_bits=output_bits)


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.bn1, self.relu1 = nn.Linear(64, 48), nn.BatchNorm1d(48), nn.ReLU()
        self.fc2, self.relu2 = nn.Linear(48, 32), nn.ReLU()
        self.fc3 = nn.Linear(32, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.flatten(x, 1)
        return self.fc3(self.relu2(self.fc2(self.relu1(self.bn1(self.fc1(x))))))


class ResidualCNN(nn.Module):
    """Stem, one residual block (conv-bn-relu, conv-bn, add, relu), max pooling, global average pooling, head."""

    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.conv0, self.bn0, self.relu0 = nn.Conv2d(1, width, 3, padding=1), nn.BatchNorm2d(width), nn.ReLU()
        self.conv1, self.bn1, self.relu1 = nn.Conv2d(width, width, 3, padding=1), nn.BatchNorm2d(width), nn.ReLU()
        self.conv2, self.bn2 = nn.Conv2d(width, width, 3, padding=1), nn.BatchNorm2d(width)
        self.relu2, self.pool = nn.ReLU(), nn.MaxPool2d(2)
        self.gap, self.fc = nn.AdaptiveAvgPool2d(1), nn.Linear(width, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.relu0(self.bn0(self.conv0(x)))
        y = self.relu1(self.bn1(self.conv1(x)))
        x = self.relu2(x + self.bn2(self.conv2(y)))
        return self.fc(torch.flatten(self.gap(self.pool(x)), 1))


class MobileNetStyle(nn.Module):
    """Conv-bn-ReLU6, a depthwise-separable block (depthwise 3x3 + pointwise 1x1, each bn-ReLU6), global avg pool."""

    def __init__(self) -> None:
        super().__init__()
        self.stem, self.bn0, self.act0 = nn.Conv2d(1, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU6()
        self.dw, self.bn1, self.act1 = nn.Conv2d(16, 16, 3, padding=1, groups=16), nn.BatchNorm2d(16), nn.ReLU6()
        self.pw, self.bn2, self.act2 = nn.Conv2d(16, 32, 1), nn.BatchNorm2d(32), nn.ReLU6()
        self.gap, self.fc = nn.AdaptiveAvgPool2d(1), nn.Linear(32, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.act0(self.bn0(self.stem(x)))
        x = self.act2(self.bn2(self.pw(self.act1(self.bn1(self.dw(x))))))
        return self.fc(torch.flatten(self.gap(x), 1))


class EncoderDecoder(nn.Module):
    """A small U-Net: encoder, max-pool, bottleneck, nearest upsampling, concat with the skip, decoder, head."""

    def __init__(self) -> None:
        super().__init__()
        self.enc, self.relu_e = nn.Conv2d(1, 8, 3, padding=1), nn.ReLU()
        self.down = nn.MaxPool2d(2)
        self.mid, self.relu_m = nn.Conv2d(8, 16, 3, padding=1), nn.ReLU()
        self.up = nn.Upsample(scale_factor=2, mode="nearest")
        self.dec, self.relu_d = nn.Conv2d(24, 8, 3, padding=1), nn.ReLU()
        self.head = nn.Conv2d(8, 2, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        e = self.relu_e(self.enc(x))
        m = self.up(self.relu_m(self.mid(self.down(e))))
        return self.head(self.relu_d(self.dec(torch.cat([m, e], dim=1))))


class Conv1dNet(nn.Module):
    """A 1-D conv net over the image rows as a sequence (8 channels, length 8)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1, self.bn1, self.relu1 = nn.Conv1d(8, 16, 3, padding=1), nn.BatchNorm1d(16), nn.ReLU()
        self.conv2, self.bn2, self.relu2 = nn.Conv1d(16, 16, 3, padding=1), nn.BatchNorm1d(16), nn.ReLU()
        self.gap, self.fc = nn.AdaptiveAvgPool1d(1), nn.Linear(16, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.reshape(x.shape[0], 8, 8)
        x = self.relu2(self.bn2(self.conv2(self.relu1(self.bn1(self.conv1(x))))))
        return self.fc(torch.flatten(self.gap(x), 1))


#: name -> builder; every model takes ``[B, 1, 8, 8]`` digit images.
GRAPH_ZOO: dict[str, Callable[[], nn.Module]] = {
    "mlp": MLP, "residual_cnn": ResidualCNN, "mobilenet": MobileNetStyle, "encoder_decoder": EncoderDecoder,
    "conv1d": Conv1dNet,
}


def input_batch(n: int = 32, seed: int = 0) -> torch.Tensor:
    """Digit-like inputs: non-negative pixel values in [0, 16], as scikit-learn's digits."""
    return torch.rand(n, 1, 8, 8, generator=torch.Generator().manual_seed(seed)) * 16


def randomised(model: nn.Module, seed: int = 0) -> nn.Module:
    """``model`` with non-trivial BatchNorm statistics and affine parameters (not the identity at init), in eval."""
    gen = torch.Generator().manual_seed(seed)
    for module in model.modules():
        if isinstance(module, nn.modules.batchnorm._BatchNorm):
            with torch.no_grad():
                n = module.num_features
                module.running_mean.copy_(torch.randn(n, generator=gen) * 0.5)
                module.running_var.copy_(torch.rand(n, generator=gen) * 2 + 0.5)
                module.weight.copy_(torch.rand(n, generator=gen) + 0.5)
                module.bias.copy_(torch.randn(n, generator=gen) * 0.2)
    return model.eval()
