"""Where a transformer takes Hadamard rotations (RotationConfig), inferred from its modules.

The family table (:class:`~quark_brevitas.config.families.RotationRoles`) names the roles in a block (value and
output projections, the down projection, the layers that write into the residual stream); the scaling groups of
:mod:`quark_brevitas.algorithms.structure` give the norms and the layers that read their output. What is exact in one
model is decided here, with a reason for each rotation that is not:

- R1 (the residual stream) needs every norm on it to be an RMSNorm (``norm(x @ Q) == norm(x) @ Q`` once its weight
  is merged into the layers after it, checked numerically on each norm class), a final norm, and an output head
  to fold the inverse into (a model without a head would return rotated hidden states);
- R2 (per attention head) needs the head size and v/o widths that are multiples of it;
- R4 and online R1 (Hadamards on Linear inputs, computed in the model) are exact on any Linear input.
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from quark_brevitas.algorithms.structure import Structure, infer_scaling_layers, input_channels, model_structure
from quark_brevitas.config.families import FAMILIES, RotationRoles
from quark_brevitas.errors import ConfigError

__all__ = ["NormReaders", "RotationSites", "rotation_sites"]


@dataclass(frozen=True)
class NormReaders:
    """A norm on the residual stream and the layers that read its output (names relative to a block, or to the
    model for the final norm)."""

    norm: str
    readers: tuple[str, ...]


@dataclass
class RotationSites:
    """What RotationConfig works on in one model; a rotation that cannot run has its reason in ``skipped``."""

    structure: Structure
    roles: RotationRoles | None
    hidden: int = 0
    embeddings: tuple[str, ...] = ()
    block_norms: tuple[NormReaders, ...] = ()
    final: NormReaders | None = None
    head_dim: int = 0
    online_r1: bool = False
    skipped: dict[str, str] = field(default_factory=dict)

    @property
    def blocks(self) -> tuple[str, ...]:
        return self.structure.blocks


def _roles(block: nn.Module, names: dict[str, str | None]) -> RotationRoles | None:
    """The family roles whose modules exist in ``block``, with Quark's explicit paths (``names``) overriding."""
    present = {name for name, _ in block.named_modules()}
    for family in FAMILIES.values():
        roles = family.rotation
        if roles is None:
            continue
        heads = names["self_attn"] or roles.heads
        v_proj, o_proj = names["v_proj"] or roles.v_proj, names["o_proj"] or roles.o_proj
        down = f"{names['mlp']}.down_proj" if names["mlp"] else roles.down_proj
        if {heads, v_proj, o_proj, down} <= present:
            return RotationRoles(heads, v_proj, o_proj, down, roles.readers, roles.writers, roles.no_r1)
    return None


def _probe(norm: nn.Module) -> nn.Module:
    """A float copy of ``norm`` to compute with. A norm whose values are not loaded yet (a streamed model's blocks
    are on the ``meta`` device until the engine loads them) gets placeholder values: the check is about what its
    class computes, not about its weights."""
    probe = copy.deepcopy(norm)
    if not any(t.is_meta for t in (*probe.parameters(), *probe.buffers())):
        return probe.float()
    probe = probe.to_empty(device="cpu").float()
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for tensor in (*probe.parameters(), *probe.buffers()):
            tensor.copy_(torch.rand(tensor.shape, generator=generator) + 0.5)
    return probe


def _rms_like(norm: nn.Module, hidden: int) -> str | None:
    """Why ``norm`` cannot carry R1 (``None``: it computes ``unit_rms(x) * weight`` and the unit-weight norm commutes
    with a rotation). Checked on random inputs with a copy of the norm."""
    weight = getattr(norm, "weight", None)
    if not isinstance(weight, torch.Tensor) or weight.shape != (hidden,):
        return f"{type(norm).__name__} has no per-channel weight of size {hidden}"
    if isinstance(getattr(norm, "bias", None), torch.Tensor):
        return f"{type(norm).__name__} has a bias"
    probe = _probe(norm)
    weight = probe.weight.detach().clone()
    unit = copy.deepcopy(probe)
    with torch.no_grad():
        unit.weight.fill_(1.0)
        generator = torch.Generator().manual_seed(0)
        x = torch.randn(4, hidden, generator=generator).to(weight.device)
        rotation, _ = torch.linalg.qr(torch.randn(hidden, hidden, generator=generator, dtype=torch.float64))
        rotation = rotation.float().to(weight.device)
        scaled = probe(x)
        same_scale = torch.allclose(scaled, unit(x) * weight.float(), atol=1e-4, rtol=1e-4)
        commutes = torch.allclose(unit(x @ rotation), unit(x) @ rotation, atol=1e-4, rtol=1e-4)
    if not (same_scale and commutes):
        return f"{type(norm).__name__} is not an RMSNorm (it does not commute with a rotation)"
    return None


def _block_norms(block: nn.Module, hidden: int) -> tuple[tuple[NormReaders, ...], str | None]:
    """The norms of a block that feed layers, from the inferred scaling groups, and why R1 cannot run (if so)."""
    groups, _ = infer_scaling_layers(block)
    norms = []
    for group in groups:
        module = block.get_submodule(group.prev_op)
        if input_channels(module) is not None:
            continue  # a Linear feeding a Linear (v -> o, up -> down): inside the block, not on the stream
        problem = _rms_like(module, hidden)
        if problem is not None:
            return (), f"{group.prev_op}: {problem}"
        norms.append(NormReaders(group.prev_op, group.layers))
    if not norms:
        return (), "no norm feeding the block's layers was found"
    return tuple(norms), None


def _final_norm(model: nn.Module, structure: Structure, hidden: int) -> tuple[NormReaders | None, str | None]:
    """The final norm (beside the decoder stack) and the head after it."""
    parent = structure.decoder_layers.rpartition(".")[0] if structure.decoder_layers else ""
    norm_name = f"{parent}.norm" if parent else "norm"
    modules = dict(model.named_modules())
    head = modules.get("lm_head")
    if norm_name not in modules:
        return None, f"no final norm at {norm_name!r}"
    if not isinstance(head, nn.Linear) or head.in_features != hidden:
        return None, ("no output head (lm_head) to fold the rotation's inverse into: the model would return "
                      "rotated hidden states")
    problem = _rms_like(modules[norm_name], hidden)
    if problem is not None:
        return None, f"{norm_name}: {problem}"
    return NormReaders(norm_name, ("lm_head",)), None


def _online_r1(model: nn.Module, sites: RotationSites) -> str | None:
    """Online R1 needs only the readers of the norms (any Linear input takes an online Hadamard exactly)."""
    block = model.get_submodule(sites.blocks[0])
    present = {name for name, _ in block.named_modules()}
    missing = [name for name in sites.roles.readers if name not in present]
    if not sites.roles.readers or missing:
        return f"the layers reading the norms are not all there (missing {missing or 'all'})"
    return None


def _r1(model: nn.Module, sites: RotationSites) -> str | None:
    """Fill the R1 sites; returns why R1 cannot run (``None`` if it can)."""
    roles, structure = sites.roles, sites.structure
    if sites.online_r1:
        return _online_r1(model, sites)
    if roles.no_r1:
        return roles.no_r1
    embeddings = [n for n in structure.embedding_layers if isinstance(model.get_submodule(n), nn.Embedding)]
    if len(embeddings) != 1:
        return f"expected one token embedding before the blocks, found {embeddings or 'none'}"
    sites.embeddings = tuple(embeddings)
    sites.hidden = model.get_submodule(embeddings[0]).embedding_dim
    first = model.get_submodule(structure.blocks[0])
    norms, problem = _block_norms(first, sites.hidden)
    if problem is not None:
        return problem
    sites.block_norms = norms
    final, problem = _final_norm(model, structure, sites.hidden)
    sites.final = final
    return problem


def _r2(model: nn.Module, sites: RotationSites) -> str | None:
    """The head size for R2; returns why R2 cannot run (``None`` if it can)."""
    block = model.get_submodule(sites.blocks[0])
    attention = block.get_submodule(sites.roles.heads)
    head_dim = getattr(attention, "head_dim", None) or getattr(attention, "attention_head_size", None)
    if not isinstance(head_dim, int) or head_dim < 1:
        return f"{sites.roles.heads} has no head_dim / attention_head_size"
    v_out = block.get_submodule(sites.roles.v_proj).out_features
    o_in = block.get_submodule(sites.roles.o_proj).in_features
    if v_out % head_dim or o_in % head_dim:
        return f"{sites.roles.v_proj} ({v_out} outputs) / {sites.roles.o_proj} ({o_in} inputs) are not whole heads " \
               f"of {head_dim}"
    sites.head_dim = head_dim
    return None


def _local(name: str, decoder: str) -> str | None:
    """A name of Quark's ``scaling_layers`` relative to a decoder layer (``None``: a name outside the blocks)."""
    for marker in ("layer_id", "pre_layer_id"):
        if name.startswith(f"{decoder}.{marker}."):
            return name[len(decoder) + len(marker) + 2:]
    return None


def _checked(owner: nn.Module, names: list[str], where: str) -> tuple[str, ...]:
    present = {name for name, _ in owner.named_modules()}
    for name in names:
        if name not in present:
            raise ConfigError(where, f"{name!r} is not a module of {type(owner).__name__}")
    return tuple(names)


def _explicit_r1(model: nn.Module, sites: RotationSites, given: dict[str, list[dict[str, Any]]], path: str) -> None:
    """Quark's explicit R1 sites (``scaling_layers``) in place of the family's; names checked against the model."""
    decoder = sites.structure.decoder_layers
    block = model.get_submodule(sites.blocks[0])
    where = f"{path}.scaling_layers"
    part = "middle_layers" if given.get("middle_layers") else "first_layer"
    norms, readers, writers = [], [], []
    for index, entry in enumerate(given.get(part) or []):
        at = f"{where}.{part}[{index}]"
        local = [_local(n, decoder) for n in entry.get("target_modules") or entry.get("next_modules") or []]
        if None in local:
            raise ConfigError(at, f"layer names must start with {decoder}.layer_id.")
        readers += _checked(block, local, at)
        writers += [w for w in (_local(n, decoder) for n in entry.get("prev_modules") or []) if w]
        if entry.get("norm_module") and not sites.online_r1:
            norm = _local(entry["norm_module"], decoder) or entry["norm_module"]
            next_local = tuple(_local(n, decoder) for n in entry.get("next_modules") or [])
            norms.append(NormReaders(_checked(block, [norm], f"{at}.norm_module")[0], next_local))
    for entry in given.get("last_layer") or []:
        writers += [w for w in (_local(n, decoder) for n in entry.get("prev_modules") or []) if w]
        if entry.get("norm_module") and not sites.online_r1:
            heads = _checked(model, list(entry.get("next_modules") or []), f"{where}.last_layer")
            sites.final = NormReaders(_checked(model, [entry["norm_module"]], f"{where}.last_layer")[0], heads)
    embeddings = [n for e in given.get("first_layer") or [] for n in e.get("prev_modules") or []
                  if _local(n, decoder) is None]
    sites.embeddings = _checked(model, embeddings, f"{where}.first_layer") if embeddings else sites.embeddings
    writers = list(dict.fromkeys(writers))
    _checked(block, writers, where)
    sites.roles = dataclasses.replace(sites.roles, readers=tuple(dict.fromkeys(readers)), writers=tuple(writers),
                                      no_r1=None)
    sites.block_norms = tuple(norms)


def _explicit_problem(model: nn.Module, sites: RotationSites) -> str | None:
    """Why explicit folded R1 sites cannot run (``None``: they can): a norm that is not an RMSNorm, no head."""
    if sites.online_r1:
        return None
    embedding = model.get_submodule(sites.embeddings[0]) if sites.embeddings else None
    if not isinstance(embedding, nn.Embedding) or sites.final is None or not sites.block_norms:
        return "scaling_layers must give the embedding (first_layer prev_modules), the norms and the last_layer norm"
    sites.hidden = embedding.embedding_dim
    block = model.get_submodule(sites.blocks[0])
    for group in sites.block_norms:
        problem = _rms_like(block.get_submodule(group.norm), sites.hidden)
        if problem is not None:
            return f"{group.norm}: {problem}"
    return _rms_like(model.get_submodule(sites.final.norm), sites.hidden)


def rotation_sites(algo: object, model: nn.Module, path: str = "RotationConfig") -> RotationSites:
    """Where ``algo`` (a RotationConfig) rotates ``model``; raises ConfigError when nothing it asks for can run."""
    if algo.backbone is not None and algo.backbone not in dict(model.named_modules()):
        raise ConfigError(f"{path}.backbone", f"{algo.backbone!r} is not a module of {type(model).__name__} (Quark's "
                                              "path to the model's backbone, e.g. 'model'); leave it None")
    structure = model_structure(model, decoder_layers=algo.model_decoder_layers, path=path, want_scaling=False)
    if structure.decoder_layers is None:
        raise ConfigError(path, f"{type(model).__name__} has no decoder layers; rotations need a transformer stack "
                                "(give model_decoder_layers)")
    first = model.get_submodule(structure.blocks[0])
    names = {key: getattr(algo, key) for key in ("v_proj", "o_proj", "self_attn", "mlp")}
    roles = _roles(first, names)
    if roles is None:
        raise ConfigError(path, f"the blocks of {type(model).__name__} ({structure.decoder_layers}) match no family "
                                "RotationConfig knows (Llama, Mistral, Qwen2; BERT for r2/r4): give v_proj, o_proj, "
                                "self_attn and mlp as Quark names them")
    sites = RotationSites(structure, roles, online_r1=bool(algo.online_r1_rotation))
    r1 = _r1
    if algo.scaling_layers is not None and algo.r1:
        _explicit_r1(model, sites, algo.scaling_layers, path)
        r1 = _explicit_problem
    wanted = {"r1": (algo.r1, r1), "r2": (algo.r2, _r2), "r4": (algo.r4, lambda m, s: None)}
    for key, (asked, infer) in wanted.items():
        if asked:
            problem = infer(model, sites)
            if problem is not None:
                sites.skipped[key] = problem
    if len(sites.skipped) == sum(asked for asked, _ in wanted.values()):
        reasons = "; ".join(f"{key.upper()}: {why}" for key, why in sites.skipped.items())
        raise ConfigError(path, f"no rotation it asks for can run on {type(model).__name__}: {reasons}")
    return sites
