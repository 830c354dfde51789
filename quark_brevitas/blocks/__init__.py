"""Everything block by block: a model made of repeated blocks quantized (or evaluated) one block at a time.

- :mod:`~quark_brevitas.blocks.stack`: the one stack finder (which ModuleList holds the blocks) and the layers
  outside it;
- :mod:`~quark_brevitas.blocks.engine`: :class:`~quark_brevitas.blocks.engine.BlockwiseEngine`, the one walker
  over blocks (the pipeline's data phase and the LLM algorithms' whole-model path both run through it);
- :mod:`~quark_brevitas.blocks.run`: the pipeline's choices (which stack, whether the config can run block by
  block) and its block-by-block path;
- :mod:`~quark_brevitas.blocks.sources`: where blocks come from and go (in place, copied one at a time; a
  folder or a checkpoint in :mod:`quark_brevitas.hf.streaming`);
- :mod:`~quark_brevitas.blocks.capture`: capturing a module's inputs, replaying cached outputs;
- :mod:`~quark_brevitas.blocks.store`: cached activations, in memory or on disk;
- :mod:`~quark_brevitas.blocks.protocol`: what the engine needs from whoever quantizes the blocks.

This package module imports nothing, on purpose: :mod:`quark_brevitas.calibration.data` imports
:mod:`~quark_brevitas.blocks.store` and the engine imports :mod:`quark_brevitas.calibration.data`; import the
submodules.
"""
