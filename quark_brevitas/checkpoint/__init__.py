"""Checkpoints of quantized models: safetensors and JSON (no pickle), rebuilt without calibration data.

A quantized model is a float architecture plus what the pipeline did to it: structural changes
(FX tracing, BatchNorm merging, channel splitting, activation-equalization scale modules, layer
replacement) and values (weights, biases, scales, zero points, BatchNorm statistics). A checkpoint
therefore stores the *recipe* and the *values* but no code:

- ``model.safetensors``: the quantized model's ``state_dict`` -- weights, biases and every
  initialised quantizer parameter (scales, zero points). Brevitas leaves uninitialised quantizer
  values out of its state dict; so do we. A checkpoint written one block at a time
  (:mod:`quark_brevitas.hf.streaming`) has several files instead, listed by
  ``model.safetensors.index.json`` (Hugging Face's sharded layout); loading reads either.
- ``config.json``: the :class:`~quark_brevitas.config.Config` (algorithms included).
- ``manifest.json``: format version, library/Brevitas/torch versions, the model's dtype (its weights';
  a float16/bfloat16 model's quantizer scales are float32), the module names and
  types of the quantized model (Brevitas quantizer internals excluded), the FX code of traced graphs,
  every tensor's shape and dtype, the train/eval mode, frozen parameters and the example input's shapes.
- ``example_input.safetensors`` (optional): the example input given to :func:`save_quantized`, used
  for export from the command line.

:func:`load_quantized` rebuilds the structure on a *copy* of the float model with the pipeline's
structure phase (:meth:`quark_brevitas.pipeline.Pipeline.rebuild`): ``Preprocess`` (data-free) runs as
in quantization, the backend replaces the layers, and each data-driven algorithm that leaves structure
behind (activation equalization's scale modules, the bias bias correction gives a bias-free layer)
recreates it from the checkpoint's record of modules and tensor shapes, through its own handler. No
calibration data or example input is needed. Loading marks every quantizer whose value is loaded as
initialised, so nothing is re-derived from statistics: the outputs are bit-identical.

Before loading, the rebuilt model is compared with the manifest -- modules, FX code, tensor names,
shapes and dtypes -- and the first difference is reported as a :class:`CheckpointError`, so a model
of another architecture, a different config or a custom layer whose mapping was not registered
(pass the same ``container`` as for quantization) never loads into a wrong model. One limit:
channel splitting over a region with several layers chooses how many channels to split from the
float weights, so such a model must be rebuilt from the same float weights it was quantized from
(a mismatch is reported, never loaded).
"""

from quark_brevitas.checkpoint.files import checksums, read_checkpoint, read_safetensors, read_weights
from quark_brevitas.checkpoint.load import load_quantized
from quark_brevitas.checkpoint.manifest import (
    CHECKSUMS_KEY,
    CONFIG_FILE,
    EXAMPLE_FILE,
    FORMAT,
    FORMAT_VERSION,
    MANIFEST_FILE,
    WEIGHTS_FILE,
    WEIGHTS_INDEX_FILE,
    CheckpointError,
    CheckpointInfo,
    ExampleInput,
    huggingface_architecture,
)
from quark_brevitas.checkpoint.save import save_quantized
from quark_brevitas.pipeline import CONFIG_ATTRIBUTE

__all__ = [
    "CHECKSUMS_KEY",
    "CONFIG_ATTRIBUTE",
    "CONFIG_FILE",
    "EXAMPLE_FILE",
    "FORMAT",
    "FORMAT_VERSION",
    "MANIFEST_FILE",
    "WEIGHTS_FILE",
    "WEIGHTS_INDEX_FILE",
    "CheckpointError",
    "CheckpointInfo",
    "ExampleInput",
    "checksums",
    "huggingface_architecture",
    "load_quantized",
    "read_checkpoint",
    "read_safetensors",
    "read_weights",
    "save_quantized",
]
