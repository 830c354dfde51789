"""Quark 0.13's ``RotationConfig`` (Hadamard rotations, QuaRot / SpinQuant), as data.

Beside :mod:`quark_brevitas.config.algorithms` (the other algorithm configs), whose base classes it extends; its
handler is :mod:`quark_brevitas.algorithms.rotation` and its structure inference
:mod:`quark_brevitas.algorithms.rotation_sites`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from quark_brevitas.config.algorithms import PreQuantOptConfig
from quark_brevitas.config.specs import QuantHierarchy
from quark_brevitas.errors import ConfigError

__all__ = ["ROTATION_SITE_KEYS", "ROTATION_UNSUPPORTED", "RotationConfig"]

#: Quark's ``RotationConfig.scaling_layers``: its parts and the keys of one entry.
ROTATION_SITE_KEYS = {"parts": ("first_layer", "middle_layers", "last_layer"),
                      "entry": ("prev_modules", "norm_module", "next_modules", "target_modules")}


def _verify_rotation_sites(sites: dict[str, list[dict[str, Any]]] | None, path: str) -> None:
    """Quark's R1 sites: ``{"first_layer" | "middle_layers" | "last_layer": [{"prev_modules": [...], "norm_module":
    ..., "next_modules": [...], "target_modules": [...]}]}``, qualified names with ``layer_id`` / ``pre_layer_id``
    standing for a decoder layer's index (the names are checked against the model when it runs)."""
    if sites is None:
        return
    for part in sites:
        if part not in ROTATION_SITE_KEYS["parts"]:
            raise ConfigError(f"{path}.{part}", f"unknown part; allowed: {list(ROTATION_SITE_KEYS['parts'])}")
    for part, entries in sites.items():
        for index, entry in enumerate(entries):
            where = f"{path}.{part}[{index}]"
            unknown = sorted(set(entry) - set(ROTATION_SITE_KEYS["entry"]))
            if unknown:
                raise ConfigError(f"{where}.{unknown[0]}", f"unknown key; allowed: {list(ROTATION_SITE_KEYS['entry'])}")
            for key in ("prev_modules", "next_modules", "target_modules"):
                names = entry.get(key)
                if names is not None and not (isinstance(names, list) and all(isinstance(n, str) and n for n in names)):
                    raise ConfigError(f"{where}.{key}", f"must be a list of module names, got {names!r}")
            norm = entry.get("norm_module")
            if norm is not None and not (isinstance(norm, str) and norm):
                raise ConfigError(f"{where}.norm_module", f"must be a module name, got {norm!r}")


#: RotationConfig's fields that Quark 0.13 has and this library does not run, with why and what to set instead.
ROTATION_UNSUPPORTED: dict[str, tuple[Any, str]] = {
    "r3": (False, "R3 (the online rotation of queries and keys) only helps KV-cache quantization, which this "
                  "library does not do; set r3=False"),
    "online_config": (None, "online rotations here are fixed Hadamard matrices (Quark's OnlineRotationConfig options "
                            "are not supported); set None"),
    "trainable": (False, "trainable (SpinQuant/OSTQuant-learned) rotations are not supported; set trainable=False"),
    "train_smooth": (None, "trained smoothing scales need trainable rotations, which are not supported; set None"),
    "smooth_positions": (None, "trained smoothing scales need trainable rotations, which are not supported; set None"),
}


@dataclass
class RotationConfig(PreQuantOptConfig):
    """Hadamard rotations (QuaRot / SpinQuant with Hadamard matrices), Quark's ``RotationConfig``: an orthogonal
    change of basis folded into the float weights spreads activation and weight outliers over all channels, so
    low-bit quantizers lose less. Data-free; it runs first, on the whole float model, before any other algorithm.

    - ``name``: Quark's identifier of the algorithm, ``"rotation"``.
    - ``r1``: rotate the residual stream: folded into the embeddings, the layers that read it after each RMSNorm
      (the norm's weight merged into them first, then set to 1), the layers that write into it (o/down projections)
      and the head (untied from the embedding if tied). Pre-norm RMSNorm decoders only (Llama, Mistral, Qwen2);
      elsewhere (post-norm BERT, LayerNorm models) it is skipped and ``plan`` says why.
    - ``online_r1_rotation``: R1 as online Hadamards on the inputs of the layers that read each norm (q/k/v and
      gate/up; BERT's query/key/value and intermediate), their inverse folded into those layers: exact in any
      family, BERT included (``None``/``False``: folded).
    - ``r2``: rotate each attention head's values: folded into v_proj's outputs and o_proj's inputs, per head.
    - ``online_r2_rotation`` (not Quark's): R2 as one online Hadamard on o_proj's whole input (all heads together,
      ``rotation_size`` blocks if set), its inverse folded into o_proj, instead of per head: exact in any family,
      and it spreads outliers across heads too (with int8 per-token activations on MiniLM it brings rotation's
      error to 0.49x of no rotation, against 0.52x per head; ``benchmarks/llm_lowbit.py``). ``None``: folded.
    - ``r4``: an online Hadamard on the down projection's input (a module in the model, which its activation
      quantizer sees rotated and ONNX exports as MatMul nodes), its inverse folded into the down projection.
    - ``rotation_size``: block-diagonal rotations of this size instead of the full width (``None``: full width);
      it must divide the widths rotated. Hadamard sizes are ``K * 2**m``, K in 1, 12, 20, 28, ... (Brevitas's).
    - ``random_r1`` / ``random_r2``: randomised Hadamard matrices (random signs, fixed seed) for R1 / R2.
    - ``scaling_layers``: Quark's explicit R1 sites (``first_layer``/``middle_layers``/``last_layer`` entries of
      ``prev_modules``, ``norm_module``, ``next_modules``, ``target_modules``, names with ``layer_id``); ``None``
      (here the default): inferred from the model.
    - ``backbone`` / ``model_decoder_layers`` / ``v_proj`` / ``o_proj`` / ``self_attn`` / ``mlp``: Quark's paths;
      ``None``: inferred from the model's family. Given, they must exist.
    - ``r3``, ``online_config``, ``trainable``, ``train_smooth``, ``smooth_positions``:
      Quark's; only their "off" values are accepted (see :data:`ROTATION_UNSUPPORTED`).
    """

    effect: ClassVar[str] = "rotation"
    needs_data: ClassVar[bool] = False
    omitted_when_none: ClassVar[tuple[str, ...]] = ("online_r2_rotation",)
    name: str = "rotation"
    r1: bool = True
    r2: bool = False
    r3: bool = False
    r4: bool = False
    rotation_size: int | None = None
    random_r1: bool = False
    random_r2: bool = False
    scaling_layers: dict[str, list[dict[str, Any]]] | None = None
    backbone: str | None = None
    model_decoder_layers: str | None = None
    v_proj: str | None = None
    o_proj: str | None = None
    self_attn: str | None = None
    mlp: str | None = None
    online_r1_rotation: bool | None = None
    online_config: dict[str, Any] | None = None
    trainable: bool = False
    train_smooth: bool | None = None
    smooth_positions: list[str] | None = None
    online_r2_rotation: bool | None = None

    def verify(self, config: QuantHierarchy, path: str) -> None:
        super().verify(config, path)
        if self.name != "rotation":
            raise ConfigError(f"{path}.name", f"must be 'rotation' (Quark identifies RotationConfig by its name), "
                                              f"got {self.name!r}")
        if self.online_r1_rotation is not None and not self.r1:
            raise ConfigError(f"{path}.online_r1_rotation", f"{self.online_r1_rotation!r} has no effect with "
                                                            "r1=False; leave it None")
        if self.online_r2_rotation is not None and not self.r2:
            raise ConfigError(f"{path}.online_r2_rotation", f"{self.online_r2_rotation!r} has no effect with "
                                                            "r2=False; leave it None")
        if self.online_r2_rotation and self.random_r2:
            raise ConfigError(f"{path}.random_r2", "online R2 rotations are Hadamard matrices (rebuilt from their size "
                                                   "when a checkpoint loads); set random_r2=False or "
                                                   "online_r2_rotation=None")
        for field_name, (allowed, why) in ROTATION_UNSUPPORTED.items():
            value = getattr(self, field_name)
            if value != allowed:
                raise ConfigError(f"{path}.{field_name}", f"{value!r} is not supported: {why}")
        if self.online_r1_rotation and self.random_r1:
            raise ConfigError(f"{path}.random_r1", "online R1 rotations are Hadamard matrices (rebuilt from their size "
                                                   "when a checkpoint loads); set random_r1=False or "
                                                   "online_r1_rotation=False")
        if not (self.r1 or self.r2 or self.r4):
            raise ConfigError(path, "applies no rotation: set at least one of r1, r2, r4")
        if self.rotation_size is not None and self.rotation_size < 2:
            raise ConfigError(f"{path}.rotation_size", "must be None (full width) or a Hadamard size >= 2 that "
                                                       f"divides the rotated widths (e.g. 64), got "
                                                       f"{self.rotation_size}")
        _verify_rotation_sites(self.scaling_layers, f"{path}.scaling_layers")
        for field_name in ("backbone", "model_decoder_layers", "v_proj", "o_proj", "self_attn", "mlp"):
            value = getattr(self, field_name)
            if value is not None and not (isinstance(value, str) and value):
                raise ConfigError(f"{path}.{field_name}", f"must be a module path or None (inferred), got {value!r}")
