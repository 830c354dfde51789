"""Quark 0.13's low-bit rounding algorithms beyond GPTQ, as data: ``QronosConfig`` and ``AutoRoundConfig``.

Both round the weights of each decoder layer (block) onto the layer's own Brevitas grid, one block at a time, like
:class:`~quark_brevitas.config.algorithms.GPTQConfig`, so at most one of the three may stand in ``algo_config`` (see
:mod:`quark_brevitas.config.checks`). Names, fields and defaults are Quark 0.13's
(``quark.torch.quantization.config.config``); what running them does is in :mod:`quark_brevitas.algorithms.qronos`
and :mod:`quark_brevitas.algorithms.autoround`. Plain data: nothing here imports torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from quark_brevitas.config.algorithms import AlgoConfig, uses_weights, verify_names, verify_quark_name
from quark_brevitas.config.families import Family
from quark_brevitas.config.specs import QuantHierarchy, QuantizationSpec
from quark_brevitas.config.template import register_template_algorithm
from quark_brevitas.errors import ConfigError

__all__ = ["CLIP_INITS", "AutoRoundConfig", "QronosConfig"]

#: ``AutoRoundConfig.clip_init``'s values: ``None`` (factors start at 1, Quark's) or ``"mse"`` (searched per group).
CLIP_INITS = (None, "mse")


def _verify_block_fields(algo: QronosConfig | AutoRoundConfig, config: QuantHierarchy, path: str) -> None:
    """What both share with GPTQConfig: Quark's name, weight quantization, layer names relative to a block."""
    verify_quark_name(algo, path)
    uses_weights(config, path, type(algo).__name__)
    verify_names(algo.inside_layer_modules, f"{path}.inside_layer_modules")
    if algo.model_decoder_layers is not None and not (isinstance(algo.model_decoder_layers, str)
                                                      and algo.model_decoder_layers):
        raise ConfigError(f"{path}.model_decoder_layers", "must be the name of the ModuleList of decoder layers "
                                                          f"(e.g. 'model.layers') or None, got "
                                                          f"{algo.model_decoder_layers!r}")


@dataclass
class QronosConfig(AlgoConfig):
    """Qronos (Zhang et al., "Qronos: Correcting the Past by Shaping the Future in Post-Training Quantization",
    arXiv 2505.11695; Brevitas 0.13's ``brevitas.graph.qronos.Qronos``), Quark's ``QronosConfig``: per layer,
    find integer weights ``Q`` minimising ``||X_f W^T - X_q Q^T||``, where ``X_f`` is the layer's input in the
    float block and ``X_q`` its input with the block's earlier layers already quantized. The first column is
    rounded from the float-weight target that corrects the input error; the remaining columns are re-solved in
    closed form for it, then rounded GPTQ-style.

    - ``name``: Quark's identifier, ``"qronos"``.
    - ``block_size``: columns per block of the error-diffusion update (speed and memory, not the result).
    - ``desc_act``: process the columns by decreasing diagonal of ``X_q^T X_q`` (act order).
    - ``static_groups``: per-group scales from the weights before Qronos (True); False: from the updated weights
      when a group's first column is reached (Quark rejects it together with ``desc_act``; so does this).
    - ``alpha``: dampening, a fraction of ``X_q^T X_q``'s largest eigenvalue added to its diagonal.
    - ``beta``: the factor that stabilises the Cholesky factor of the inverse (mathematically neutral).
    - ``inside_layer_modules`` / ``model_decoder_layers``: as in GPTQConfig (``None``: inferred).
    """

    name: str = "qronos"
    block_size: int = 128
    desc_act: bool = True
    static_groups: bool = True
    alpha: float = 1e-3
    beta: float = 1e4
    inside_layer_modules: list[str] | None = None
    model_decoder_layers: str | None = None

    def verify(self, config: QuantHierarchy, path: str) -> None:
        super().verify(config, path)
        _verify_block_fields(self, config, path)
        if self.block_size < 1:
            raise ConfigError(f"{path}.block_size", f"must be >= 1 (columns per block of the update, e.g. 128), "
                                                    f"got {self.block_size}")
        if self.desc_act and not self.static_groups:
            raise ConfigError(f"{path}.static_groups", "must be True when desc_act is True (as in Quark: groups "
                                                       "met out of order cannot take their scale when first reached)")
        if not 0.0 < self.alpha < 1.0:
            raise ConfigError(f"{path}.alpha", f"must be in (0, 1) (a fraction of the largest eigenvalue), got "
                                               f"{self.alpha}")
        if not self.beta >= 1.0:
            raise ConfigError(f"{path}.beta", f"must be >= 1 (e.g. 1e4), got {self.beta}")


@dataclass
class AutoRoundConfig(AlgoConfig):
    """AutoRound (Cheng et al., "Optimize Weight Rounding via Signed Gradient Descent for the Quantization of
    LLMs", arXiv 2309.05516), Quark's ``AutoRoundConfig``: per decoder layer, learn a rounding offset in
    [-0.5, 0.5] for every weight (and, with ``enable_minmax_tuning``, a clipping factor in [0.5, 1] for the
    minimum and the maximum of every weight group) by signed gradient descent, minimising the mean squared error
    between the quantized block's output and the float block's output on the same inputs; the weights are then
    rounded with the learned offsets onto the layer's Brevitas grid.

    - ``name``: Quark's identifier, ``"autoround"``.
    - ``iters``: optimisation steps per block (0: round to nearest, exactly).
    - ``lr`` / ``minmax_lr``: step sizes of the offsets and of the clipping factors (decayed linearly to 0).
    - ``enable_minmax_tuning``: also learn the clipping factors.
    - ``batch_size``: calibration sequences per step (taken in turn from the block's cached inputs).
    - ``inside_layer_modules`` / ``model_decoder_layers``: as in GPTQConfig (``None``: inferred).
    - ``clip_init`` (not Quark's): where the clipping factors start. ``None`` (Quark's): at 1 (the min-max grid);
      ``"mse"``: at each group's factor in [0.5, 1] with the least squared rounding error of its weights (a grid
      search), so training starts from MSE-clipped rounding, which at 2-3 bits is far closer than min-max (measured
      in ``benchmarks/llm_lowbit.py``). Needs ``enable_minmax_tuning``.
    """

    omitted_when_none: ClassVar[tuple[str, ...]] = ("clip_init",)
    name: str = "autoround"
    iters: int = 200
    lr: float = 1.0 / 200
    enable_minmax_tuning: bool = True
    minmax_lr: float = 1.0 / 200
    batch_size: int = 8
    inside_layer_modules: list[str] | None = None
    model_decoder_layers: str | None = None
    clip_init: str | None = None

    def verify(self, config: QuantHierarchy, path: str) -> None:
        super().verify(config, path)
        _verify_block_fields(self, config, path)
        if self.clip_init not in CLIP_INITS:
            raise ConfigError(f"{path}.clip_init", f"must be one of {list(CLIP_INITS)}, got {self.clip_init!r}")
        if self.clip_init is not None and not self.enable_minmax_tuning:
            raise ConfigError(f"{path}.clip_init", f"{self.clip_init!r} needs enable_minmax_tuning=True (there are "
                                                   "no clipping factors to start otherwise); leave it None")
        if self.iters < 0:
            raise ConfigError(f"{path}.iters", f"must be >= 0 (0: round to nearest), got {self.iters}")
        for field_name in ("lr", "minmax_lr"):
            if not getattr(self, field_name) > 0:
                raise ConfigError(f"{path}.{field_name}", f"must be > 0 (e.g. 1/iters), got "
                                                          f"{getattr(self, field_name)}")
        if self.batch_size < 1:
            raise ConfigError(f"{path}.batch_size", f"must be >= 1 (sequences per step), got {self.batch_size}")


def _qronos(_family: Family | None, _weight: QuantizationSpec | None) -> QronosConfig:
    """The template's ``algorithm="qronos"``: Quark 0.13's defaults, layers inferred per decoder layer."""
    return QronosConfig()


def _autoround(_family: Family | None, _weight: QuantizationSpec | None) -> AutoRoundConfig:
    """The template's ``algorithm="autoround"``: Quark 0.13's defaults, layers inferred per decoder layer."""
    return AutoRoundConfig()


register_template_algorithm("qronos", _qronos)
register_template_algorithm("autoround", _autoround)
