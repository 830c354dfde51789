"""Hugging Face models: a model folder quantized and evaluated block by block (:mod:`.streaming`, a block source and
sink handed to the one orchestrator), the format table's block-by-block writers (:mod:`.export_streamed`),
language-model helpers (:mod:`.lm`), KV-cache and mixture-of-experts support. Import the submodules; this package
imports nothing so that ``transformers`` stays optional."""
