"""Hugging Face models: what the library needs to know about their structure (:mod:`.structure`), streaming a
model folder block by block (:mod:`.streaming`), language-model helpers (:mod:`.lm`). Import the submodules;
this package imports nothing so that ``transformers`` stays optional."""
