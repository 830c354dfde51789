"""The layerwise backend: replace compute-heavy layers by their Brevitas counterparts.

A *layer map* says, for each float layer class, which Brevitas class replaces it and how that
class's quantizer keyword arguments are built from a resolved :class:`QuantizationConfig`. The
default map covers ``Linear``, ``Conv1d``, ``Conv2d``, ``ConvTranspose1d``, ``ConvTranspose2d`` and
``MultiheadAttention``, ``Embedding`` (weight only, and only where the config names it: see
:attr:`LayerMapping.explicit_only`) and Hugging Face's ``Conv1D`` (GPT-2) when transformers is installed; users
add their own layer types through the dependency-injection container
(:mod:`quark_brevitas.container`) without patching the library. Matching is on the exact class,
as in Brevitas, so subclasses with different behaviour are not replaced by accident.

Which config each layer gets (global, per layer type, per layer name, excluded) is decided by
:mod:`quark_brevitas.resolve`; the backend walks the model, asks it, and replaces the layers.
:meth:`LayerwiseBackend.plan` is the dry run; :func:`plan_table` prints it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import importlib
import importlib.util
import logging
from collections.abc import Callable, Collection, Iterator, Mapping, MutableMapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import brevitas.nn as qnn
import torch
from brevitas.graph.utils import set_module
from torch import nn

from quark_brevitas.backend.groups import group_size_check, log_padded_groups
from quark_brevitas.backend.layers import QuantConv1D, QuantMultiheadAttention
from quark_brevitas.brevitas_adapter import (
    HALF_DTYPES,
    EqualizedModule,
    RotatedInput,
    float32_quantizer_kwargs,
    ignore_missing_keys,
    init_weight_scales,
    keep_quantizers_float32,
    quant_layer_for,
)
from quark_brevitas.calibration.data import model_device_dtype
from quark_brevitas.config import Config, QuantizationConfig
from quark_brevitas.config.enums import QSchemeType
from quark_brevitas.errors import ConfigError, ModelError
from quark_brevitas.quantizers import build_quantizer
from quark_brevitas.resolve import EXCLUDED, GLOBAL, Resolver

logger = logging.getLogger(__name__)

KwargsBuilder = Callable[[QuantizationConfig], dict[str, Any]]


def wbiol_kwargs(layer: QuantizationConfig) -> dict[str, Any]:
    """Quantizer kwargs for weight/bias/input/output layers (QuantLinear, QuantConv*, ...)."""
    return {
        "weight_quant": build_quantizer(layer.weight, "weight"),
        "bias_quant": build_quantizer(layer.bias, "bias"),
        "input_quant": build_quantizer(layer.input_tensors, "input_tensors"),
        "output_quant": build_quantizer(layer.output_tensors, "output_tensors"),
        "return_quant_tensor": False,
    }


def mha_kwargs(layer: QuantizationConfig) -> dict[str, Any]:
    """Quantizer kwargs for QuantMultiheadAttention.

    Projections follow the weight/bias/input specs; the internal q, k, v tensors use the input spec
    (symmetric, because they feed matmuls with signed operands), the softmax output uses the input
    spec's quantizer made unsigned for int formats (its values lie in [0, 1]).
    """
    weight = build_quantizer(layer.weight, "weight")
    bias = build_quantizer(layer.bias, "bias")
    act = build_quantizer(layer.input_tensors, "input_tensors")
    attn = act
    inputs = layer.input_tensors.resolved() if layer.input_tensors is not None else None
    if act is not None and inputs is not None and inputs.quant_type.name == "int_quant":
        attn = act.let(signed=False) if inputs.symmetric else act
    return {
        "in_proj_input_quant": act,
        "in_proj_weight_quant": weight,
        "in_proj_bias_quant": bias,
        "softmax_input_quant": None,
        "attn_output_weights_quant": attn,
        "q_scaled_quant": act,
        "k_transposed_quant": act,
        "v_quant": act,
        "out_proj_input_quant": act,
        "out_proj_weight_quant": weight,
        "out_proj_bias_quant": bias,
        "out_proj_output_quant": build_quantizer(layer.output_tensors, "output_tensors"),
        # Separate q/k/v projections: Brevitas's packed projection handles self-attention only, and a
        # MultiheadAttention may be called with other keys and values (nn.TransformerDecoder's cross-attention).
        "packed_in_proj": False,
        # Constructor arguments nn.MultiheadAttention does not keep as attributes, read from the float layer
        # (Brevitas's replacement evaluates lambdas on it); without them a bias-free layer or one with
        # add_bias_kv would not load into its quantized counterpart.
        "bias": lambda module: module.in_proj_bias is not None,
        "add_bias_kv": lambda module: module.bias_k is not None,
        "return_quant_tensor": False,
    }


#: ``(module, merged config) -> (field, reason)`` if this layer instance cannot be quantized so, else ``None``;
#: the field is a tensor role or a field of its spec (``"weight.qscheme"``).
LayerCheck = Callable[[nn.Module, QuantizationConfig], "tuple[str, str] | None"]


def transposed_conv_check(module: nn.Module, layer: QuantizationConfig) -> tuple[str, str] | None:
    """Per-channel weights of a grouped transposed convolution have no per-axis layout.

    Its weight is ``(in_channels, out_channels / groups, *kernel)``: output channel ``g * (out / groups) + j``
    is column ``j`` of input-channel block ``g``, so one scale per output channel is not one scale per
    index of any single weight axis, which is what Brevitas's per-channel quantizers (and ONNX
    ``DequantizeLinear``) provide. Brevitas fails on such a layer with a shape error deep inside.
    """
    spec = layer.weight
    if getattr(module, "groups", 1) == 1 or spec is None or spec.resolved().qscheme is not QSchemeType.per_channel:
        return None
    return "weight.qscheme", (
        f"per_channel weights are not supported for a grouped {type(module).__name__} (groups={module.groups}): "
        "each output channel's weights lie in one block of input channels, so there is no single weight axis "
        "with one scale per output channel (as Brevitas and ONNX DequantizeLinear need). Give this layer "
        "per_tensor or per_group weights (a layer_quant_config entry for it), exclude it, or use groups=1"
    )


def embedding_kwargs(layer: QuantizationConfig) -> dict[str, Any]:
    """Quantizer kwargs for QuantEmbedding: its table is its only quantized tensor (:func:`embedding_check`)."""
    return {"weight_quant": build_quantizer(layer.weight, "weight"), "return_quant_tensor": False}


def embedding_check(module: nn.Module, layer: QuantizationConfig) -> tuple[str, str] | None:
    """An embedding looks rows up by integer index: it has no bias, and its input (indices) and output (rows of
    the table) are not activations a quantizer would calibrate, so only a weight spec has a meaning."""
    for role in ("input_tensors", "output_tensors", "bias"):
        if getattr(layer, role) is not None:
            return role, (f"an {type(module).__name__} quantizes only its weight table (integer indices in, table "
                          f"rows out); give it a spec with weight only, or set {role} for Linear/convolution "
                          "layers at their type's level instead of globally")
    return None


@dataclass(frozen=True)
class LayerMapping:
    """How one float layer class is quantized: the replacing class, its kwargs builder and, optionally,
    a check of each layer instance against its merged config (:data:`LayerCheck`), run by :meth:`plan`.

    ``explicit_only``: the layer is quantized only when the config names its type
    (``layer_type_quant_config``) or the layer itself (``layer_quant_config``); the global level does not
    reach it. Embedding tables are such a type: a global ``w8a8`` spec (weights *and* inputs) has no meaning
    for a table looked up by index, and quantizing every embedding of every model would change what the
    existing configs mean.
    """

    quant_class: type[nn.Module]
    build_kwargs: KwargsBuilder = wbiol_kwargs
    check: LayerCheck | None = None
    explicit_only: bool = False


#: Layer classes of optional packages, as ``(module, class name) -> mapping``: added to DEFAULT_LAYER_MAP when the
#: map is first read, if the package is installed, so that importing quark_brevitas does not import them
#: (transformers takes about 0.6 s to import). Hugging Face GPT-2 uses Conv1D for every projection.
OPTIONAL_LAYER_MAP: dict[tuple[str, str], LayerMapping] = {
    ("transformers.pytorch_utils", "Conv1D"): LayerMapping(QuantConv1D),
}


class _LayerMap(MutableMapping):
    """A dict of layer mappings whose optional entries (:data:`OPTIONAL_LAYER_MAP`) are added on first read."""

    def __init__(self, entries: Mapping[type[nn.Module], LayerMapping],
                 optional: Mapping[tuple[str, str], LayerMapping]) -> None:
        self._entries = dict(entries)
        self._optional = dict(optional)

    def _loaded(self) -> dict[type[nn.Module], LayerMapping]:
        optional, self._optional = self._optional, {}
        for (module_name, class_name), mapping in optional.items():
            if importlib.util.find_spec(module_name.partition(".")[0]) is None:
                continue
            try:
                cls = getattr(importlib.import_module(module_name), class_name)
            except (ImportError, AttributeError) as exc:  # a broken optional package must not stop other models
                logger.warning("%s.%s is not mapped for quantization: importing it failed (%s: %s)", module_name,
                               class_name, type(exc).__name__, exc)
                continue
            self._entries.setdefault(cls, mapping)
        return self._entries

    def __getitem__(self, key: type[nn.Module]) -> LayerMapping:
        return self._loaded()[key]

    def __setitem__(self, key: type[nn.Module], value: LayerMapping) -> None:
        self._loaded()[key] = value

    def __delitem__(self, key: type[nn.Module]) -> None:
        del self._loaded()[key]

    def __iter__(self) -> Iterator[type[nn.Module]]:
        return iter(self._loaded())

    def __len__(self) -> int:
        return len(self._loaded())

    def __repr__(self) -> str:
        return repr(self._loaded())


DEFAULT_LAYER_MAP: MutableMapping[type[nn.Module], LayerMapping] = _LayerMap({
    nn.Linear: LayerMapping(qnn.QuantLinear),
    nn.Conv1d: LayerMapping(qnn.QuantConv1d),
    nn.Conv2d: LayerMapping(qnn.QuantConv2d),
    nn.ConvTranspose1d: LayerMapping(qnn.QuantConvTranspose1d, check=transposed_conv_check),
    nn.ConvTranspose2d: LayerMapping(qnn.QuantConvTranspose2d, check=transposed_conv_check),
    nn.MultiheadAttention: LayerMapping(QuantMultiheadAttention, mha_kwargs),
    # int8 tables: the QCDQ exporter gathers the integer rows before dequantizing them (transformer presets)
    nn.Embedding: LayerMapping(qnn.QuantEmbedding, embedding_kwargs, check=embedding_check, explicit_only=True),
}, OPTIONAL_LAYER_MAP)


# Wrappers that pre-quantization steps put around a layer, and the attribute holding the layer:
# the wrapped layer keeps the wrapper's name for config resolution (activation equalization turns
# ``fc1`` into an EqualizedModule whose ``fc1.layer`` is the Linear; RotationConfig's R4 puts ``down_proj`` behind
# an online Hadamard as ``down_proj.layer``).
_WRAPPED_LAYER: dict[type[nn.Module], str] = {EqualizedModule: "layer", RotatedInput: "layer"}

_ROLE_COLUMNS = {"weight": "weight", "input_tensors": "input", "output_tensors": "output", "bias": "bias"}


@dataclass(frozen=True)
class PlannedLayer:
    """One row of the quantization plan: a module and the config it gets (``None``: stays float).

    ``sources`` maps each tensor role of a quantizable layer to the level its spec came from:
    ``"global"``, ``'layer_type_quant_config["Conv2d"]'``, ``'layer_quant_config["fc1"]'`` or
    ``"excluded"``; it is empty for modules the backend does not quantize (BatchNorm, ReLU, ...).

    ``graph_points`` (``Backend.graph`` only): the quantization points this layer owns, i.e. whose value reaches
    it (:class:`~quark_brevitas.backend.graph.QuantPoint`: tensor, kind, spec, sign, and for a shared-scale group
    the values sharing it), so that the plan shows every tensor the graph backend quantizes before calibration.
    """

    name: str
    module_type: str
    layer_config: QuantizationConfig | None
    sources: dict[str, str] = field(default_factory=dict)
    graph_points: tuple[Any, ...] = ()

    @property
    def quantized(self) -> bool:
        return self.layer_config is not None

    def spec_cells(self) -> list[str]:
        """The short form of the weight, input, output and bias specs (``-``: not quantized)."""
        layer = self.layer_config
        roles = ("weight", "input_tensors", "output_tensors", "bias")
        specs = [getattr(layer, role) if layer is not None else None for role in roles]
        return [spec.short() if spec is not None else "-" for spec in specs]

    def source_summary(self) -> str:
        """Where the specs came from in one cell, e.g. ``weight: layer_type_quant_config["Conv2d"];
        input, output, bias: global`` (``-`` for modules that are not quantizable)."""
        if not self.sources:
            return "-"
        groups: dict[str, list[str]] = {}
        for role in ("weight", "input_tensors", "output_tensors", "bias"):
            if role in self.sources:
                groups.setdefault(self.sources[role], []).append(_ROLE_COLUMNS[role])
        if len(groups) == 1:
            return next(iter(groups))
        return "; ".join(f"{', '.join(roles)}: {source}" for source, roles in groups.items())

    def points_cell(self) -> str:
        """The graph points in one cell, e.g. ``relu0 uint4 activation; add int4 shared(relu0+bn2)``."""
        cells = []
        for point in self.graph_points:
            shared = f"({'+'.join(point.inputs)})" if point.kind == "shared" else ""
            cells.append(f"{point.tensor} {point.short()} {point.kind}{shared}")
        return "; ".join(cells) or "-"


def plan_table(rows: Sequence[PlannedLayer]) -> str:
    """The plan as an aligned text table: name, type, quantized, weight, input, output, bias, source, and for
    ``Backend.graph`` the quantization points each layer owns."""
    graph = any(row.graph_points for row in rows)
    header = ("name", "type", "quantized", "weight", "input", "output", "bias", "source") + (
        ("graph points",) if graph else ())
    table = [header]
    for row in rows:
        table.append((row.name or "(model)", row.module_type, "yes" if row.quantized else "no",
                      *row.spec_cells(), row.source_summary()) + ((row.points_cell(),) if graph else ()))
    widths = [max(len(line[i]) for line in table) for i in range(len(header))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(line, widths)).rstrip() for line in table]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


class LayerwiseBackend:
    """Replaces every module whose exact class is in the layer map; leaves the rest in float."""

    def __init__(self, layer_map: Mapping[type[nn.Module], LayerMapping]) -> None:
        for key, value in layer_map.items():
            if not (isinstance(key, type) and issubclass(key, nn.Module)) or not isinstance(value, LayerMapping):
                raise TypeError(
                    f"layer map entry {key!r}: keys must be nn.Module subclasses and values LayerMapping "
                    f"instances, got {type(value).__name__}"
                )
        self.layer_map = dict(layer_map)

    def _walk(
        self, module: nn.Module, prefix: str = "", alias: str = ""
    ) -> Iterator[tuple[str, str, nn.Module, bool]]:
        """Yield (name, config name, module, mapped) in pre-order, not descending into mapped modules
        (e.g. MultiheadAttention's out_proj). A model that is itself a single layer is named ``""``.
        The config name is the name the hierarchy is resolved with: the module's own, except for a
        layer inside a pre-quantization wrapper, which keeps the wrapper's (see ``_WRAPPED_LAYER``)."""
        if not prefix and type(module) in self.layer_map:
            yield "", alias, module, True
            return
        wrapped = _WRAPPED_LAYER.get(type(module))
        for name, child in module.named_children():
            full = f"{prefix}.{name}" if prefix else name
            child_alias = alias if name == wrapped else (f"{alias}.{name}" if alias else name)
            mapped = type(child) in self.layer_map
            yield full, child_alias, child, mapped
            if not mapped:
                yield from self._walk(child, full, child_alias)

    def plan(self, model: nn.Module, config: Config, *, check_names: bool = True, prefix: str = ""
             ) -> list[PlannedLayer]:
        """Which modules get quantized, and with which config (does not modify the model).

        With ``check_names`` every layer name, pattern, exclude entry and layer type of the config
        must match the model (:meth:`quark_brevitas.resolve.Resolver.check_model`); the pipeline turns
        it off on the pre-processed copy, whose BatchNorm layers may have been merged away.
        ``prefix``: ``model`` is the submodule of that qualified name in a larger model (one block of the
        block-by-block data phase); the config is resolved with the full names, the rows keep the names
        relative to ``model``.
        """
        walked = list(self._walk(model, "", prefix))
        resolver = Resolver(config, self.layer_map)
        if check_names:
            names = [alias for _, alias, _, _ in walked] + [name for name, _ in model.named_modules()]
            quantizable = {alias: type(module) for _, alias, module, mapped in walked if mapped}
            resolver.check_model(type(model).__name__, names, quantizable)
        rows = []
        for name, alias, module, mapped in walked:
            if mapped:
                resolution = resolver.resolve(alias, type(module))
                self._check_layer(name, module, resolution.layer_config, resolution.sources)
                rows.append(PlannedLayer(name, type(module).__name__, resolution.layer_config, resolution.sources))
            else:
                rows.append(PlannedLayer(name, type(module).__name__, None))
        return rows

    def _check_layer(self, name: str, module: nn.Module, layer: QuantizationConfig | None,
                     sources: Mapping[str, str]) -> None:
        """Raise :class:`ConfigError` at the config level that gave the spec a layer instance cannot take."""
        check = self.layer_map[type(module)].check
        refusal = group_size_check(module, layer) if layer is not None else None
        if refusal is None and check is not None and layer is not None:
            refusal = check(module, layer)
        if refusal is None:
            return
        field_path, reason = refusal
        source = sources.get(field_path.split(".")[0], GLOBAL)
        path = f"{'global_quant_config' if source == GLOBAL else source}.{field_path}"
        raise ConfigError(path, f"module {name or '(model)'!r}: {reason}")

    def require_values(self, model: nn.Module, loaded_later: str | None = None) -> None:
        """Raise if some of the model's tensors have no values (on PyTorch's ``meta`` device), except inside
        ``loaded_later``, a submodule whose weights a block source loads one block at a time."""
        def later(name: str) -> bool:
            return loaded_later is not None and (name == loaded_later or name.startswith(loaded_later + "."))

        empty = [name or "(model)" for name, module in model.named_modules()
                 if not later(name)
                 and any(t.is_meta for t in (*module.parameters(recurse=False), *module.buffers(recurse=False)))]
        if empty:
            raise ModelError(
                f"{type(model).__name__} has modules on the 'meta' device ({', '.join(empty[:3])}"
                f"{', ...' if len(empty) > 3 else ''}): their weights have no values yet (a model built under "
                "torch.device('meta') or init_empty_weights), and quantization computes scales from them. Load "
                "the weights first (model.to_empty(device='cpu') followed by load_state_dict, or from_pretrained "
                "without device_map='meta'); plan() works on such a model"
            )

    def require_targets(self, model: nn.Module, rows: Sequence[PlannedLayer]) -> None:
        """Raise unless the plan quantizes at least one layer (a no-op quantization is a mistake)."""
        if any(row.quantized for row in rows):
            return
        if any(row.sources for row in rows):
            raise ModelError(
                f"the config quantizes no layer of {type(model).__name__}: every quantizable layer is "
                "excluded or gets no tensor spec from any level"
            )
        supported = sorted(cls.__name__ for cls in self.layer_map)
        raise ModelError(
            f"{type(model).__name__} has no layer the backend can quantize; supported layer types: "
            f"{supported}. Register a LayerMapping for your layer type in the container's layer_map."
        )

    def quantize(self, model: nn.Module, config: Config, *, check_names: bool = True, prefix: str = "",
                 log: int = logging.INFO, outputs_elsewhere: Collection[str] = ()) -> nn.Module:
        """Replace the planned layers of ``model`` in place and return it (``check_names``, ``prefix``: see
        :meth:`plan`). ``log``: the level of the "Quantized N layers" summary -- INFO when quantizing, DEBUG when
        a checkpoint's structure is rebuilt for loading (one summary line per stage of a run, not per reload).
        ``outputs_elsewhere``: layers (names relative to ``model``) whose ``output_tensors`` spec another
        quantizer executes (an attention's query quantizer): they get no output quantizer here."""
        rows = self.plan(model, config, check_names=check_names, prefix=prefix)
        self.require_values(model)
        if not (config.kv_cache_quant_config or config.softmax_quant_spec):  # cache/attention-only: no layer
            self.require_targets(model, rows)
        rows = [_without_output(row) if row.name in outputs_elsewhere else row for row in rows]
        targets = {row.name for row in rows if row.layer_config is not None}
        modules = dict(model.named_modules())
        # The float state dict has no quantizer parameters (scales are initialised from statistics on
        # first use), so Brevitas must be told to accept them as missing while loading it.
        with ignore_missing_keys(), _collection_paused():
            for row in rows:
                if row.layer_config is None:
                    continue
                old = modules[row.name]
                mapping = self.layer_map[type(old)]
                kwargs = mapping.build_kwargs(row.layer_config)
                # A float16/bfloat16 layer's quantizers hold and compute their state in float32 (see
                # brevitas_adapter.keep_quantizers_float32); its weights and activations keep their dtype.
                half = _floating_dtype(old) in HALF_DTYPES
                if half:
                    kwargs = float32_quantizer_kwargs(kwargs)
                # Tied weights stay tied (the float layer's own parameters: quark_brevitas.algorithms.ties).
                new = quant_layer_for(old, mapping.quant_class, kwargs, row.name)
                new.to(model_device_dtype(old)[0])  # Brevitas builds the quantizers' state on the CPU
                if half:
                    keep_quantizers_float32(new)
                if row.name == "":
                    model = new  # the model is itself a single supported layer
                else:
                    set_module(model, new, row.name)
        init_weight_scales(model)
        kept = [f"{r.name} ({r.module_type}{_why_float(r)})" for r in rows
                if r.layer_config is None and not any(r.name.startswith(t + ".") for t in targets)
                and (r.sources or not list(modules[r.name].children()))]
        log_padded_groups(rows, modules, logging.DEBUG if prefix else log)
        logger.log(logging.DEBUG if prefix else log, "Quantized %d layers%s; kept in float: %s", len(targets),
                   f" of {prefix}" if prefix else "", ", ".join(kept) if kept else "none")
        return model


def _without_output(row: PlannedLayer) -> PlannedLayer:
    """``row`` without its output spec (executed elsewhere); a layer left with no spec is not replaced."""
    layer = dataclasses.replace(row.layer_config, output_tensors=None) if row.layer_config is not None else None
    empty = layer is None or all(getattr(layer, role) is None for role in ("weight", "input_tensors", "bias"))
    return dataclasses.replace(row, layer_config=None if empty else layer)


@contextlib.contextmanager
def _collection_paused() -> Iterator[None]:
    """Python's cyclic garbage collector off while layers are replaced: building a Brevitas layer allocates a few
    hundred objects (its quantizers' module trees), and the collections they set off walk every object the
    process holds (torch's and transformers' modules included), which cost a third of a 4-block Llama's layer
    replacement. Cycles made meanwhile are collected by the collector's next run, after the replacement."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _floating_dtype(model: nn.Module) -> torch.dtype | None:
    return next((p.dtype for p in model.parameters() if p.is_floating_point()), None)


def _why_float(row: PlannedLayer) -> str:
    if not row.sources:
        return ""
    return ", excluded" if EXCLUDED in row.sources.values() else ", no spec at any level"


__all__ = [
    "DEFAULT_LAYER_MAP",
    "LayerCheck",
    "OPTIONAL_LAYER_MAP",
    "LayerMapping",
    "LayerwiseBackend",
    "PlannedLayer",
    "mha_kwargs",
    "plan_table",
    "transposed_conv_check",
    "wbiol_kwargs",
]
