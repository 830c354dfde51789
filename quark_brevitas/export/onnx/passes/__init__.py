"""ONNX graph passes applied to Brevitas' QCDQ export, one concept per module.

- :mod:`~quark_brevitas.export.onnx.passes.graph`: graph index, attributes, cleaning, topological sort, opset;
- :mod:`~quark_brevitas.export.onnx.passes.folding`: constant folding of weight ``QuantizeLinear``/``Clip``
  into integer (or float8) initializers;
- :mod:`~quark_brevitas.export.onnx.passes.kernels`: the registry of exact rewrites that give onnxruntime
  complete QDQ groups for its integer kernels, and the loop applying them; the rewrites themselves live in
  :mod:`~quark_brevitas.export.onnx.passes.layout`, :mod:`~quark_brevitas.export.onnx.passes.clips`,
  :mod:`~quark_brevitas.export.onnx.passes.bias` and :mod:`~quark_brevitas.export.onnx.passes.unsigned`, on the nodes
  :mod:`~quark_brevitas.export.onnx.passes.qparams` recognises;
- :mod:`~quark_brevitas.export.onnx.passes.float8`: Relu in front of float8 quantizers as ``Max(x, 0)``, which
  onnxruntime's default session does not drop;
- :mod:`~quark_brevitas.export.onnx.passes.float_bias`: moving float biases out of quantized layers when
  onnxruntime's int32 bias rounding breaks the tolerance.
"""
