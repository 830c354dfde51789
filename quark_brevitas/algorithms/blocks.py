"""Algorithms that work one decoder layer (block) at a time: the handler base class and its block inputs.

Quark's LLM algorithms (SmoothQuant, AWQ, GPTQ) reason about one decoder layer at a time: which layers read the
same input, which norm precedes them, how the layer's output changes. :class:`BlockwiseHandler` states that
once: :meth:`~BlockwiseHandler.blocks` names the blocks of a model (:mod:`quark_brevitas.hf.structure`), and
:meth:`~BlockwiseHandler.apply_block` runs the algorithm on one block given a :class:`CalibrationData` whose
batches are that block's inputs. Names in the algorithm's config are relative to the block, so a block knows
everything it needs.

Run on a whole model (:meth:`~BlockwiseHandler.apply`), the handler captures the first block's inputs by running
the model up to it (a forward pre-hook stops the pass there), and feeds each processed block's outputs to the next
block when the stack is chained (checked on the first batch: each block called once, with the previous block's
output and otherwise the same arguments, as Hugging Face decoder stacks do); otherwise it captures each block's
inputs with a partial pass (quadratic in depth). The pipeline's block-by-block engine
(:mod:`quark_brevitas.blockwise`, the default for models made of blocks) calls ``apply_block`` directly through
:meth:`~BlockwiseHandler.apply_unit` and does not use this fallback; then a block's inputs are the outputs of the
earlier blocks as quantized (weights and activations), as in llm-compressor's sequential pipeline.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any, ClassVar

import torch
from torch import nn
from tqdm.auto import tqdm

from quark_brevitas.algorithms.base import AlgorithmHandler
from quark_brevitas.blockwise import UntilStopped, main_output, replayable
from quark_brevitas.brevitas_adapter import StopFwdException, int_weight_format
from quark_brevitas.data import BlockInputs, CalibrationData
from quark_brevitas.errors import ConfigError
from quark_brevitas.hf.structure import ScalingGroup, Structure, infer_scaling_layers, is_linear, model_structure

__all__ = ["BlockwiseHandler", "CallRecorder", "blocks_are_chained", "capture_block_inputs", "first_batch_output",
           "next_block_inputs"]


class _FirstBatchOnly(nn.Module):
    """``model`` called on the first batch only (later calls return ``None`` without running it)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model
        self.calls = 0

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        return self.model(*args, **kwargs) if self.calls == 1 else None


class CallRecorder:
    """While the context lasts, records every call of some modules: the replayable ``(args, kwargs)``
    (:attr:`calls`) and the main output, detached in float32 (:attr:`outputs`), per module name."""

    def __init__(self, modules: dict[str, nn.Module]) -> None:
        self.modules = modules
        self.calls: dict[str, list[tuple[tuple[Any, ...], dict[str, Any]]]] = {name: [] for name in modules}
        self.outputs: dict[str, list[torch.Tensor]] = {name: [] for name in modules}
        self._handles: list[Any] = []

    def __enter__(self) -> CallRecorder:
        for name, module in self.modules.items():
            self._handles.append(module.register_forward_pre_hook(
                lambda _m, args, kwargs, name=name: self.calls[name].append(replayable(args, kwargs)),
                with_kwargs=True))
            self._handles.append(module.register_forward_hook(
                lambda _m, _args, output, name=name: self.outputs[name].append(
                    main_output(output).detach().float().clone())))
        return self

    def __exit__(self, *exc: Any) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()


def capture_block_inputs(model: nn.Module, block: nn.Module, data: CalibrationData, desc: str) -> BlockInputs:
    """The ``(args, kwargs)`` ``block`` is called with, for every batch of ``data`` run through ``model`` (which
    stops at the block). Hugging Face's key/value caches are dropped and ``use_cache`` is turned off."""
    captured: list[tuple[tuple[Any, ...], dict[str, Any]]] = []

    def record(_module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        captured.append(replayable(args, kwargs))
        raise StopFwdException

    handle = block.register_forward_pre_hook(record, with_kwargs=True)
    try:
        data.forward(UntilStopped(model), desc)
    finally:
        handle.remove()
    return BlockInputs.of(captured, data, desc)


def first_batch_output(module: nn.Module, data: CalibrationData, desc: str) -> torch.Tensor:
    """``module``'s main output on the first batch of ``data`` (the others are not run)."""
    outputs: list[torch.Tensor] = []

    def keep(_index: int, output: Any) -> None:
        if output is not None:
            outputs.append(main_output(output).detach().clone())

    data.forward(_FirstBatchOnly(module), desc, on_output=keep)
    return outputs[0]


@contextlib.contextmanager
def _nothing(_model: nn.Module) -> Iterator[None]:
    yield


class BlockwiseHandler(AlgorithmHandler):
    """A handler whose algorithm runs one decoder layer (block) at a time; see the module docstring.

    Subclasses implement :meth:`apply_block`; :attr:`needs_scaling_layers` says whether the algorithm needs scaling
    groups (SmoothQuant, AWQ) and :meth:`inputs_context` under which quantization state a block's inputs are
    computed (the previous blocks' outputs).
    """

    #: Whether the algorithm folds scales and therefore needs scaling groups (given or inferred).
    needs_scaling_layers: ClassVar[bool] = False

    def structure(self, algo: Any, model: nn.Module) -> Structure:
        """The decoder layers, embeddings and scaling groups the algorithm works on: its config's explicit
        fields, the rest inferred from ``model`` (raises :class:`ConfigError` naming the field)."""
        return model_structure(model, decoder_layers=algo.model_decoder_layers,
                               scaling_layers=getattr(algo, "scaling_layers", None),
                               embedding_layers=algo.embedding_layers, path=type(algo).__name__,
                               want_scaling=self.needs_scaling_layers)

    def blocks(self, algo: Any, model: nn.Module) -> list[str]:
        """The qualified names of the blocks the algorithm runs on, in order (``""``: the model is one block)."""
        return list(self.structure(algo, model).blocks)

    def describe(self, algo: Any, model: nn.Module) -> list[str]:
        return self.structure(algo, model).describe(with_scaling=self.needs_scaling_layers)

    def scaling_groups(self, algo: Any, block: nn.Module) -> tuple[ScalingGroup, ...]:
        """The block's scaling groups: the config's, or those inferred from the block."""
        if getattr(algo, "scaling_layers", None) is not None:
            return tuple(ScalingGroup.from_quark(entry) for entry in algo.scaling_layers)
        return infer_scaling_layers(block)[0]

    def quantized_layers(self, algo: Any, block: nn.Module, where: str, names: list[str] | None = None,
                         field: str = "") -> dict[str, nn.Module]:
        """The Linear-like layers of ``block`` with an integer weight quantizer (or those ``names``, which must be
        such layers; ``field`` names the config field they come from), checked against the config's ``bit`` and
        ``group_size``, which restate the weight spec."""
        what = type(algo).__name__
        modules = dict(block.named_modules())
        if names is None:
            layers = {n: m for n, m in modules.items() if n and is_linear(m) and int_weight_format(m) is not None}
        else:
            layers = {}
            for index, name in enumerate(names):
                layer = modules.get(name)
                if layer is None or not is_linear(layer) or int_weight_format(layer) is None:
                    problem = "not a module" if layer is None else \
                        "not a Linear-like layer with an integer weight quantizer (excluded, or left in float)"
                    raise ConfigError(f"{what}.{field}[{index}]", f"{name!r} is {problem} of {where}")
                layers[name] = layer
        for name, layer in layers.items():
            bit_width, group_size, _ = int_weight_format(layer)
            if bit_width != algo.bit:
                raise ConfigError(f"{what}.bit", f"{algo.bit}, but in {where} {name} quantizes its weight to "
                                                 f"{bit_width} bits (set bit={bit_width}, or exclude the layer)")
            if group_size != algo.group_size:
                raise ConfigError(f"{what}.group_size", f"{algo.group_size}, but in {where} {name}'s weight "
                                                        f"quantizer has group size {group_size} (-1: no groups)")
        return layers

    def inputs_context(self, model: nn.Module) -> contextlib.AbstractContextManager[Any]:
        """The quantization state under which a block's inputs (the earlier blocks' outputs) are computed."""
        return _nothing(model)

    def apply_block(self, algo: Any, block: nn.Module, data: CalibrationData, name: str) -> nn.Module:
        """Run the algorithm on ``block`` (called ``name`` in the model; ``""`` for a model that is one block),
        whose inputs are the batches of ``data``; return the block."""
        raise NotImplementedError

    def apply_unit(self, algo: Any, unit: nn.Module, data: CalibrationData | None, name: str, *,
                   block: bool) -> nn.Module:
        """In the pipeline's block-by-block engine: :meth:`apply_block` on a block with its cached inputs (the
        engine already chains the blocks); layers outside the blocks are left alone, as :meth:`apply` leaves
        them (these algorithms work on decoder layers)."""
        if block:
            self.apply_block(algo, unit, data, name)
        return unit

    def apply(self, algo: Any, model: nn.Module, data: CalibrationData | None) -> nn.Module:
        """The whole-model path (the engine is off: ``blocks=False``, or a stack it cannot walk).

        Run :meth:`apply_block` on every block of ``model``, in order, each on its inputs as the model computes
        them with the blocks before it already processed: when the blocks are chained (:func:`blocks_are_chained`),
        the first block's inputs are captured and each processed block's outputs become the next block's hidden
        states; otherwise each block's inputs are captured with a pass of the model up to it."""
        model.eval()
        names = self.blocks(algo, model)
        if names == [""]:
            self.apply_block(algo, model, data, "")
            return model
        blocks = [model.get_submodule(name) for name in names]
        chained = len(blocks) > 1 and blocks_are_chained(model, blocks, data, f"{algo.name}: decoder layers")
        inputs: BlockInputs | None = None
        for name, block in tqdm(list(zip(names, blocks)), desc=f"{algo.name} blocks", leave=False, disable=None):
            if inputs is None or not chained:
                with self.inputs_context(model):
                    inputs = capture_block_inputs(model, block, data, f"{algo.name}: inputs of {name}")
            self.apply_block(algo, block, inputs, name)
            if chained and block is not blocks[-1]:
                with self.inputs_context(model):
                    inputs = next_block_inputs(block, inputs, f"{algo.name}: outputs of {name}")
        return model


def _same(a: Any, b: Any) -> bool:
    if a is b:
        return True
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, tuple | list) and isinstance(b, tuple | list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and not isinstance(a, nn.Module | torch.Tensor) and a == b


def blocks_are_chained(model: nn.Module, blocks: list[nn.Module], data: CalibrationData, desc: str) -> bool:
    """Whether, on the first batch, each block is called once, with the previous block's output as its first
    positional argument and otherwise with the same arguments as the first block (Hugging Face decoder stacks:
    ``hidden = layer(hidden, attention_mask=..., position_embeddings=...)``)."""
    calls: list[list[tuple[tuple[Any, ...], dict[str, Any]]]] = [[] for _ in blocks]
    outputs: list[list[torch.Tensor]] = [[] for _ in blocks]
    handles = []
    for index, block in enumerate(blocks):
        handles.append(block.register_forward_pre_hook(
            lambda _m, args, kwargs, i=index: calls[i].append((args, kwargs)), with_kwargs=True))
        handles.append(block.register_forward_hook(lambda _m, _a, out, i=index: outputs[i].append(main_output(out))))
    try:
        first_batch_output(model, data, desc)
    finally:
        for handle in handles:
            handle.remove()
    if any(len(c) != 1 for c in calls):
        return False
    (first_args, first_kwargs), = calls[0]
    for index in range(1, len(blocks)):
        (args, kwargs), = calls[index]
        if not (args and isinstance(args[0], torch.Tensor) and _same(args[0], outputs[index - 1][0])
                and _same(args[1:], first_args[1:]) and kwargs.keys() == first_kwargs.keys()
                and all(_same(kwargs[key], first_kwargs[key]) for key in kwargs)):
            return False
    return True


def next_block_inputs(block: nn.Module, inputs: BlockInputs, desc: str) -> BlockInputs:
    """The inputs of the block after ``block`` in a chained stack: ``block``'s outputs on ``inputs`` in place of
    the hidden states, the other arguments unchanged."""
    outputs: dict[int, torch.Tensor] = {}
    inputs.forward(block, desc, on_output=lambda index, out: outputs.__setitem__(index, main_output(out).detach()))
    calls = [((outputs[index], *args[1:]), kwargs) for index, (args, kwargs) in enumerate(inputs.loader)]
    return BlockInputs.of(calls, inputs.parent, desc)
