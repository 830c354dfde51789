"""Hugging Face folders other libraries load: compressed-tensors (transformers, vLLM) and AMD Quark's own
format, with what every such folder shares (config.json, tokenizer files, KV-cache scales).

Same concept as :mod:`quark_brevitas.hf` one layer up: that room *reads and runs* Hugging Face models;
this package *writes* their checkpoints. The public entry point is
:func:`quark_brevitas.export.export_safetensors`."""
