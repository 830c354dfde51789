"""Which QuantizationConfig each module gets: Quark's configuration hierarchy (reference 001).

A :class:`~quark_brevitas.config.Config` describes quantization at three levels, and this module
is the one place that decides how they combine for one module.

Levels, most specific first:

1. ``layer_quant_config`` — by module name. Keys are qualified module names as
   ``model.named_modules()`` gives them (``"fc1"``, ``"encoder.layer.0.attention.self.query"``) or
   :func:`fnmatch.fnmatchcase` patterns over them (``"encoder.layer.*.attention.*"``). A key applies
   to the module whose *own* name it matches, not to the layers inside it: use ``"block.*"`` to
   reach the layers of ``block``.
2. ``layer_type_quant_config`` — by layer type. A key names the module's *exact* class (as in the
   layer map: a subclass of ``nn.Linear`` is not a ``Linear``), as a class or by name: ``"Conv2d"``,
   ``"torch.nn.Conv2d"`` or ``"package.module.MyConv"`` for a layer registered in the container.
3. ``global_quant_config``.

For each tensor role (``weight``, ``input_tensors``, ``output_tensors``, ``bias``) the most
specific level whose spec is not ``None`` wins: ``None`` defers to the next level up, and ``None``
at the global level means that tensor is not quantized. Merging is per role, never per field of a
spec. ``exclude`` overrides all levels: a module whose name, or the name of any module containing
it, matches an exclude entry stays in float (excluding ``"encoder"`` excludes its layers).

When several ``layer_quant_config`` keys match one module, the winner is: the key equal to the
module's name; otherwise the pattern with the most literal (non-wildcard) characters, so
``"encoder.*.query"`` beats ``"encoder.*"``; otherwise the key listed first.

Why the model-dependent checks are errors, not warnings: a typo in a layer name would otherwise
silently give that layer the global config, i.e. quantize the wrong thing. So every
``layer_quant_config`` key must match a quantizable layer of the model, every ``exclude`` entry
some module, and every ``layer_type_quant_config`` key a quantizable type present in the model;
each error lists the closest real names. After merging, each layer's config must pass
:func:`~quark_brevitas.config.verify_layer_config` (e.g. a bias spec needs an input spec from some
level). :class:`~quark_brevitas.api.ModelQuantizer` runs all of this on the caller's model before
copying or changing it; names are not checked again on the pre-processed model, where BatchNorm
layers may have been merged away (FX tracing keeps the other modules' names).
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from fnmatch import fnmatchcase
from typing import Any

from torch import nn

from quark_brevitas.config import (
    TENSOR_ROLES,
    Config,
    QuantizationConfig,
    QuantizationSpec,
    key_path,
    layer_type_key,
    type_name,
    verify_layer_config,
)
from quark_brevitas.config.enums import QSchemeType
from quark_brevitas.errors import ConfigError

__all__ = ["EXCLUDED", "GLOBAL", "Resolution", "Resolver", "literal_length"]

def _tokens_last(cls: type) -> bool:
    """Layers whose input has its features along the last dimension (one scale per token fits): ``nn.Linear``
    and Hugging Face's ``Conv1D`` (GPT-2's projections, a Linear with a transposed weight)."""
    return cls is nn.Linear or (cls.__name__ == "Conv1D" and cls.__module__ == "transformers.pytorch_utils")


_GROUPED_ACTIVATION_LAYERS = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.ConvTranspose1d, nn.ConvTranspose2d)

#: Source of a spec that came from ``global_quant_config`` (also when it says "not quantized").
GLOBAL = "global"
#: Source of every role of an excluded module.
EXCLUDED = "excluded"

_MAX_LISTED = 12


@dataclass(frozen=True)
class Resolution:
    """What one module gets: its merged config (``None``: stays float) and, per tensor role, the
    level it came from (``"global"``, ``'layer_type_quant_config["Conv2d"]'``,
    ``'layer_quant_config["fc1"]'`` or ``"excluded"``)."""

    layer_config: QuantizationConfig | None
    sources: dict[str, str]


def literal_length(pattern: str) -> int:
    """How many characters ``pattern`` matches literally (``*``, ``?`` and ``[...]`` sets count 0),
    following :func:`fnmatch.translate`'s reading of brackets."""
    count, i, n = 0, 0, len(pattern)
    while i < n:
        char = pattern[i]
        if char in "*?":
            i += 1
            continue
        if char == "[":
            j = i + 1
            if j < n and pattern[j] == "!":
                j += 1
            if j < n and pattern[j] == "]":
                j += 1
            end = pattern.find("]", j)
            if end >= 0:
                i = end + 1
                continue
        count += 1
        i += 1
    return count


def _listing(names: Iterable[str]) -> str:
    names = list(names)
    shown = ", ".join(names[:_MAX_LISTED])
    return shown + (f", ... ({len(names)} in all)" if len(names) > _MAX_LISTED else "")


def _suggest(word: str, candidates: Iterable[str]) -> str:
    close = difflib.get_close_matches(word, list(dict.fromkeys(candidates)), n=3, cutoff=0.5)
    return "did you mean " + " or ".join(repr(c) for c in close) + "? " if close else ""


def _ancestors_and_self(name: str) -> list[str]:
    parts = name.split(".")
    return [".".join(parts[: i + 1]) for i in range(len(parts))]


class Resolver:
    """Resolves a config's hierarchy for the modules of a model, given the backend's layer map.

    Construction checks the ``layer_type_quant_config`` keys against the layer map (model-independent);
    :meth:`check_model` checks names against a model; :meth:`resolve` answers one module.
    """

    def __init__(self, config: Config, layer_map: Mapping[type, Any]) -> None:
        self.config = config
        self.layer_map = layer_map
        #: exact class -> (source path, its QuantizationConfig)
        self.type_levels: dict[type, tuple[str, QuantizationConfig]] = self._match_type_keys()

    # ------------------------------------------------------------------ layer types
    def _match_type_keys(self) -> dict[type, tuple[str, QuantizationConfig]]:
        aliases: dict[str, set[type]] = {}
        for cls in self.layer_map:
            for alias in (cls.__name__, type_name(cls), f"{cls.__module__}.{cls.__qualname__}"):
                aliases.setdefault(alias, set()).add(cls)
        supported = sorted({type_name(cls) for cls in self.layer_map})
        levels: dict[type, tuple[str, QuantizationConfig]] = {}
        for raw_key, layer in self.config.layer_type_quant_config.items():
            key = layer_type_key(raw_key)
            path = key_path("layer_type_quant_config", key)
            found = aliases.get(key, set()) if isinstance(key, str) else set()
            if len(found) > 1:
                names = sorted(f"{cls.__module__}.{cls.__qualname__}" for cls in found)
                raise ConfigError(path, f"names several quantizable types ({', '.join(names)}); "
                                        "use the qualified name of one")
            if not found:
                raise ConfigError(
                    path,
                    f"not a quantizable layer type; {_suggest(str(key), list(aliases))}quantizable types "
                    f"(exact class): {', '.join(supported)}. Register other types with a LayerMapping in "
                    "the container's layer_map.",
                )
            (cls,) = found
            if cls in levels:
                raise ConfigError(path, f"names the same layer type as {levels[cls][0]}; keep one entry")
            levels[cls] = (path, layer)
        return levels

    # ------------------------------------------------------------------ model checks
    def check_model(self, model_label: str, module_names: Iterable[str], quantizable: Mapping[str, type]) -> None:
        """Raise :class:`ConfigError` for any hierarchy entry that matches nothing in the model.

        ``module_names``: every module's qualified name; ``quantizable``: name -> exact class of the
        modules the backend would replace.
        """
        names = [name for name in dict.fromkeys(module_names) if name]
        for key in self.config.layer_quant_config:
            self._check_name_key(model_label, key, names, quantizable)
        for index, entry in enumerate(self.config.exclude):
            if not any(fnmatchcase(name, entry) for name in names):
                raise ConfigError(
                    f"exclude[{index}]",
                    f"{entry!r} matches no module of {model_label}; {_suggest(entry, names)}"
                    f"module names: {_listing(names)}",
                )
        present = set(quantizable.values())
        for cls, (path, _) in self.type_levels.items():
            if cls not in present:
                kinds = sorted({type_name(c) for c in present})
                raise ConfigError(
                    path,
                    f"{model_label} has no {type_name(cls)} layer; {_suggest(type_name(cls), kinds)}"
                    f"quantizable layer types it has: {', '.join(kinds) or 'none'}",
                )

    def _check_name_key(self, model_label: str, key: str, names: list[str], quantizable: Mapping[str, type]) -> None:
        path = key_path("layer_quant_config", key)
        matched = [name for name in names if fnmatchcase(name, key)]
        layers = list(quantizable)
        if not matched:
            raise ConfigError(
                path,
                f"matches no module of {model_label}; {_suggest(key, layers or names)}quantizable layers: "
                f"{_listing(layers)}",
            )
        if not any(name in quantizable for name in matched):
            inside = [layer for layer in layers if any(layer.startswith(m + ".") for m in matched)]
            hint = f"to reach the layers inside it, use {key + '.*'!r} ({_listing(inside)}); " if inside else ""
            raise ConfigError(
                path,
                f"matches only modules that are not quantized layers ({_listing(matched)}); a name key "
                f"applies to the layer it names; {hint or _suggest(key, layers)}quantizable layers: "
                f"{_listing(layers)}",
            )

    # ------------------------------------------------------------------ resolution
    def excluded(self, name: str) -> bool:
        """Whether ``name`` or a module containing it matches an exclude entry."""
        scopes = _ancestors_and_self(name) if name else [name]
        return any(fnmatchcase(scope, entry) for entry in self.config.exclude for scope in scopes)

    def name_key(self, name: str) -> str | None:
        """The ``layer_quant_config`` key that applies to module ``name`` (see the module docstring)."""
        candidates = [(key != name, -literal_length(key), index, key)
                      for index, key in enumerate(self.config.layer_quant_config) if fnmatchcase(name, key)]
        return min(candidates)[3] if candidates else None

    def resolve(self, name: str, cls: type) -> Resolution:
        """Merge the levels for the module called ``name`` of exact class ``cls``."""
        if self.excluded(name):
            return Resolution(None, dict.fromkeys(TENSOR_ROLES, EXCLUDED))
        levels: list[tuple[str, QuantizationConfig]] = []
        key = self.name_key(name)
        if key is not None:
            levels.append((key_path("layer_quant_config", key), self.config.layer_quant_config[key]))
        if cls in self.type_levels:
            levels.append(self.type_levels[cls])
        if not levels and getattr(self.layer_map.get(cls), "explicit_only", False):
            return Resolution(None, {})  # quantized only where the config names it (LayerMapping.explicit_only)
        levels.append((GLOBAL, self.config.global_quant_config))
        specs: dict[str, Any] = {}
        sources: dict[str, str] = {}
        for role in TENSOR_ROLES:
            source, spec = next(((s, getattr(layer, role)) for s, layer in levels
                                 if getattr(layer, role) is not None), (GLOBAL, None))
            specs[role], sources[role] = spec, source
        if all(spec is None for spec in specs.values()):
            return Resolution(None, sources)
        merged = QuantizationConfig(**specs)
        if len(levels) > 1:
            self._verify_merged(name, cls, merged, sources)
        self._verify_for_layer_type(name, cls, merged, sources)
        return Resolution(merged, sources)

    @staticmethod
    def _verify_for_layer_type(name: str, cls: type, merged: QuantizationConfig, sources: dict[str, str]) -> None:
        """Specs whose meaning depends on the layer: one dynamic scale per token needs tokens along the last
        dimension, i.e. a Linear layer (a convolution's last dimension is the image width); per-group (and MX)
        activations need a layer whose channel axis Brevitas knows (Linear, convolutions)."""
        for role in ("input_tensors", "output_tensors"):
            spec = getattr(merged, role)
            if spec is None or not isinstance(spec, QuantizationSpec):
                continue
            spec = spec.resolved()
            source = sources.get(role, GLOBAL)
            path = f"{'global_quant_config' if source == GLOBAL else source}.{role}"
            if spec.is_dynamic and spec.qscheme is QSchemeType.per_channel and not _tokens_last(cls):
                raise ConfigError(path, f"module {name!r} ({cls.__name__}): per-token dynamic activations "
                                        "(qscheme=per_channel, is_dynamic=True) need a Linear layer (tokens along the "
                                        "last dimension); use per_tensor or per_group for this layer type")
            if spec.qscheme is QSchemeType.per_group and cls not in _GROUPED_ACTIVATION_LAYERS:
                raise ConfigError(path, f"module {name!r} ({cls.__name__}): per_group / MX activations need a layer "
                                        "whose channel axis Brevitas knows (Linear, Conv1d/2d, ConvTranspose1d/2d); "
                                        "use per_tensor activations for this layer type")

    @staticmethod
    def _verify_merged(name: str, cls: type, merged: QuantizationConfig, sources: dict[str, str]) -> None:
        try:
            verify_layer_config(merged, "merged")
        except ConfigError as exc:
            role = exc.path.split(".")[1] if exc.path.count(".") >= 1 else "bias"
            source = sources.get(role, GLOBAL)
            path = f"{'global_quant_config' if source == GLOBAL else source}.{role}"
            reason = str(exc)[len(exc.path) + 2:]
            origin = ", ".join(f"{r} from {s}" for r, s in sources.items() if getattr(merged, r) is not None)
            raise ConfigError(path, f"module {name!r} ({cls.__name__}) after merging the levels ({origin}): "
                                    f"{reason}") from None
