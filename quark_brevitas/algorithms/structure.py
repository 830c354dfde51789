"""The structure of Hugging Face transformers, inferred from their modules: decoder layers, scaling layers, embeddings.

Quark's LLM algorithms (SmoothQuant, AWQ, GPTQ) name the parts of a transformer they work on:
``model_decoder_layers`` (the ModuleList of repeated blocks), ``scaling_layers`` (per block: a ``prev_op`` whose
output feeds ``layers``, so per-channel scales can be folded from one into the other) and ``embedding_layers``.
Users of Quark write these by hand per model family; here they are inferred from the module structure for the
common families (Llama, Mistral, Qwen2 and their relatives, OPT, GPT-2, BERT) and explicit values override the
inference. No transformers import is needed: the module names and shapes say everything. The families' groups are
the family table of :mod:`quark_brevitas.config.families` (which the LLM templates read too).

A scaling group is proposed only where folding is exact, i.e. the quantized model computes the same function:

- a norm feeding the q/k/v (or fc1, up/gate) projections of a *pre-norm* block: the norm's output feeds only them;
- v -> o when their widths match (no grouped-query attention): attention is linear in the values;
- up -> down in a gated MLP (``down(act(gate(x)) * up(x))``) and fc1 -> fc2 around a positively homogeneous
  activation (ReLU).

Where a family's natural group is not exact the structure says so with the reason (:attr:`Structure.skipped`):
BERT is post-norm (each LayerNorm's output also feeds the residual connection, which a folded scale would change),
GPT-2's MLP has a GELU between c_fc and c_proj, OPT-350m-style blocks normalise after attention.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from quark_brevitas.blocks.stack import find_block_stack, stack_blocks
from quark_brevitas.config.families import CONDITIONS, scaling_candidates
from quark_brevitas.errors import ConfigError

__all__ = [
    "ScalingGroup",
    "SkippedGroup",
    "Structure",
    "check_scaling_groups",
    "infer_embedding_layers",
    "infer_scaling_layers",
    "input_channels",
    "is_linear",
    "model_structure",
    "output_channels",
]

@dataclass(frozen=True)
class ScalingGroup:
    """One entry of Quark's ``scaling_layers``: per-channel scales folded out of ``prev_op``'s output into the input
    channels of ``layers``; ``inp`` is the layer whose input is measured, ``module2inspect`` the sub-module whose
    output AWQ measures (``None``: the layers' own outputs). Names are relative to a decoder layer."""

    prev_op: str
    layers: tuple[str, ...]
    inp: str
    module2inspect: str | None = None

    @classmethod
    def from_quark(cls, entry: Mapping[str, Any]) -> ScalingGroup:
        layers = tuple(entry["layers"])
        return cls(entry["prev_op"], layers, entry.get("inp") or layers[0], entry.get("module2inspect"))

    def to_quark(self) -> dict[str, Any]:
        entry: dict[str, Any] = {"prev_op": self.prev_op, "layers": list(self.layers), "inp": self.inp}
        if self.module2inspect is not None:
            entry["module2inspect"] = self.module2inspect
        return entry

    def __str__(self) -> str:
        return f"{self.prev_op} -> {', '.join(self.layers)}"


@dataclass(frozen=True)
class SkippedGroup:
    """A family's natural scaling group that is not exact in this model, and why."""

    group: str
    reason: str


@dataclass(frozen=True)
class Structure:
    """What an algorithm works on in one model.

    - ``decoder_layers``: the path of the ModuleList of blocks (``None``: the model itself is the one block).
    - ``blocks``: the qualified names of the blocks, in order (``""`` for the model itself).
    - ``embedding_layers``: the embedding modules before the blocks.
    - ``scaling_layers``: the scaling groups of each block (names relative to a block).
    - ``skipped``: the family's groups left out, with the reason.
    - ``inferred``: the fields that were inferred rather than given.
    """

    decoder_layers: str | None
    blocks: tuple[str, ...]
    embedding_layers: tuple[str, ...] = ()
    scaling_layers: tuple[ScalingGroup, ...] = ()
    skipped: tuple[SkippedGroup, ...] = ()
    inferred: frozenset[str] = field(default_factory=frozenset)

    def describe(self, with_scaling: bool = True) -> list[str]:
        """Human-readable lines (what ``plan`` shows), saying which values were inferred."""

        def how(name: str) -> str:
            return "inferred" if name in self.inferred else "given"

        stack = (f"{self.decoder_layers} ({len(self.blocks)} blocks, {how('model_decoder_layers')})"
                 if self.decoder_layers is not None else "none: the model is one block")
        lines = [f"decoder layers: {stack}",
                 f"embedding layers: {', '.join(self.embedding_layers) or '-'} ({how('embedding_layers')})"]
        if with_scaling:
            lines.append(f"scaling layers per block ({how('scaling_layers')}):")
            lines += [f"  {group}" for group in self.scaling_layers] or ["  -"]
            lines += [f"  not used: {skip.group} ({skip.reason})" for skip in self.skipped]
        return lines


# ===================================================================== channels of the layers involved
def is_linear(module: nn.Module) -> bool:
    """A Linear layer, or Hugging Face's Conv1D (a Linear with its weight transposed), quantized or not."""
    return isinstance(module, nn.Linear) or _is_hf_conv1d(module)


def _is_hf_conv1d(module: nn.Module) -> bool:
    return type(module).__name__ == "Conv1D" and hasattr(module, "nf") and not isinstance(module, nn.Linear)


def input_channels(module: nn.Module) -> int | None:
    """The input features of a Linear-like layer (``None`` for other modules)."""
    if isinstance(module, nn.Linear):
        return module.in_features
    if _is_hf_conv1d(module):
        return int(module.weight.shape[0])
    return None


def output_channels(module: nn.Module) -> int | None:
    """The output channels of a Linear-like layer or of a norm with a per-channel weight (``None`` otherwise)."""
    if isinstance(module, nn.Linear):
        return module.out_features
    if _is_hf_conv1d(module):
        return int(module.weight.shape[1])
    weight = getattr(module, "weight", None)
    if isinstance(weight, torch.Tensor) and weight.dim() == 1:
        return int(weight.numel())
    return None


# ===================================================================== decoder layers and embeddings
def _is_block_list(module: nn.Module) -> bool:
    """Whether an explicit ``model_decoder_layers`` names a non-empty ModuleList of modules of one class."""
    children = list(module.children())
    return isinstance(module, nn.ModuleList) and bool(children) and len({type(c) for c in children}) == 1


def infer_embedding_layers(model: nn.Module, decoder_path: str | None) -> tuple[str, ...]:
    """The embedding modules outside the decoder layers (token, position, token-type embeddings)."""
    inside = f"{decoder_path}." if decoder_path else None
    return tuple(name for name, module in model.named_modules()
                 if isinstance(module, nn.Embedding) and not (inside and name.startswith(inside)))


# ===================================================================== scaling groups
def _positively_homogeneous(activation: Any) -> bool:
    """Whether ``act(c * x) == c * act(x)`` for c > 0 (ReLU, LeakyReLU), so a scale passes through it."""
    if not callable(activation):
        return False
    x = torch.linspace(-4.0, 4.0, 33)
    with torch.no_grad():
        return bool(torch.allclose(activation(2.5 * x), 2.5 * activation(x), atol=1e-6))


def _pre_norm(block: nn.Module) -> bool:
    return bool(getattr(block, "do_layer_norm_before", True))


_POST_NORM = "post-norm block: the norm's output also feeds the residual connection, which a folded scale would change"
_NOT_HOMOGENEOUS = "the activation between them is not positively homogeneous (e.g. GELU, SiLU), a scale cannot pass it"
_GQA = "grouped-query attention: v_proj is narrower than o_proj's input"

def _activation_at(block: nn.Module, path: str) -> Any:
    """The attribute at the dotted ``path`` from ``block`` (an activation module or function), or ``None``."""
    value: Any = block
    for part in path.split("."):
        value = getattr(value, part, None)
    return value


def _condition_problem(block: nn.Module, condition: str | None) -> str | None:
    """Why a family's scaling group is not exact in ``block`` under the table's ``condition`` (``None``: exact so
    far; the shapes are checked next). The conditions are named in :mod:`quark_brevitas.config.families`."""
    if condition is None:
        return None
    if condition == "pre_norm":
        return None if _pre_norm(block) else _POST_NORM
    if condition == "post_norm":
        return _POST_NORM
    if condition == "not_homogeneous":
        return _NOT_HOMOGENEOUS
    if condition == "fused_v":
        return "v is a slice of the fused qkv_proj's outputs: scaling only those rows is not supported"
    if condition == "fused_up":
        return "up is a slice of the fused gate_up_proj's outputs: scaling only those rows is not supported"
    if condition.startswith("homogeneous:"):
        activation = _activation_at(block, condition.removeprefix("homogeneous:"))
        return None if _positively_homogeneous(activation) else _NOT_HOMOGENEOUS
    raise ValueError(f"unknown scaling condition {condition!r} in the family table; known: {list(CONDITIONS)}")


def _multiplies_by_one_plus_weight(module: nn.Module) -> bool:
    """Whether a norm computes ``normalised * (1 + weight)`` (Gemma's RMSNorm) rather than ``* weight``: probed by
    running it with its weight (and bias) zeroed, which zeroes the output of every norm a scale folds into. On the
    meta device (no values, ``plan --model``) the class name says it."""
    weight = getattr(module, "weight", None)
    if isinstance(module, nn.Linear) or _is_hf_conv1d(module) or not isinstance(weight, torch.Tensor) \
            or weight.dim() != 1:
        return False
    if weight.is_meta:
        return type(module).__name__.lower().startswith("gemma")
    bias = getattr(module, "bias", None)
    params = [t for t in (weight, bias) if isinstance(t, torch.Tensor)]
    saved = [t.detach().clone() for t in params]
    x = torch.randn(2, weight.numel(), generator=torch.Generator().manual_seed(0)).to(weight.device, weight.dtype)
    try:
        with torch.no_grad():
            for t in params:
                t.zero_()
            out = module(x)
    finally:
        with torch.no_grad():
            for t, value in zip(params, saved):
                t.copy_(value)
    return bool(out.abs().max() > 0)


def _offset_norm_problem(block: nn.Module, prev_op: str) -> str | None:
    if _multiplies_by_one_plus_weight(block.get_submodule(prev_op)):
        return (f"{prev_op} multiplies by (1 + weight) (Gemma's RMSNorm): dividing its weight by a scale does not "
                "divide its output, so the fold would change the model")
    return None


def _shape_problem(block: nn.Module, prev_op: str, layers: Iterable[str]) -> str | None:
    """Why ``prev_op``'s output channels cannot scale ``layers``' inputs one to one (``None`` if they can)."""
    prev = block.get_submodule(prev_op)
    width = output_channels(prev)
    if width is None:
        return f"{prev_op} ({type(prev).__name__}) is neither a Linear-like layer nor a norm with a per-channel weight"
    for name in layers:
        layer = block.get_submodule(name)
        if not is_linear(layer):
            return f"{name} ({type(layer).__name__}) is not a Linear-like layer"
        if input_channels(layer) != width:
            return (_GQA if name.endswith("o_proj") else
                    f"{prev_op} has {width} output channels but {name} has {input_channels(layer)} inputs")
    return None


def _has(names: set[str], wanted: Iterable[str]) -> bool:
    return all(name in names for name in wanted)


def infer_scaling_layers(block: nn.Module) -> tuple[tuple[ScalingGroup, ...], tuple[SkippedGroup, ...]]:
    """The exact scaling groups of a decoder layer of a known family, and the family's groups that are not exact."""
    names = {name for name, _ in block.named_modules()}
    groups: list[ScalingGroup] = []
    skipped: list[SkippedGroup] = []
    for candidate in scaling_candidates():
        prev_op, layers = candidate.prev_op, candidate.layers
        if not _has(names, (prev_op, *layers)):
            continue
        reason = (_condition_problem(block, candidate.condition) or _offset_norm_problem(block, prev_op)
                  or _shape_problem(block, prev_op, layers))
        if reason is None:
            groups.append(ScalingGroup(prev_op, layers, layers[0], candidate.module2inspect))
        else:
            skipped.append(SkippedGroup(str(candidate), reason))
    return tuple(groups), tuple(skipped)


def check_scaling_groups(block: nn.Module, block_name: str, groups: Iterable[ScalingGroup], path: str) -> None:
    """Raise :class:`ConfigError` (at ``path``) unless every name of ``groups`` exists in ``block`` and the
    channels match (explicit ``scaling_layers``)."""
    names = {name for name, _ in block.named_modules()}
    where = f"decoder layer {block_name!r}" if block_name else "the model"
    for index, group in enumerate(groups):
        for name in (group.prev_op, *group.layers, *([group.module2inspect] if group.module2inspect else [])):
            if name not in names:
                close = sorted(n for n in names if n and n.rsplit(".", 1)[-1] == name.rsplit(".", 1)[-1])[:3]
                hint = f" (did you mean {', '.join(close)}?)" if close else ""
                raise ConfigError(f"{path}[{index}]", f"{name!r} is not a module of {where}{hint}")
        problem = _offset_norm_problem(block, group.prev_op) or _shape_problem(block, group.prev_op, group.layers)
        if problem is not None:
            raise ConfigError(f"{path}[{index}]", f"{group} cannot be scaled in {where}: {problem}")


# ===================================================================== everything, with explicit values first
def model_structure(model: nn.Module, *, decoder_layers: str | None = None,
                    scaling_layers: list[dict[str, Any]] | None = None, embedding_layers: list[str] | None = None,
                    path: str = "", want_scaling: bool = True) -> Structure:
    """The structure an algorithm works on: explicit fields as given (checked against ``model``), the others
    inferred. ``path`` prefixes the field names in errors (e.g. ``"AWQConfig"``); ``want_scaling`` says whether
    scaling groups are needed (SmoothQuant, AWQ) and must therefore exist."""
    inferred: set[str] = set()
    field_path = f"{path}." if path else ""
    modules = dict(model.named_modules())
    if decoder_layers is not None:
        stack = modules.get(decoder_layers)
        if stack is None or not _is_block_list(stack):
            found = find_block_stack(model)
            hint = f"; the model's decoder layers are at {found!r}" if found else ""
            what = "not a module" if stack is None else f"a {type(stack).__name__}, not a ModuleList of blocks"
            raise ConfigError(f"{field_path}model_decoder_layers", f"{decoder_layers!r} is {what} of "
                                                                   f"{type(model).__name__}{hint}")
    else:
        decoder_layers = find_block_stack(model)
        inferred.add("model_decoder_layers")
    blocks = stack_blocks(model, decoder_layers)
    if embedding_layers is not None:
        for index, name in enumerate(embedding_layers):
            if name not in modules:
                raise ConfigError(f"{field_path}embedding_layers[{index}]", f"{name!r} is not a module of "
                                                                           f"{type(model).__name__}")
        embeddings = tuple(embedding_layers)
    else:
        embeddings = infer_embedding_layers(model, decoder_layers)
        inferred.add("embedding_layers")
    groups: tuple[ScalingGroup, ...] = ()
    skipped: tuple[SkippedGroup, ...] = ()
    if want_scaling:
        if scaling_layers is not None:
            groups = tuple(ScalingGroup.from_quark(entry) for entry in scaling_layers)
            for name, block in blocks:
                check_scaling_groups(block, name, groups, f"{field_path}scaling_layers")
        else:
            inferred.add("scaling_layers")
            groups, skipped = infer_scaling_layers(blocks[0][1])
            if not groups:
                where = (f"its decoder layers ({decoder_layers}, {type(blocks[0][1]).__name__})"
                         if decoder_layers is not None else "it (no decoder layers found)")
                reasons = "; ".join(f"{s.group}: {s.reason}" for s in skipped)
                raise ConfigError(f"{field_path}scaling_layers", f"none could be inferred for {type(model).__name__}: "
                                  f"{where} match no known family (Llama, Mistral, Qwen2, OPT, GPT-2, BERT)"
                                  f"{' or no group is exact (' + reasons + ')' if reasons else ''}; give them as "
                                  "Quark does: [{'prev_op': ..., 'layers': [...], 'inp': ...}] relative to a "
                                  "decoder layer")
    return Structure(decoder_layers, tuple(name for name, _ in blocks), embeddings, groups, skipped,
                     frozenset(inferred))
