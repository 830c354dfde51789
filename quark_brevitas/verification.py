"""Verification of a Config before any model is touched: every field is checked, and every rejection
names its field path and what is allowed.

Three layers of checks, each in the one place that knows the rule:

1. Types: every field against its own annotation (:func:`quark_brevitas.serialization.check_fields`,
   the same walker the file parser uses), so a ``QTensorConfig(bit_width="8")`` built in code fails like
   ``bit_width: "8"`` in a file.
2. Tensor specs: what the translation table can honour (:func:`quark_brevitas.quantizers.verify_spec`),
   and here how the specs of one layer relate (a quantized bias needs int input and weight scales).
3. Algorithms: each algorithm's own ``verify`` for its parameters, and here the rules between entries.

This module sits below :mod:`quark_brevitas.config` and does not import it: it checks objects against
the annotations of their own dataclasses. Checking that the argument *is* a Config (or a
QuantizationConfig) is left to the callers in config, which own those classes. Checks that need the
model (do the layer names exist? what does a layer get once the levels are merged?) are in
:mod:`quark_brevitas.resolve`.
"""

from __future__ import annotations

from dataclasses import fields
from typing import Any

from quark_brevitas import algos as _algos
from quark_brevitas.dtypes import resolve_dtype
from quark_brevitas.errors import ConfigError
from quark_brevitas.quantizers import verify_spec
from quark_brevitas.serialization import check_fields, key_path
from quark_brevitas.types import QSchemeType, QuantType

__all__ = ["HIERARCHY_LEVELS", "verify_config", "verify_layer_config", "verify_partial_layer_config"]

#: The Config fields that map layer types / layer names to a QuantizationConfig (Quark's hierarchy).
HIERARCHY_LEVELS = ("layer_type_quant_config", "layer_quant_config")

#: A :class:`quark_brevitas.config.Config` / ``QuantizationConfig``: annotated loosely because naming the
#: classes would import config (see above).
ConfigLike = Any
LayerConfigLike = Any


def verify_config(config: ConfigLike) -> None:
    """Check that ``config`` can be honoured exactly; raise :class:`ConfigError` otherwise.

    Runs before the model is touched. Every rejected combination names its field and what is allowed.
    """
    check_fields(config)
    verify_layer_config(config.global_quant_config, "global_quant_config")
    for level in HIERARCHY_LEVELS:
        for key, layer in getattr(config, level).items():
            verify_partial_layer_config(layer, key_path(level, key))
    for name in ("pre_quant_opt_config", "algo_config"):
        for index, algo in enumerate(getattr(config, name)):
            algo.verify(config, f"{name}[{index}]")
    _verify_algorithm_combinations(config)


def _verify_algorithm_combinations(config: ConfigLike) -> None:
    equalizations = [i for i, algo in enumerate(config.pre_quant_opt_config)
                     if isinstance(algo, _algos.ActivationEqualization)]
    if len(equalizations) > 1:
        raise ConfigError(
            f"pre_quant_opt_config[{equalizations[1]}]",
            "ActivationEqualization may appear once: a second pass would wrap the already wrapped layers, "
            "which Brevitas cannot run; use one entry with the alpha you want",
        )
    post = [a for a in config.algo_config
            if isinstance(a, _algos.GPTQ | _algos.GPFQ | _algos.GPFA2Q | _algos.GPTQConfig)]
    if len({type(a) for a in post}) > 1:
        names = sorted({type(a).__name__ for a in post})
        raise ConfigError("algo_config", f"use at most one of GPTQ, GPFQ, GPFA2Q, GPTQConfig (got {names}): each "
                                         "rounds the weights again, undoing the one before")


def _verify_specs(layer: LayerConfigLike, path: str) -> dict[str, Any]:
    """Each tensor spec of ``layer`` on its own; returns the specs by role."""
    check_fields(layer, path)
    specs = {f.name: getattr(layer, f.name) for f in fields(layer)}
    for role, spec in specs.items():
        if spec is not None:
            verify_spec(spec, role, f"{path}.{role}")
    return specs


def verify_layer_config(layer: LayerConfigLike, path: str) -> None:
    """Check one QuantizationConfig (all four tensor specs and how they relate)."""
    _verify_specs(layer, path)
    if layer.bias is None:
        return
    if layer.input_tensors is None:
        raise ConfigError(
            f"{path}.bias",
            "bias quantization needs input quantization (the bias scale is input scale x weight scale); "
            "set input_tensors or remove bias",
        )
    for role in ("input_tensors", "weight"):
        spec = getattr(layer, role)
        spec = resolve_dtype(spec, f"{path}.{role}") if spec is not None else None
        if spec is not None and spec.quant_type is not QuantType.int_quant:
            raise ConfigError(
                f"{path}.bias",
                f"integer bias quantization needs int_quant {role} (its scale is input scale x weight "
                f"scale); {role} is {spec.quant_type.name}. Remove bias or use int_quant {role}",
            )
        if spec is not None and (spec.qscheme is QSchemeType.per_group or spec.is_dynamic):
            what = "per_group" if spec.qscheme is QSchemeType.per_group else "dynamic"
            need = "a per-tensor or per-channel weight scale" if role == "weight" else \
                "a static per-tensor input scale"
            raise ConfigError(
                f"{path}.bias",
                f"integer bias quantization needs {need} (the bias scale is input scale x weight scale); "
                f"{role} is {what}. Remove bias (the bias then stays float)",
            )
    if layer.weight is None:
        raise ConfigError(
            f"{path}.bias",
            "bias quantization needs weight quantization (the bias scale is input scale x weight scale); "
            "set weight or remove bias",
        )


def verify_partial_layer_config(layer: LayerConfigLike, path: str) -> None:
    """Check a layer-type or layer-name entry: each tensor spec on its own.

    How the specs relate (bias needs input and weight quantization) is checked per module once the
    levels are merged (:mod:`quark_brevitas.resolve`), since a ``None`` here defers to a level above.
    An entry whose four specs are all ``None`` changes nothing and is rejected, because it reads as
    "keep this layer in float", which is what ``exclude`` is for.
    """
    specs = _verify_specs(layer, path)
    if all(spec is None for spec in specs.values()):
        raise ConfigError(
            path,
            "all of input_tensors, output_tensors, weight and bias are None, which changes nothing (None "
            "defers to the next level up); set at least one, or list the layer in exclude to keep it in float",
        )
