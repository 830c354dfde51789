"""Orchestration: what a config asks of the block engine, one room above it.

:mod:`quark_brevitas.blocks` is the engine (capture, replay, activation stores, block sources, the one stack
finder) and imports no algorithm, checkpoint or pipeline module; the rooms above it decide how a run uses it.
:mod:`~quark_brevitas.orchestration.block_runs` holds the pipeline's block-by-block path: which stack a run walks,
whether its config can run block by block, the walk with the right block source and activation stores, and the
data-free steps of a run whose blocks load one at a time.

This package module imports nothing, on purpose; import the submodules.
"""
