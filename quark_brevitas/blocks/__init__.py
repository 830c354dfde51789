"""The block engine: a model made of repeated blocks quantized (or evaluated) one block at a time.

This package is the engine only: it imports no algorithm, checkpoint or pipeline module (what a config asks of
a block-by-block run is decided one room up, in :mod:`quark_brevitas.orchestration.block_runs`; the quantized
blocks of a streamed checkpoint are read by :mod:`quark_brevitas.checkpoint.streamed_blocks`).

- :mod:`~quark_brevitas.blocks.stack`: the one stack finder (which ModuleList holds the blocks) and the layers
  outside it;
- :mod:`~quark_brevitas.blocks.engine`: :class:`~quark_brevitas.blocks.engine.BlockwiseEngine`, the one walker
  over blocks (the pipeline's data phase and the LLM algorithms' whole-model path both run through it);
- :mod:`~quark_brevitas.blocks.sources`: where blocks come from and go (in place, copied one at a time);
- :mod:`~quark_brevitas.blocks.disk`: blocks read from a safetensors folder just before they run;
- :mod:`~quark_brevitas.blocks.capture`: capturing a module's inputs, replaying cached outputs;
- :mod:`~quark_brevitas.blocks.store`: cached activations, in memory or on disk;
- :mod:`~quark_brevitas.blocks.protocol`: what the engine needs from whoever quantizes the blocks.

This package module imports nothing, on purpose (importing a submodule runs it first, and the submodules are
imported one by one from the rooms above); import the submodules.
"""
