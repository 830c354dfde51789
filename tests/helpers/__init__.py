"""Shared test helpers: small models, reference numerics, fresh-process consumers."""
