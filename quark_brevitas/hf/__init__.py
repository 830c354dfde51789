"""Hugging Face transformers support: what the library needs to know about their model structure."""
