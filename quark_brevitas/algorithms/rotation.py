"""Hadamard rotations (Quark's ``RotationConfig``), folded into the float weights before quantization.

With ``Q`` orthonormal (``Q @ Q.T == I``) a linear layer computes the same function on a rotated input if its
weight is rotated too: ``(x @ Q) @ (W @ Q).T == x @ W.T``. Rows are vectors here (``x @ Q``):

- R1 rotates the residual stream ``h -> h @ Q``: the token embedding ``E -> E @ Q``; the layers that write into the
  stream ``W -> Q.T @ W`` (and their bias ``b -> b @ Q``); each RMSNorm's weight is merged into the layers reading
  its output (``W -> W * g``) and set to 1, so the norm commutes with ``Q`` (``rms(h @ Q) == rms(h)``), and those
  layers get ``W -> W @ Q``; the head after the final norm too (untied from the embedding first).
- R2 rotates each attention head's values ``v_h -> v_h @ H``: v_proj's rows of head ``h`` ``-> H.T @ W_h`` (bias
  ``b_h @ H``), o_proj's columns of head ``h`` ``-> W_h @ H``; attention mixes tokens, not channels, so it commutes.
- Online R1 (``online_r1_rotation``) puts an online Hadamard before each layer reading a norm instead (exact in any
  family, post-norm BERT included), with its inverse folded into the layer.
- Online R2 (``online_r2_rotation``) likewise puts one online Hadamard before o_proj (all heads at once) instead of
  folding R2 per head into v/o.
- R4 puts an online Hadamard (:class:`~quark_brevitas.brevitas_adapter.OnlineHadamard`, a module in the model that
  its input quantizer sees rotated and that exports as MatMul nodes) before the down projection, whose weight gets
  ``W -> W @ H``.

The handler is data-free: the pipeline runs it on the whole float model first (also before a block-by-block data
phase), and loading a checkpoint replays it (the wrappers and untied head come back; the state dict fills the
values). A model streamed from its folder (``quantize_pretrained``), whose blocks are not in memory, is rotated in
two parts (:meth:`RotationHandler.apply_streamed`): the embedding, final norm and head at once, each block when the
engine loads it, before its other algorithms; a streamed checkpoint replays the structure the same way. Matrices
are computed in float64, once per model, and the weights rounded back to their dtype once per fold: both ways give
the same weights bit for bit.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from quark_brevitas.algorithms.base import AlgorithmHandler, BlockStep, register
from quark_brevitas.algorithms.rotation_sites import RotationSites, rotation_sites
from quark_brevitas.brevitas_adapter import OnlineHadamard, RotatedInput, hadamard_supported, rotation_matrix
from quark_brevitas.calibration.data import CalibrationData
from quark_brevitas.config.rotation import RotationConfig
from quark_brevitas.errors import ConfigError

logger = logging.getLogger(__name__)

__all__ = ["RotationHandler", "rotation_block"]

#: Seeds of the randomised Hadamard matrices (fixed: a run is reproducible and a checkpoint's replay matches).
_SEEDS = {"r1": 0, "r2": 1}


def rotation_block(width: int, rotation_size: int | None, path: str) -> int | None:
    """The block size of a rotation of ``width`` channels (``None``: the full width), checked: a Hadamard matrix
    of that size must exist and divide ``width``."""
    block = rotation_size if rotation_size is not None and rotation_size < width else None
    size = width if block is None else block
    if width % size:
        raise ConfigError(f"{path}.rotation_size", f"{rotation_size} does not divide the rotated width {width}; "
                                                   "use a divisor of it (e.g. a power of two)")
    if not hadamard_supported(size):
        hint = ("set rotation_size to a power of two dividing it" if rotation_size is None
                else "use a power of two")
        raise ConfigError(f"{path}.rotation_size" if block else path,
                          f"no Hadamard matrix of size {size} (width {width}): sizes are K * 2**m with K in 1, 12, "
                          f"20, 28, 36, 40, 52, 60, 108, 140, 152, 156, 172; {hint}")
    return block


def _matrix(width: int, algo: Any, key: str, path: str) -> torch.Tensor:
    random = bool(getattr(algo, f"random_{key}", False))
    generator = torch.Generator().manual_seed(_SEEDS[key]) if random else None
    return rotation_matrix(width, rotation_block(width, algo.rotation_size, path), random=random, generator=generator)


def _set(tensor: torch.Tensor, value: torch.Tensor) -> None:
    tensor.copy_(value.to(tensor.dtype))


def _rotate_input(layer: nn.Linear, q: torch.Tensor, scale: torch.Tensor | None = None) -> None:
    """``W -> (W * scale) @ Q`` (a reader of the rotated stream; ``scale``: a norm weight merged first)."""
    weight = layer.weight.double()
    if scale is not None:
        weight = weight * scale.double()
    _set(layer.weight.data, weight @ q.to(weight.device))


def _rotate_output(layer: nn.Linear, q: torch.Tensor) -> None:
    """``W -> Q.T @ W``, ``b -> b @ Q`` (a writer into the rotated stream)."""
    q = q.to(layer.weight.device)
    _set(layer.weight.data, q.T @ layer.weight.double())
    if layer.bias is not None:
        _set(layer.bias.data, layer.bias.double() @ q)


def _untie_head(model: nn.Module, head: nn.Linear, embedding: nn.Embedding) -> None:
    """Give the head its own weight when it shares the embedding's (the merged final norm makes them differ), and
    say so in the model's config (a streamed checkpoint rebuilds its model from that config)."""
    if head.weight is not embedding.weight:
        return
    head.weight = nn.Parameter(head.weight.detach().clone(), requires_grad=head.weight.requires_grad)
    config = getattr(model, "config", None)
    if config is not None and getattr(config, "tie_word_embeddings", False):
        config.tie_word_embeddings = False
    logger.info("RotationConfig: the head untied from the embedding (R1 folds the final norm into it)")


def _merge_and_rotate(owner: nn.Module, norm_name: str, readers: tuple[str, ...], q: torch.Tensor) -> None:
    norm = owner.get_submodule(norm_name)
    gamma = norm.weight.detach().clone()
    for name in readers:
        _rotate_input(owner.get_submodule(name), q, gamma)
    norm.weight.data.fill_(1.0)


def _apply_r2(block: nn.Module, sites: RotationSites, h: torch.Tensor) -> None:
    d = sites.head_dim
    v, o = block.get_submodule(sites.roles.v_proj), block.get_submodule(sites.roles.o_proj)
    hv = h.to(v.weight.device)
    weight = v.weight.double().reshape(-1, d, v.in_features)
    _set(v.weight.data, (hv.T @ weight).reshape(v.weight.shape))
    if v.bias is not None:
        _set(v.bias.data, (v.bias.double().reshape(-1, d) @ hv).reshape(-1))
    weight = o.weight.double().reshape(o.out_features, -1, d)
    _set(o.weight.data, (weight @ h.to(o.weight.device)).reshape(o.weight.shape))


def _put_online(block: nn.Module, name: str, rotation_size: int | None, path: str, values: bool) -> None:
    """Put layer ``name`` of ``block`` behind an online Hadamard of its input and fold the inverse into it (only
    the wrapper when not ``values``: a checkpoint's tensors fill the layer)."""
    parent_name, _, attribute = name.rpartition(".")
    parent = block.get_submodule(parent_name) if parent_name else block
    layer = getattr(parent, attribute)
    width = layer.in_features
    online = OnlineHadamard(width, rotation_block(width, rotation_size, path)).to(layer.weight.device)
    if values:
        _rotate_input(layer, online.matrix())
    setattr(parent, attribute, RotatedInput(online, layer))


@dataclass(frozen=True)
class _Rotations:
    """The rotations one model takes, its matrices computed once: the whole model applies them to every block
    at once, a streamed model to each block as it loads (the same float64 products on the same values either way,
    so both give the same weights bit for bit)."""

    sites: RotationSites
    path: str
    rotation_size: int | None
    r1: bool  # folded R1
    r2: bool
    online: tuple[str, ...]  # layers of a block put behind online Hadamards (online R1's readers, R4's down_proj)
    #: The matrices of folded R1 and R2 (``None`` where not folded, or when only the structure is rebuilt).
    matrices: dict[str, torch.Tensor | None]

    def outside(self, model: nn.Module, values: bool = True) -> None:
        """R1's part outside the blocks: the embedding, the final norm merged into the head (untied first)."""
        if not self.r1:
            return
        sites = self.sites
        embedding = model.get_submodule(sites.embeddings[0])
        for head in sites.final.readers:
            _untie_head(model, model.get_submodule(head), embedding)
        if values:
            q = self.matrices["r1"]
            _set(embedding.weight.data, embedding.weight.double() @ q.to(embedding.weight.device))
            _merge_and_rotate(model, sites.final.norm, sites.final.readers, q)

    def block(self, block: nn.Module, values: bool = True) -> nn.Module:
        """One block: R1 (its norms merged into their readers, its writers), R2, then the online Hadamards (R2
        rewrites v_proj in place before a wrapper could hide it)."""
        if values and self.r1:
            for group in self.sites.block_norms:
                _merge_and_rotate(block, group.norm, group.readers, self.matrices["r1"])
            for writer in self.sites.roles.writers:
                _rotate_output(block.get_submodule(writer), self.matrices["r1"])
        if values and self.r2:
            _apply_r2(block, self.sites, self.matrices["r2"])
        for name in self.online:
            _put_online(block, name, self.rotation_size, self.path, values)
        return block


def _rotations(algo: Any, model: nn.Module, path: str, values: bool = True) -> _Rotations:
    """The sites of ``model`` (warning about the rotations that cannot run there) and, with ``values``, the
    matrices."""
    sites = rotation_sites(algo, model, path)
    for key, why in sites.skipped.items():
        logger.warning("RotationConfig: %s not applied to %s: %s", key.upper(), type(model).__name__, why)
    r1 = bool(algo.r1) and "r1" not in sites.skipped
    r2 = bool(algo.r2) and "r2" not in sites.skipped
    online_r2 = r2 and algo.online_r2_rotation
    online = (*((sites.roles.o_proj,) if online_r2 else ()), *(sites.roles.readers if r1 and sites.online_r1 else ()),
              *((sites.roles.down_proj,) if algo.r4 else ()))
    folded_r1, folded_r2 = r1 and not sites.online_r1, r2 and not online_r2
    matrices = {"r1": _matrix(sites.hidden, algo, "r1", path) if folded_r1 and values else None,
                "r2": _matrix(sites.head_dim, algo, "r2", path) if folded_r2 and values else None}
    return _Rotations(sites, path, algo.rotation_size, r1=folded_r1, r2=folded_r2, online=online, matrices=matrices)


def _require_values(model: nn.Module, path: str, skip: str | None = None) -> None:
    """Folding needs the weights' values: a model whose blocks are still to be loaded is rotated block by block as
    they load (:meth:`RotationHandler.apply_streamed`, which ``quantize_pretrained`` uses), not all at once."""
    inside = f"{skip}." if skip else None
    missing = [n for n, p in model.named_parameters() if p.is_meta and not (inside and n.startswith(inside))]
    if missing:
        raise ConfigError(path, f"cannot rotate a model whose weights are not loaded ({missing[0]} is on the meta "
                                "device): load the model, or stream it from its folder with quantize_pretrained, "
                                "which rotates each block as it loads")


@register(RotationConfig)
class RotationHandler(AlgorithmHandler):
    """Folds R1/R2 into the weights and puts R4's online Hadamards in place; see the module docstring."""

    def check(self, algo: Any, path: str) -> None:
        if algo.rotation_size is not None and not hadamard_supported(algo.rotation_size):
            raise ConfigError(f"{path}.rotation_size", f"no Hadamard matrix of size {algo.rotation_size}: sizes are "
                                                       "K * 2**m with K in 1, 12, 20, 28, 36, 40, 52, 60, 108, 140, "
                                                       "152, 156, 172 (e.g. 32, 64, 128)")

    def apply(self, algo: Any, model: nn.Module, data: CalibrationData | None) -> nn.Module:
        path = type(algo).__name__
        _require_values(model, path)
        rotations = _rotations(algo, model, path)
        model.eval()
        with torch.no_grad():
            rotations.outside(model)
            for name in rotations.sites.blocks:
                rotations.block(model.get_submodule(name))
        return model

    def apply_streamed(self, algo: Any, model: nn.Module, stack: str, *,
                       values: bool = True) -> tuple[nn.Module, BlockStep | None]:
        """The embedding, final norm and head now; each block as it loads (same values as :meth:`apply`)."""
        path = type(algo).__name__
        if values:
            _require_values(model, path, skip=stack)
        rotations = _rotations(algo, model, path, values)
        if rotations.sites.structure.decoder_layers != stack:
            raise ConfigError(f"{path}.model_decoder_layers", f"the rotation's decoder layers "
                                                              f"({rotations.sites.structure.decoder_layers}) are not "
                                                              f"the streamed block stack {stack!r}; name the same one")
        model.eval()
        with torch.no_grad():
            rotations.outside(model, values)

        def step(block: nn.Module, name: str) -> nn.Module:
            logger.debug("RotationConfig: rotating %s", name)
            with torch.no_grad():
                return rotations.block(block.eval(), values)

        return model, step

    def describe(self, algo: Any, model: nn.Module) -> list[str]:
        path = type(algo).__name__
        sites = rotation_sites(algo, model, path)
        size = f"blocks of {algo.rotation_size}" if algo.rotation_size else "full width"
        lines = [f"decoder layers: {sites.structure.decoder_layers} ({len(sites.blocks)} blocks)"]
        if algo.r1 and "r1" not in sites.skipped and sites.online_r1:
            lines.append(f"R1 (online): Hadamard ({size}) on the inputs of {', '.join(sites.roles.readers)}, its "
                         "inverse folded into each (each layer moves to <name>.layer behind it)")
        elif algo.r1 and "r1" not in sites.skipped:
            rotation_block(sites.hidden, algo.rotation_size, path)
            lines.append(f"R1: residual stream ({sites.hidden} channels, {'random ' if algo.random_r1 else ''}"
                         f"Hadamard, {size}) folded into {', '.join(sites.embeddings)}, "
                         f"{sites.final.norm} -> {', '.join(sites.final.readers)} (untied if tied) and per block:")
            lines += [f"  {g.norm} (weight merged, set to 1) -> {', '.join(g.readers)}" for g in sites.block_norms]
            lines.append(f"  writers: {', '.join(sites.roles.writers)}")
        if algo.r2 and "r2" not in sites.skipped and algo.online_r2_rotation:
            lines.append(f"R2 (online): Hadamard ({size}) on the input of {sites.roles.o_proj} (all heads together; "
                         f"the layer moves to {sites.roles.o_proj}.layer behind it), its inverse folded into it")
        elif algo.r2 and "r2" not in sites.skipped:
            lines.append(f"R2: per head ({sites.head_dim} channels, {'random ' if algo.random_r2 else ''}Hadamard) "
                         f"folded into {sites.roles.v_proj} (outputs) and {sites.roles.o_proj} (inputs)")
        if algo.r4:
            lines.append(f"R4: online Hadamard ({size}) on {sites.roles.down_proj}'s input (the layer moves to "
                         f"{sites.roles.down_proj}.layer behind it), its inverse folded into the weight")
        lines += [f"{key.upper()}: not applied: {why}" for key, why in sites.skipped.items()]
        return lines
