"""Layer-by-layer comparison of a float model and its quantized version (torch.ao's Numeric Suite, for
quark_brevitas models): where along the model the error comes from.

For each quantized layer, on the user's batches:

- ``weight_sqnr_db``: its quantized weight against its float weight (all projections of an attention);
- ``input_sqnr_db`` / ``output_sqnr_db``: the input the layer computes with (after its own input quantizer)
  and its output, in the quantized model's own execution, against the float execution: errors of the
  layers before it accumulate;
- ``input_sqnr_isolated_db`` / ``output_sqnr_isolated_db``: the same layer fed the *float* input: its own
  input quantization, and the error the layer alone adds.

The float reference of a layer is the quantized model itself with every quantizer switched off. The
caller's float model cannot serve per layer: the default ``Preprocess`` merges BatchNorm into convolutions and
rescales channels between layers (equalization), so its intermediate tensors differ from the quantized
model's by design, while the switched-off model computes exactly the float function with the quantized
model's structure. The caller's float model is the reference of the whole-model output
(:attr:`Rows.summary`: ``output_sqnr_db``, ``top1_agreement``), and ``reference_sqnr_db`` says how closely the
switched-off model matches it (float rounding: > 60 dB). Post-quantization algorithms (GPTQ, GPFQ, bias
correction) move the float weights and biases: when the quantized model's config (which it carries) ran any, the
float model is quantized once more without them, and the switched-off layers borrow those parameters, so the
reference stays the float function and the weight SQNR compares the final weights with the original ones.

Every forward pass goes through the pipeline's :meth:`~quark_brevitas.calibration.data.CalibrationData.forward` loop:
for each batch, one module runs the float model, the switched-off model, the quantized model and each
layer alone, then drops the batch's tensors (memory: one batch's activations).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from quark_brevitas.analysis.measure import disabled, eval_mode, evaluation_data, pre_algorithm_layers, quantized_layers
from quark_brevitas.analysis.metrics import SQNR, OutputAgreement, Rows, output_tensor
from quark_brevitas.brevitas_adapter import (
    input_quantizer,
    plain_tensor,
    quantization_disabled,
    weight_quantization_pairs,
)
from quark_brevitas.calibration.data import BatchToInputs
from quark_brevitas.config import Config
from quark_brevitas.container import Container
from quark_brevitas.errors import ModelError
from quark_brevitas.pipeline import CONFIG_ATTRIBUTE

logger = logging.getLogger(__name__)

__all__ = ["LayerComparison", "compare_layers"]

#: Below this SQNR (dB) of the switched-off model against the float model, the per-layer reference is suspect.
REFERENCE_WARNING_DB = 40.0


@dataclass(frozen=True)
class LayerComparison:
    """One quantized layer: SQNR in dB of each tensor (``inf``: exact; ``None``: not measured, e.g. a layer the
    batches never reached). ``index`` is the order of the layer's first call in the forward pass."""

    name: str
    module_type: str
    index: int
    weight_sqnr_db: float | None
    input_sqnr_db: float | None
    input_sqnr_isolated_db: float | None
    output_sqnr_db: float | None
    output_sqnr_isolated_db: float | None
    calls: int
    #: SQNR (dB) of the whole model's output with every layer quantized but this one: what keeping this
    #: layer in float would give (the layer that hurts most is the one that raises it most).
    model_sqnr_without_db: float | None = None


_FLOAT, _QUANT, _ISOLATED = "float", "quant", "isolated"


class _LayerProbe:
    """Hooks on one layer: what it was called with, the input its quantizer gave it, what it returned."""

    def __init__(self, name: str, layer: nn.Module, session: _Session) -> None:
        self.name, self.layer, self.session = name, layer, session
        self.records: dict[str, list[dict[str, Any]]] = {}
        self.input_sqnr = {_QUANT: SQNR(), _ISOLATED: SQNR()}
        self.output_sqnr = {_QUANT: SQNR(), _ISOLATED: SQNR()}
        self.calls = 0
        self.handles = [layer.register_forward_pre_hook(self._pre, with_kwargs=True),
                        layer.register_forward_hook(self._post)]
        quantizer = input_quantizer(layer)
        if quantizer is not None:
            self.handles.append(quantizer.register_forward_hook(self._input))

    def _current(self) -> dict[str, Any] | None:
        calls = self.records.get(self.session.phase)
        return calls[-1] if calls else None

    def _pre(self, _module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        phase = self.session.phase
        if phase is None:
            return
        if self.name not in self.session.order:
            self.session.order[self.name] = len(self.session.order)
        record: dict[str, Any] = {}
        if phase == _FLOAT:  # kept to call the layer alone; cloned because in-place ops may follow
            record["args"] = tuple(_clone(a) for a in args)
            record["kwargs"] = {k: _clone(v) for k, v in kwargs.items()}
            record["input"] = _first_tensor_or_none(args, kwargs)
        self.records.setdefault(phase, []).append(record)

    def _input(self, _module: nn.Module, _args: Any, output: Any) -> None:
        record = self._current()
        if record is not None and self.session.phase is not None and "quant_input" not in record:
            record["quant_input"] = plain_tensor(output).detach().clone()

    def _post(self, _module: nn.Module, _args: Any, output: Any) -> None:
        record = self._current()
        if record is not None and self.session.phase is not None:
            record["output"] = output_tensor(output, f"output of layer {self.name!r}").detach().clone()

    def compare(self) -> None:
        """Compare this batch's quantized and isolated calls with its float calls, then forget the batch."""
        floats = self.records.get(_FLOAT, [])
        for phase in (_QUANT, _ISOLATED):
            others = self.records.get(phase, [])
            if len(others) != len(floats):
                raise ModelError(f"layer {self.name!r} ran {len(floats)} time(s) in the float execution and "
                                 f"{len(others)} in the {phase} one; the analysis needs the same control flow")
            for ref, got in zip(floats, others):
                what = f"layer {self.name!r} ({phase})"
                if "quant_input" in ref and "quant_input" in got:
                    self.input_sqnr[phase].add(ref["quant_input"], got["quant_input"], f"input of {what}")
                self.output_sqnr[phase].add(ref["output"], got["output"], f"output of {what}")
        self.calls += len(floats)
        self.records.clear()

    def run_isolated(self) -> None:
        """Call the quantized layer on each float input of this batch."""
        for record in self.records.get(_FLOAT, []):
            self.layer(*record["args"], **record["kwargs"])

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


def _clone(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, tuple | list):
        return type(value)(_clone(v) for v in value)
    return value


def _first_tensor_or_none(args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.Tensor | None:
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor):
            return value.detach().clone()
    return None


class _Session(nn.Module):
    """Runs one batch through every execution the comparison needs; fed by ``CalibrationData.forward``."""

    def __init__(self, float_model: nn.Module, quant_model: nn.Module, layers: dict[str, nn.Module],
                 float_layers: dict[str, nn.Module] | None) -> None:
        super().__init__()
        self.float_model, self.quant_model = float_model, quant_model
        self.layers, self.float_layers = layers, float_layers
        self.phase: str | None = None
        self.order: dict[str, int] = {}
        self.probes = [_LayerProbe(name, layer, self) for name, layer in layers.items()]
        self.output_sqnr, self.reference_sqnr, self.agreement = SQNR(), SQNR(), OutputAgreement()
        self.without = {name: SQNR() for name in layers}

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        reference = output_tensor(self.float_model(*args, **kwargs))
        with quantization_disabled(self.quant_model), disabled(self.layers, self.layers, self.float_layers):
            self.phase = _FLOAT
            switched_off = output_tensor(self.quant_model(*args, **kwargs))
        self.phase = _QUANT
        quantized = output_tensor(self.quant_model(*args, **kwargs))
        self.phase = _ISOLATED
        for probe in self.probes:
            probe.run_isolated()
        self.phase = None
        for name in self.layers:
            with disabled(self.layers, [name], self.float_layers):
                self.without[name].add(reference, output_tensor(self.quant_model(*args, **kwargs)),
                                       f"model output with {name!r} in float")
        for probe in self.probes:
            probe.compare()
        self.output_sqnr.add(reference, quantized, "model output")
        self.reference_sqnr.add(reference, switched_off, "model output with quantization off")
        self.agreement.add(reference, quantized)
        return quantized

    def remove_hooks(self) -> None:
        for probe in self.probes:
            probe.remove()


def _float_layers(float_model: nn.Module, quant_model: nn.Module, batches: Any, container: Container | None,
                  batch_to_inputs: BatchToInputs | None) -> dict[str, nn.Module] | None:
    """The layers whose parameters the float reference borrows, if the config the quantized model carries ran
    post-quantization algorithms (see :func:`~quark_brevitas.analysis.measure.pre_algorithm_layers`)."""
    config = getattr(quant_model, CONFIG_ATTRIBUTE, None)
    if not isinstance(config, Config):
        return None
    layers = pre_algorithm_layers(float_model, config, batches, container, batch_to_inputs)
    return layers if layers is not None and set(layers) == set(quantized_layers(quant_model, container)) else None


def compare_layers(float_model: nn.Module, quant_model: nn.Module, batches: Any, *, max_batches: int | None = None,
                   batch_to_inputs: BatchToInputs | None = None, container: Container | None = None) -> Rows:
    """Compare ``quant_model`` with ``float_model`` layer by layer on ``batches`` (see the module docstring).

    Returns :class:`~quark_brevitas.analysis.metrics.Rows` of :class:`LayerComparison`, in the order the
    layers run; ``rows.summary`` holds ``output_sqnr_db``, ``top1_agreement`` (percent of rows/tokens with the
    same arg-max, ``None`` for outputs without a class axis), ``reference_sqnr_db`` and ``batches``.
    ``max_batches`` limits the batches used; ``container`` must be the one the model was quantized with if it
    registered other layer types. Neither model is modified (they run in eval mode; their mode is restored).
    """
    for label, model in (("float_model", float_model), ("quant_model", quant_model)):
        if not isinstance(model, nn.Module):
            raise TypeError(f"{label} must be a torch.nn.Module, got {type(model).__name__}")
    layers = quantized_layers(quant_model, container)
    if not layers:
        raise ModelError(f"quant_model ({type(quant_model).__name__}) has no quantized layer; pass the model "
                         "ModelQuantizer.quantize_model returned")
    data = evaluation_data(batches, max_batches, batch_to_inputs)
    float_layers = _float_layers(float_model, quant_model, batches, container, batch_to_inputs)
    session = _Session(float_model, quant_model, layers, float_layers)
    try:
        with eval_mode(float_model, quant_model):
            count = data.forward(session, "Comparing layers")
    finally:
        session.remove_hooks()
    rows = []
    for probe in session.probes:
        weights = SQNR()
        pairs = weight_quantization_pairs(probe.layer)
        if float_layers is not None:  # the weights before the algorithms moved them
            pairs = [(before, after) for (before, _), (_, after) in
                     zip(weight_quantization_pairs(float_layers[probe.name]), pairs)]
        for float_weight, quant_weight in pairs:
            weights.add(float_weight, quant_weight, f"weight of {probe.name!r}")
        rows.append(LayerComparison(
            name=probe.name, module_type=type(probe.layer).__name__,
            index=session.order.get(probe.name, len(session.order) + len(rows)),
            weight_sqnr_db=weights.db,
            input_sqnr_db=probe.input_sqnr[_QUANT].db, input_sqnr_isolated_db=probe.input_sqnr[_ISOLATED].db,
            output_sqnr_db=probe.output_sqnr[_QUANT].db, output_sqnr_isolated_db=probe.output_sqnr[_ISOLATED].db,
            calls=probe.calls, model_sqnr_without_db=session.without[probe.name].db,
        ))
    rows.sort(key=lambda row: row.index)
    summary = {"output_sqnr_db": session.output_sqnr.db, "top1_agreement": session.agreement.percent,
               "reference_sqnr_db": session.reference_sqnr.db, "batches": count}
    reference = summary["reference_sqnr_db"]
    if reference is not None and reference < REFERENCE_WARNING_DB:
        logger.warning("quant_model with quantization switched off differs from float_model (SQNR %.1f dB): are they "
                       "the same model? (GPTQ/GPFQ/bias correction move the float weights, which explains it)",
                       reference)
    return Rows(rows, summary)
