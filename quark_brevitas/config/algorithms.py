"""Pre-quantization optimisations and post-quantization algorithms (Quark's Brevitas ``algos``), as data.

Each algorithm is a small dataclass (plain, serialisable data) with ``verify`` (its parameter rules,
called by config verification before any model is touched) and ``needs_data`` (whether it runs on
calibration data). Names and parameters follow ``quark.torch.extensions.brevitas.algos`` (re-exported as
:mod:`quark_brevitas.algos`) and, for Quark's LLM algorithms, ``quark.torch.quantization.config.config``.
What running an algorithm does lives in its handler (:mod:`quark_brevitas.algorithms`, which needs torch),
which the pipeline finds through a registry; this module stays plain data so a config loads without torch.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, ClassVar

from quark_brevitas.config.enums import QSchemeType, QuantType, ScaleType
from quark_brevitas.config.specs import QuantHierarchy, QuantizationSpec, resolve_dtype
from quark_brevitas.errors import ConfigError


@dataclass
class AlgorithmConfig:
    """Common base: the parameter checks and the registry of subclasses.

    ``config`` in :meth:`verify` is the :class:`~quark_brevitas.config.Config` being verified, seen through
    :class:`~quark_brevitas.config.specs.QuantHierarchy` (its three levels): Config holds the algorithm
    configs, so this module sits below it.
    """

    name: ClassVar[str] = ""
    #: Whether the algorithm runs on calibration data (the pipeline then requires a calib_loader).
    needs_data: ClassVar[bool] = True
    #: What the algorithm does to the weights, which decides where it may stand in ``algo_config`` (see
    #: :data:`EFFECTS`): a later algorithm must not undo an earlier one.
    effect: ClassVar[str] = "rounding"
    #: Other names files may give the class by (a Quark release's spelling): read, never written.
    tag_aliases: ClassVar[tuple[str, ...]] = ()

    def verify(self, config: QuantHierarchy, path: str) -> None:
        """Semantic checks of the parameters (their types are checked generically before this runs, by
        :mod:`quark_brevitas.config.checks`); subclasses add theirs."""


@dataclass
class PreQuantOptConfig(AlgorithmConfig):
    """An algorithm applied to the float model before quantization (a weight transform): in
    ``pre_quant_opt_config``, or in ``algo_config`` ahead of the algorithms that fit weights to the grid (Quark
    0.13 lists every algorithm there), where it runs before quantization too."""

    effect: ClassVar[str] = "transform"


@dataclass
class AlgoConfig(AlgorithmConfig):
    """An algorithm applied to the quantized, calibrated model."""


#: What an algorithm does to the weights, in the only order in which none undoes an earlier one: rotations of the
#: float model (RotationConfig: the scales a later transform folds would otherwise be rotated away), weight transforms
#: of the float model (SmoothQuant, equalization, pre-processing), then scale-and-clip searches on the quantized
#: weights (AWQ), then rounding with error compensation (GPTQ, GPFQ), then corrections of the final weights' error
#: (bias correction, BatchNorm statistics). Each value says why a later position is needed.
EFFECTS: dict[str, str] = {
    "rotation": "rotates the float weights by an orthogonal change of basis (run first, before quantization)",
    "transform": "transforms the float weights (run before quantization)",
    "scaling": "rescales and clips the weights the quantizer will round",
    "rounding": "rounds the weights onto the grid, compensating the error",
    "correction": "corrects the output error the final quantized weights leave",
}
EFFECT_ORDER = tuple(EFFECTS)


def _any_level_sets(config: QuantHierarchy, role: str) -> bool:
    """Whether some level of the hierarchy (global, layer type or layer name) quantizes ``role``."""
    levels = [config.global_quant_config, *config.layer_type_quant_config.values(),
              *config.layer_quant_config.values()]
    return any(getattr(level, role) is not None for level in levels)


def _uses_inputs(config: QuantHierarchy, path: str, what: str) -> None:
    if not _any_level_sets(config, "input_tensors"):
        raise ConfigError(path, f"{what} needs input_tensors quantization (at the global, layer-type or layer level)")


def uses_weights(config: QuantHierarchy, path: str, what: str) -> None:
    if not _any_level_sets(config, "weight"):
        raise ConfigError(path, f"{what} needs weight quantization (at the global, layer-type or layer level)")


@dataclass
class Preprocess(PreQuantOptConfig):
    """Make the float model easier to quantize: FX trace, merge BatchNorm into the preceding
    convolution/linear, graph (weight) equalization and channel splitting.

    These steps need a graph. A model that cannot be FX-traced (most Hugging Face transformers) is
    passed through unchanged with one warning that says which steps were skipped and why, so the
    default pipeline still runs.
    """

    name: ClassVar[str] = "Pre-Processing"
    needs_data: ClassVar[bool] = False
    trace_model: bool = True
    equalize_iterations: int = 20
    equalize_merge_bias: bool = True
    merge_batch_norm: bool = True
    channel_splitting_ratio: float = 0.0
    channel_splitting_split_input: bool = False

    def verify(self, config: QuantHierarchy, path: str) -> None:
        super().verify(config, path)
        if self.equalize_iterations < 0:
            raise ConfigError(f"{path}.equalize_iterations", "must be >= 0")
        if not 0.0 <= self.channel_splitting_ratio < 1.0:
            raise ConfigError(f"{path}.channel_splitting_ratio", "must be in [0, 1)")


@dataclass
class ActivationEqualization(PreQuantOptConfig):
    """SmoothQuant-style activation equalization: migrate activation outliers into the weights
    (``alpha`` sets how much). ``is_layerwise`` must match the layerwise backend."""

    name: ClassVar[str] = "Activation Equalization"
    is_layerwise: bool = True
    alpha: float = 0.5

    def verify(self, config: QuantHierarchy, path: str) -> None:
        super().verify(config, path)
        if not self.is_layerwise:
            raise ConfigError(f"{path}.is_layerwise", "must be True with Backend.layerwise")
        if not 0.0 <= self.alpha <= 1.0:
            raise ConfigError(f"{path}.alpha", f"must be in [0, 1], got {self.alpha}")


@dataclass
class GPTQ(AlgoConfig):
    """GPTQ (Frantar et al.): per-layer weight rounding that compensates the error with the inverse
    Hessian of the layer inputs. ``act_order`` processes columns by decreasing activation energy."""

    name: ClassVar[str] = "GPTQ"
    act_order: bool = False

    def verify(self, config: QuantHierarchy, path: str) -> None:
        super().verify(config, path)
        uses_weights(config, path, "GPTQ")


@dataclass
class GPFQ(AlgoConfig):
    """GPFQ (Lybrand & Saab; Zhang et al.): greedy path-following weight quantization that matches
    the float layer's output given the quantized inputs."""

    name: ClassVar[str] = "GPFQ"
    act_order: bool = False
    percentage_of_processed_inputs: float = 1.0

    def verify(self, config: QuantHierarchy, path: str) -> None:
        super().verify(config, path)
        uses_weights(config, path, self.name)
        _uses_inputs(config, path, self.name)
        if self.percentage_of_processed_inputs != 1.0:
            raise ConfigError(
                f"{path}.percentage_of_processed_inputs",
                "the installed Brevitas (>= 0.12) always processes all inputs; only 1.0 is allowed",
            )


@dataclass
class GPFA2Q(GPFQ):
    """Accumulator-aware GPFQ (A2Q / AXE, Colbert et al.): GPFQ whose weights are constrained so
    that dot products never overflow an ``accumulator_bit_width``-bit accumulator."""

    name: ClassVar[str] = "GPFA2Q"
    accumulator_bit_width: int = 16

    def verify(self, config: QuantHierarchy, path: str) -> None:
        super().verify(config, path)
        if not 8 <= self.accumulator_bit_width <= 32:
            raise ConfigError(f"{path}.accumulator_bit_width", "must be in 8..32")


@dataclass
class BiasCorrection(AlgoConfig):
    """Bias correction (Nagel et al.): shift each layer's bias by the mean output error that
    quantization introduced, measured on the calibration data."""

    name: ClassVar[str] = "Bias Correction"
    effect: ClassVar[str] = "correction"


@dataclass
class CalibrateBatchNorm(AlgoConfig):
    """Re-estimate BatchNorm running statistics on the quantized model (for BatchNorm layers that
    were not merged, e.g. with ``Preprocess(merge_batch_norm=False)``)."""

    name: ClassVar[str] = "Calibrate Batch Norm"
    effect: ClassVar[str] = "correction"



# ===================================================================== Quark's LLM algorithms (reference 002)
#: The keys of one ``scaling_layers`` entry (Quark's format; names relative to a decoder layer).
SCALING_LAYER_KEYS = ("prev_op", "layers", "inp", "module2inspect")


def verify_quark_name(algo: AlgorithmConfig, path: str) -> None:
    """Quark identifies these algorithms by ``name`` (its config files dispatch on it); another name would
    make the written file unreadable, by Quark and by this library."""
    default = next(f.default for f in fields(algo) if f.name == "name")
    if algo.name != default:
        raise ConfigError(f"{path}.name", f"must be {default!r} (Quark identifies {type(algo).__name__} by its "
                                          f"name), got {algo.name!r}")


def _verify_scaling_layers(entries: list[dict[str, Any]] | None, path: str) -> None:
    """Quark's ``scaling_layers``: ``{"prev_op": name, "layers": [names], "inp": name, "module2inspect": name}``
    per entry (``inp`` and ``module2inspect`` optional), names relative to a decoder layer."""
    if entries is None:
        return
    for index, entry in enumerate(entries):
        where = f"{path}.scaling_layers[{index}]"
        unknown = sorted(set(entry) - set(SCALING_LAYER_KEYS))
        if unknown:
            raise ConfigError(f"{where}.{unknown[0]}", f"unknown key; allowed: {list(SCALING_LAYER_KEYS)}")
        for key in ("prev_op", "inp", "module2inspect"):
            value = entry.get(key)
            if (key == "prev_op" or value is not None) and not (isinstance(value, str) and value):
                raise ConfigError(f"{where}.{key}", f"must be a module name relative to a decoder layer (e.g. "
                                                    f"'input_layernorm'), got {value!r}")
        layers = entry.get("layers")
        if not (isinstance(layers, list) and layers and all(isinstance(n, str) and n for n in layers)):
            raise ConfigError(f"{where}.layers", "must be a non-empty list of module names relative to a decoder "
                                                 f"layer (e.g. ['self_attn.q_proj']), got {layers!r}")
        if entry.get("inp") is not None and entry["inp"] not in layers:
            raise ConfigError(f"{where}.inp", f"must be one of layers {layers} (the layer whose input is measured), "
                                              f"got {entry['inp']!r}")


def _weight_specs(config: QuantHierarchy) -> list[tuple[str, QuantizationSpec]]:
    """The weight specs an algorithm restating them must agree with: the global one and each layer type's
    (layer-name entries are checked per layer when the algorithm runs)."""
    specs = [("global_quant_config.weight", config.global_quant_config.weight)]
    specs += [(f"layer_type_quant_config[{key!r}].weight", layer.weight)
              for key, layer in config.layer_type_quant_config.items()]
    return [(where, resolve_dtype(spec, where)) for where, spec in specs if spec is not None]


def _verify_restated_weight_spec(algo: AWQConfig | GPTQConfig, config: QuantHierarchy, path: str) -> None:
    """``bit``, ``sym`` and ``group_size`` restate the weight spec (the reference's fields; Quark 0.13 dropped
    them): ``None`` (the default) means "as the weight spec says"; a value the user sets must agree with it, and
    a contradiction names both fields.

    ``group_size=-1`` means no groups (AutoGPTQ's convention): per-channel or per-tensor weights.
    """
    what = type(algo).__name__
    uses_weights(config, path, what)
    for where, spec in _weight_specs(config):
        if spec.quant_type is not QuantType.int_quant:
            raise ConfigError(path, f"{what} quantizes weights to integers; {where} is {spec.quant_type.name}. "
                                    "Use an int weight spec (e.g. dtype uint4, per_group)")
        if spec.qscheme is QSchemeType.per_group and spec.scale_type is ScaleType.pof2:
            raise ConfigError(path, f"{what} does not support MX (per_group with pof2 scales) weights ({where}); "
                                    "use scale_type=float")
        if algo.bit is not None and algo.bit != spec.bit_width:
            raise ConfigError(f"{path}.bit", f"{algo.bit}, but {where} has bit_width {spec.bit_width}: {what}.bit "
                                             f"restates the weight spec; set bit={spec.bit_width} or leave it None")
        if algo.sym is not None and algo.sym != spec.symmetric:
            raise ConfigError(f"{path}.sym", f"{algo.sym}, but {where} has symmetric={spec.symmetric}: {what}.sym "
                                             f"restates the weight spec; set sym={spec.symmetric} or leave it None")
        grouped = spec.qscheme is QSchemeType.per_group
        if algo.group_size is None:
            continue
        if grouped and algo.group_size != spec.group_size:
            raise ConfigError(f"{path}.group_size", f"{algo.group_size}, but {where} is per_group with group_size "
                                                    f"{spec.group_size}; set group_size={spec.group_size} or leave "
                                                    "it None")
        if not grouped and algo.group_size != -1:
            raise ConfigError(f"{path}.group_size", f"{algo.group_size}, but {where} is {spec.qscheme.name} (no "
                                                    "groups); set group_size=-1 or leave it None, or use a per_group "
                                                    "weight spec")


def _verify_quark_weight_algorithm(algo: AWQConfig | GPTQConfig, config: QuantHierarchy, path: str) -> None:
    """What AWQConfig and GPTQConfig share: Quark's name, the restated weight spec, the embedding layer names."""
    verify_quark_name(algo, path)
    _verify_restated_weight_spec(algo, config, path)
    verify_names(algo.embedding_layers, f"{path}.embedding_layers")


def verify_names(names: list[str] | None, path: str) -> None:
    if names is not None and not all(isinstance(n, str) and n for n in names):
        raise ConfigError(path, f"must be a list of module names, got {names!r}")


@dataclass
class SmoothQuantConfig(PreQuantOptConfig):
    """SmoothQuant (Xiao et al.), Quark's ``SmoothQuantConfig``: per input channel j of each scaling group,
    ``s_j = max|X_j|^alpha / max|W_j|^(1 - alpha)`` (at least ``scale_clamp_min``) moves activation outliers
    into the weights. The scales are folded into the preceding norm or linear layer, so the quantized model
    (and its ONNX export) has no extra multiplication. Runs without FX tracing, on the float model.

    - ``name``: Quark's identifier of the algorithm, ``"smoothquant"`` (Quark 0.13's ``"smooth"`` is read as it).
    - ``alpha``: migration strength, 0 (none) to 1 (all of the activation range into the weights).
    - ``scale_clamp_min``: lower bound of the scales.
    - ``scaling_layers``: Quark's list of ``{"prev_op", "layers", "inp", "module2inspect"}`` (names relative to a
      decoder layer); ``None``: inferred for Llama, Mistral, Qwen2, OPT, GPT-2 and BERT (see ``plan``).
    - ``embedding_layers``: the modules before the first decoder layer (informational; ``None``: inferred).
    - ``model_decoder_layers``: the ModuleList of decoder layers (e.g. ``"model.layers"``); ``None``: inferred.
    """

    #: Quark 0.13 names it ``"smooth"`` (in its files and as ``SmoothQuantConfig.name``); read as this class.
    tag_aliases: ClassVar[tuple[str, ...]] = ("smooth",)
    name: str = "smoothquant"
    alpha: float = 1
    scale_clamp_min: float = 1e-3
    scaling_layers: list[dict[str, Any]] | None = None
    embedding_layers: list[str] | None = None
    model_decoder_layers: str | None = None

    def __post_init__(self) -> None:
        # Quark 0.13 code may spell the name its way; one spelling (ours, which files are written with) keeps a
        # config equal to the same config written the reference's way.
        if self.name in self.tag_aliases:
            self.name = "smoothquant"

    def verify(self, config: QuantHierarchy, path: str) -> None:
        super().verify(config, path)
        verify_quark_name(self, path)
        if not 0.0 <= self.alpha <= 1.0:
            raise ConfigError(f"{path}.alpha", f"must be in [0, 1], got {self.alpha}")
        if not self.scale_clamp_min > 0:
            raise ConfigError(f"{path}.scale_clamp_min", f"must be > 0, got {self.scale_clamp_min}")
        _verify_scaling_layers(self.scaling_layers, path)
        verify_names(self.embedding_layers, f"{path}.embedding_layers")


@dataclass
class AWQConfig(AlgoConfig):
    """AWQ (Lin et al.), Quark's ``AWQConfig``: per scaling group, a grid search over ``ratio`` in [0, 1) for the
    per-input-channel scales ``mean|X|^ratio`` that minimise the output error of the group's ``module2inspect`` (or
    of its layers) with quantized weights; the best scales are folded into the preceding norm or linear layer; then
    a search per weight group
    for the clipping range (the group maximum shrunk by up to 50 %) that minimises each layer's output error.
    Weight grids are Brevitas's own (the layer's weight quantizer).

    - ``name``: Quark's identifier of the algorithm, ``"awq"``.
    - ``bit`` / ``sym`` / ``group_size``: the reference's restatement of the weight spec (Quark 0.13 has no such
      fields): ``None`` (default): as the weight spec says; set, they must agree with it (``group_size=-1``:
      per-channel weights). Written to files only when set.
    - ``scaling_layers``: as in SmoothQuantConfig; ``None``: inferred.
    - ``model_decoder_layers``: the ModuleList of decoder layers; ``None``: inferred.
    - ``embedding_layers``: the modules before the first decoder layer (informational; ``None``: inferred).
    """

    effect: ClassVar[str] = "scaling"
    #: The reference's restated fields: written to files only when set (see serialization.OMITTED_WHEN_NONE).
    omitted_when_none: ClassVar[tuple[str, ...]] = ("bit", "sym", "group_size")
    name: str = "awq"
    bit: int | None = None
    sym: bool | None = None
    group_size: int | None = None
    scaling_layers: list[dict[str, Any]] | None = None
    model_decoder_layers: str | None = None
    embedding_layers: list[str] | None = None

    def verify(self, config: QuantHierarchy, path: str) -> None:
        super().verify(config, path)
        _verify_quark_weight_algorithm(self, config, path)
        _verify_scaling_layers(self.scaling_layers, path)


@dataclass
class GPTQConfig(AlgoConfig):
    """GPTQ (Frantar et al.), Quark's ``GPTQConfig``: per decoder layer, the Hessians of a group of layers are
    collected in one pass over the layer's inputs, then each weight is rounded column by column onto its
    Brevitas grid while the rounding error is compensated on the remaining columns (blocked, vectorised
    update).

    - ``name``: Quark's identifier of the algorithm, ``"gptq"``.
    - ``bit`` / ``sym`` / ``group_size``: as in AWQConfig (``None``: as the weight spec says).
    - ``damp_percent``: the dampening added to the Hessian's diagonal, as a fraction of its mean.
    - ``desc_act``: process the columns by decreasing Hessian diagonal (act order).
    - ``static_groups``: per-group scales from the weights before GPTQ (True, Quark 0.13's default), or from the
      error-updated weights when GPTQ reaches a group's first column (False, the reference's and AutoGPTQ's
      default, kept here so that reference code means what it meant).
    - ``true_sequential``: within a decoder layer, quantize the groups of layers that read the same input (q/k/v,
      o, gate/up, down) one after the other, each seeing the previous groups quantized; False: one pass.
    - ``inside_layer_modules``: the layers of a decoder layer to run GPTQ on (names relative to it); ``None``:
      every quantized Linear of the decoder layer.
    - ``model_decoder_layers``: the ModuleList of decoder layers; ``None``: inferred (a model without decoder
      layers is treated as one).
    - ``embedding_layers``: the modules before the first decoder layer (informational; ``None``: inferred).
    - ``block_size``: Quark 0.13's column block of the update (lazy batch): columns rounded with rank-1 updates
      before one matrix product updates the rest. It changes speed and memory, not the result (up to float
      rounding).
    - ``magr_alpha``: MagR before rounding (not Quark's; :mod:`quark_brevitas.algorithms.magr`): each layer's
      weight first has the maximum magnitude of every quantization group reduced, keeping the layer's output on
      the calibration inputs, so the scales (from the group maxima) get finer; the value weights the
      l-infinity term relative to the mean input energy (e.g. 1e-3). ``None`` (the default): off -- measured
      on the real MiniLM in ``benchmarks/llm_lowbit.py`` (README, LLMs).
    """

    omitted_when_none: ClassVar[tuple[str, ...]] = ("bit", "sym", "group_size", "magr_alpha")
    name: str = "gptq"
    bit: int | None = None
    sym: bool | None = None
    group_size: int | None = None
    damp_percent: float = 0.01
    desc_act: bool = True
    static_groups: bool = False
    true_sequential: bool = True
    inside_layer_modules: list[str] | None = None
    model_decoder_layers: str | None = None
    embedding_layers: list[str] | None = None
    block_size: int = 128
    magr_alpha: float | None = None

    def verify(self, config: QuantHierarchy, path: str) -> None:
        super().verify(config, path)
        _verify_quark_weight_algorithm(self, config, path)
        if self.magr_alpha is not None and not self.magr_alpha > 0:
            raise ConfigError(f"{path}.magr_alpha", f"must be > 0 (e.g. 1e-3) or None (MagR off), got "
                                                    f"{self.magr_alpha}")
        if self.block_size < 1:
            raise ConfigError(f"{path}.block_size", f"must be >= 1 (columns per block of the update, e.g. 128), "
                                                    f"got {self.block_size}")
        if not 0.0 < self.damp_percent < 1.0:
            raise ConfigError(f"{path}.damp_percent", f"must be in (0, 1), got {self.damp_percent}")
        verify_names(self.inside_layer_modules, f"{path}.inside_layer_modules")


def registered(base: type) -> list[type]:
    """All concrete algorithm classes deriving from ``base`` (for messages and deserialisation)."""
    found: list[type] = []
    stack = list(base.__subclasses__())
    while stack:
        cls = stack.pop()
        stack.extend(cls.__subclasses__())
        if cls not in (PreQuantOptConfig, AlgoConfig):
            found.append(cls)
    return found


__all__ = [
    "EFFECTS",
    "EFFECT_ORDER",
    "SCALING_LAYER_KEYS",
    "AWQConfig",
    "ActivationEqualization",
    "AlgoConfig",
    "BiasCorrection",
    "CalibrateBatchNorm",
    "GPFA2Q",
    "GPFQ",
    "GPTQ",
    "GPTQConfig",
    "AlgorithmConfig",
    "PreQuantOptConfig",
    "Preprocess",
    "SmoothQuantConfig",
    "registered",
]
