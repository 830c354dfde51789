"""Hugging Face models: a model folder quantized and evaluated block by block (:mod:`.streaming`, a block source and
sink handed to the one orchestrator), the format table's block-by-block writers (:mod:`.export_streamed`),
language-model helpers (:mod:`.lm`), each export format's check of a plan before calibration (:mod:`.plan_checks`).
``kv_cache`` and ``moe`` forward to :mod:`quark_brevitas.model_parts` (deprecated paths). Import the submodules; this
package imports nothing so that ``transformers`` stays optional."""
