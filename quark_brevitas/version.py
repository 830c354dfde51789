"""The library's version (a module of its own, so that modules such as checkpoints can read it without
importing the package's public namespace)."""

__version__ = "0.4.0"
