"""What an algorithm does, as opposed to what it is: handlers, found through a registry.

An algorithm's *config* (``quark_brevitas.algos``: ``GPTQ(act_order=True)``) is plain data. Its
*handler* says what running it does to a model, given the pipeline's calibration data, and, if the
algorithm leaves structure behind (wrapped layers, a bias added to a bias-free layer), how to
recreate that structure without data when a checkpoint is loaded. Adding an algorithm means a
config dataclass plus one handler registered here with :func:`register`; the pipeline looks it up
with :func:`handler_for` and never special-cases an algorithm.

The contract between the pipeline and a handler:

- ``apply(algo, model, data)`` runs the algorithm on the whole model; ``data`` is the pipeline's
  :class:`CalibrationData` (``None`` when the config says ``needs_data = False``). Handlers never iterate a loader:
  they call ``data.forward(module, desc)`` (with forward hooks for their statistics) and combine every statistic
  with ``data.all_reduce(tensor, op)`` before using it, so sharded calibration gives every process the same result.
- Block-wise handlers (:class:`quark_brevitas.algorithms.blocks.BlockwiseHandler`: SmoothQuantConfig, AWQConfig,
  GPTQConfig) also offer ``blocks(algo, model)``, the qualified names of the decoder layers they run on, in order
  (``[""]``: the model is one block), and ``apply_block(algo, block, data, name)``, which runs the algorithm on one
  block whose inputs are the batches of ``data`` (each batch the ``(args, kwargs)`` of one call of the block, e.g.
  :class:`~quark_brevitas.algorithms.blocks.BlockInputs`) and may be called in any process holding that block.
  Names in the algorithm's config (scaling layers, ``inside_layer_modules``) are relative to the block; ``name`` is
  only used in messages. ``inputs_context(model)`` says under which quantization state the earlier blocks compute
  a block's inputs (GPTQ: quantized weights, float activations; AWQ: all float). Their ``apply`` does the block
  walk itself (capture the first block's inputs, feed each processed block's outputs to the next): a block engine
  calls ``apply_block`` directly, for each block in order, and feeds the processed block's outputs to the next.
- ``describe(algo, model)`` returns the lines ``plan`` shows for the algorithm on ``model`` (what was inferred) and
  raises :class:`ConfigError` if the algorithm cannot run on that model, before anything is changed.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from quark_brevitas.blocks.protocol import BlockStep
from quark_brevitas.calibration.data import CalibrationData
from quark_brevitas.errors import CalibrationDataError, ConfigError

__all__ = ["AlgorithmHandler", "BlockStep", "SavedStructure", "apply_algorithm", "describe_algorithms", "handler_for",
           "register", "registered_handlers"]


@dataclass(frozen=True)
class SavedStructure:
    """What a checkpoint says about the quantized model's structure (no values).

    ``modules``: qualified module name -> class name; ``tensors``: state-dict key -> shape. A
    handler's :meth:`AlgorithmHandler.restore` reads the structure its algorithm left from these.
    """

    modules: Mapping[str, str] = field(default_factory=dict)
    tensors: Mapping[str, tuple[int, ...]] = field(default_factory=dict)


class AlgorithmHandler:
    """Base class of the handlers. Subclasses implement :meth:`apply`; the default :meth:`restore`
    says the algorithm changes only values, which a checkpoint's state dict restores.

    Called per block (the block-by-block data phase, :mod:`quark_brevitas.blocks.engine`), a handler may
    assume: ``model`` is one block (or a holder module around one layer outside the blocks, whose
    attribute keeps the layer's name); ``data`` is a :class:`~quark_brevitas.calibration.data.BlockInputs` whose
    batches are that block's ``(args, kwargs)`` as the model called it (keyword inputs such as attention
    masks and position embeddings included), produced by the already quantized earlier blocks;
    ``data.forward(model, desc)`` runs them through the block; names inside ``model`` are relative to the
    block (its qualified name is the block's ``BlockInputs.label``); statistics are combined with
    ``data.all_reduce`` (a no-op unless the data are sharded over processes). A handler that needs the
    whole model in every pass sets ``blockwise = False`` and the pipeline then runs the whole model.
    """

    #: Whether the algorithm gives the intended result when run on one block at a time with the block's
    #: cached inputs (see the class docstring).
    blockwise: bool = True

    def apply(self, algo: Any, model: nn.Module, data: CalibrationData | None) -> nn.Module:
        """Run the algorithm on ``model`` (the whole model, or one block of it) with ``data`` (``None``
        only for algorithms whose config says ``needs_data = False``); return the model."""
        raise NotImplementedError

    def apply_unit(self, algo: Any, unit: nn.Module, data: CalibrationData | None, name: str, *,
                   block: bool) -> nn.Module:
        """Run the algorithm on one part of the model in the block-by-block data phase: a block (``block``
        true; ``name`` its qualified name) or a holder around a layer outside the blocks. By default the
        part is treated as a model (:meth:`apply`)."""
        return self.apply(algo, unit, data)

    def check(self, algo: Any, path: str) -> None:
        """Raise if the algorithm cannot run here at all (e.g. the installed Brevitas lacks it); called
        when the config is accepted, before any model is touched."""

    def restore(self, algo: Any, model: nn.Module, saved: SavedStructure) -> nn.Module:
        """Recreate, without data, the structure :meth:`apply` leaves in a model (wrappers, buffers,
        parameters), so that a saved state dict fits; the values come from the state dict."""
        return model

    def describe(self, algo: Any, model: nn.Module) -> list[str]:
        """Lines saying what the algorithm will work on in ``model`` (e.g. the inferred decoder and scaling
        layers); raises :class:`ConfigError` if it cannot run on ``model``. Nothing to say by default."""
        return []

    def apply_streamed(self, algo: Any, model: nn.Module, stack: str, *,
                       values: bool = True) -> tuple[nn.Module, BlockStep | None]:
        """A data-free step on a model whose blocks (the ``nn.ModuleList`` ``stack``) are loaded one at a time
        (streaming from a folder, or a streamed checkpoint): they sit on the ``meta`` device now. Apply the part
        outside the blocks to ``model`` and return it with the part to apply to each block when the block source
        loads it (``step(block, name)``, before anything else runs on the block; ``None``: nothing per block).
        ``values``: compute the new values (quantizing), or only recreate the structure the step leaves (loading a
        checkpoint, whose tensors fill it). By default the whole step runs on the model as it is."""
        return self.apply(algo, model, None), None


_HANDLERS: dict[type, AlgorithmHandler] = {}


def register(config_type: type) -> Any:
    """Class decorator: ``@register(MyAlgo) class MyAlgoHandler(AlgorithmHandler): ...`` makes the pipeline
    run ``MyAlgoHandler().apply`` for every ``MyAlgo`` config (and its subclasses without a handler)."""

    def decorate(handler_cls: type[AlgorithmHandler]) -> type[AlgorithmHandler]:
        if not (isinstance(handler_cls, type) and issubclass(handler_cls, AlgorithmHandler)):
            raise TypeError(f"register({config_type.__name__}) decorates AlgorithmHandler subclasses, got "
                            f"{handler_cls!r}")
        _HANDLERS[config_type] = handler_cls()
        return handler_cls

    return decorate


def handler_for(algo: Any, path: str = "") -> AlgorithmHandler:
    """The handler of an algorithm config (the closest registered class in its MRO)."""
    for cls in type(algo).__mro__:
        if cls in _HANDLERS:
            return _HANDLERS[cls]
    raise ConfigError(path, f"{type(algo).__name__} has no registered handler; register one with "
                            "quark_brevitas.algorithms.register")


def apply_algorithm(algo: Any, model: nn.Module, calib_loader: Any = None) -> nn.Module:
    """Run one algorithm on ``model`` in place, outside a ``quantize_model`` call (e.g. a post-quantization
    algorithm on a model loaded from a checkpoint); returns the model."""
    data = CalibrationData.wrap(calib_loader)
    if data is None and algo.needs_data:
        raise CalibrationDataError(f"{type(algo).__name__} needs calibration data: pass calib_loader")
    return handler_for(algo).apply(algo, model, data if algo.needs_data else None)


def describe_algorithms(config: Any, model: nn.Module) -> list[str]:
    """What each algorithm of ``config`` (a :class:`~quark_brevitas.config.Config`) will work on in ``model``, as
    the lines ``plan`` prints after its table: ``pre_quant_opt_config[0] SmoothQuantConfig:`` then the handler's
    indented lines (algorithms with nothing to say are left out)."""
    lines: list[str] = []
    for stage in ("pre_quant_opt_config", "algo_config"):
        for index, algo in enumerate(getattr(config, stage)):
            path = f"{stage}[{index}]"
            described = handler_for(algo, path).describe(algo, model)
            if described:
                lines.append(f"{path} {type(algo).__name__}:")
                lines += [f"  {line}" for line in described]
    return lines


def registered_handlers() -> dict[type, AlgorithmHandler]:
    """A copy of the registry (config class -> handler)."""
    return dict(_HANDLERS)
