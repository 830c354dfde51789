"""ONNX files: the verified QCDQ export for onnxruntime, QONNX for FINN and qonnx, and what both share
(inspection, verification against PyTorch, the graph passes that give onnxruntime integer kernels).

The public entry points are re-exported by :mod:`quark_brevitas.export`."""
