"""What each node of an FX graph does to quantization, for the graph backend.

A whole-network integer file (FINN, onnxruntime's integer kernels) needs every tensor that reaches a compute
layer to be an integer times a scale. Each node of the traced graph falls in one of these kinds:

- ``compute``: a layer of the layer map (Conv, Linear, ...): its weights are quantized, its input must be.
- ``act_unsigned``: the ReLU family (ReLU, ReLU6): replaced by an unsigned non-narrow quantizer behind a ReLU,
  the only unsigned form FINN's ``ConvertQONNXtoFINN`` accepts.
- ``act_signed``: other activations (Sigmoid, Tanh, GELU, ...): a signed quantizer on their output.
- ``merge``: residual adds, subtractions and concatenations: one quantizer shared by every tensor input, so that
  all inputs have one scale and the result is an integer at that scale.
- ``requant``: ops whose output is no longer on the input's grid (average pooling, mean, products, interpolating
  upsampling): a quantizer on their output.
- ``passthrough``: ops that keep values on their input's grid (max pooling, reshapes, nearest upsampling,
  dropout, ...): no quantizer, the value keeps its producer's sign and scale.
- ``float``: anything else (BatchNorm, constants, unknown ops): the output is float.

Classification is by module class, function or method name; a user's own module that owns parameters and is
not in the layer map is ``float`` (FINN absorbs affine ops into the next quantizer's thresholds).
"""

from __future__ import annotations

import operator
from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F  # noqa: N812 - torch's own spelling
from torch import fx, nn

COMPUTE, ACT_UNSIGNED, ACT_SIGNED, MERGE, REQUANT, PASSTHROUGH, FLOAT = (
    "compute", "act_unsigned", "act_signed", "merge", "requant", "passthrough", "float")

_UNSIGNED_MODULES: tuple[type[nn.Module], ...] = (nn.ReLU, nn.ReLU6)
_SIGNED_MODULES: tuple[type[nn.Module], ...] = (
    nn.Sigmoid, nn.Tanh, nn.GELU, nn.SiLU, nn.Hardswish, nn.Hardsigmoid, nn.LeakyReLU, nn.ELU, nn.Hardtanh,
    nn.Mish, nn.Softplus, nn.PReLU, nn.SELU, nn.Softmax, nn.LogSoftmax)
_REQUANT_MODULES: tuple[type[nn.Module], ...] = (
    nn.AvgPool1d, nn.AvgPool2d, nn.AvgPool3d, nn.AdaptiveAvgPool1d, nn.AdaptiveAvgPool2d, nn.AdaptiveAvgPool3d)
_PASS_MODULES: tuple[type[nn.Module], ...] = (
    nn.MaxPool1d, nn.MaxPool2d, nn.MaxPool3d, nn.AdaptiveMaxPool1d, nn.AdaptiveMaxPool2d, nn.Flatten,
    nn.Unflatten, nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Identity, nn.ZeroPad2d, nn.ConstantPad2d,
    nn.PixelShuffle, nn.PixelUnshuffle, nn.ChannelShuffle)

_UNSIGNED_FUNCTIONS = {F.relu, torch.relu, F.relu6}
_SIGNED_FUNCTIONS = {torch.sigmoid, torch.tanh, F.gelu, F.silu, F.hardswish, F.leaky_relu, F.elu, F.hardtanh,
                     F.softmax, torch.softmax, F.sigmoid, F.tanh}
_MERGE_FUNCTIONS = {operator.add, operator.sub, torch.add, torch.sub, torch.cat, torch.concat, operator.iadd}
_REQUANT_FUNCTIONS = {F.avg_pool1d, F.avg_pool2d, F.adaptive_avg_pool1d, F.adaptive_avg_pool2d, torch.mean,
                      operator.mul, torch.mul, operator.truediv, torch.div, torch.sum, torch.matmul, operator.matmul}
_PASS_FUNCTIONS = {F.max_pool1d, F.max_pool2d, F.adaptive_max_pool2d, torch.flatten, torch.reshape,
                   torch.permute, torch.transpose, torch.squeeze, torch.unsqueeze, operator.getitem, F.dropout,
                   F.pad, torch.chunk, torch.split, F.pixel_shuffle}
_UNSIGNED_METHODS = {"relu", "relu_"}
_SIGNED_METHODS = {"sigmoid", "tanh", "softmax"}
_MERGE_METHODS = {"add", "add_", "sub", "sub_"}
_REQUANT_METHODS = {"mean", "mul", "mul_", "div", "sum", "matmul"}
_PASS_METHODS = {"view", "reshape", "flatten", "permute", "transpose", "contiguous", "squeeze", "unsqueeze",
                 "chunk", "split", "expand", "repeat", "max_pool2d", "size"}


def _interpolation_kind(node: fx.Node, module: nn.Module | None) -> str:
    """Nearest upsampling repeats values (``passthrough``); any other mode averages them (``requant``)."""
    mode = module.mode if module is not None else node.kwargs.get("mode", node.args[3] if len(node.args) > 3
                                                                  else "nearest")
    return PASSTHROUGH if mode == "nearest" else REQUANT


def tensor_args(node: fx.Node) -> list[fx.Node]:
    """The graph nodes among a node's direct arguments (the list of a ``torch.cat`` included)."""
    found: list[fx.Node] = []
    for arg in (*node.args, *node.kwargs.values()):
        items = arg if isinstance(arg, (list, tuple)) else (arg,)
        found.extend(item for item in items if is_node(item))
    return found


def is_node(value: Any) -> bool:
    """Whether ``value`` is a graph node (torch's ``fx.Node`` or Brevitas's backported one, which the
    ``Preprocess`` step's trace produces and which is not a subclass of torch's)."""
    return isinstance(value, fx.Node) or (hasattr(value, "users") and hasattr(value, "op")
                                          and hasattr(value, "target"))


def classify(node: fx.Node, modules: Mapping[str, nn.Module], compute_types: Any) -> str:
    """The kind of ``node`` (module docstring); ``compute_types``: the layer map's classes."""
    if node.op == "call_module":
        module = modules[node.target]
        if type(module) in compute_types:
            return COMPUTE
        if isinstance(module, _UNSIGNED_MODULES):
            return ACT_UNSIGNED
        if isinstance(module, _SIGNED_MODULES):
            return ACT_SIGNED
        if isinstance(module, _REQUANT_MODULES):
            return REQUANT
        if isinstance(module, nn.Upsample):
            return _interpolation_kind(node, module)
        if isinstance(module, _PASS_MODULES):
            return PASSTHROUGH
        return FLOAT
    if node.op == "call_function":
        target = node.target
        if target in _UNSIGNED_FUNCTIONS:
            return ACT_UNSIGNED
        if target in _SIGNED_FUNCTIONS:
            return ACT_SIGNED
        if target in _MERGE_FUNCTIONS:
            return MERGE if len(tensor_args(node)) > 1 else REQUANT
        if target in _REQUANT_FUNCTIONS:
            return REQUANT
        if target is F.interpolate:
            return _interpolation_kind(node, None)
        if target in _PASS_FUNCTIONS:
            return PASSTHROUGH
        return FLOAT
    if node.op == "call_method":
        if node.target in _UNSIGNED_METHODS:
            return ACT_UNSIGNED
        if node.target in _SIGNED_METHODS:
            return ACT_SIGNED
        if node.target in _MERGE_METHODS:
            return MERGE if len(tensor_args(node)) > 1 else REQUANT
        if node.target in _REQUANT_METHODS:
            return REQUANT
        if node.target in _PASS_METHODS:
            return PASSTHROUGH
        return FLOAT
    return FLOAT


__all__ = ["ACT_SIGNED", "ACT_UNSIGNED", "COMPUTE", "FLOAT", "MERGE", "PASSTHROUGH", "REQUANT", "classify",
           "is_node", "tensor_args"]
