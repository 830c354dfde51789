"""The quantization pipeline: one module owns the stages, in two phases.

- **Structure phase**: everything that depends only on the model and the config: structural
  pre-quantization steps (``Preprocess``: FX trace, BatchNorm merge, equalization) and layer
  replacement by the backend. Loading a checkpoint replays exactly this phase (:meth:`Pipeline.rebuild`),
  plus the structure data-driven steps left behind, which each algorithm's handler recreates from the
  checkpoint's record of the model (:meth:`~quark_brevitas.algorithms.AlgorithmHandler.restore`).
- **Data phase**: data-driven pre-quantization algorithms (``ActivationEqualization``), activation
  calibration and post-quantization algorithms (GPTQ, GPFQ, bias correction, ...). The pipeline owns the
  loop over calibration data: algorithms receive a :class:`~quark_brevitas.calibration.data.CalibrationData`
  and call its ``forward``; they never iterate a loader themselves.

The data phase runs on the whole model at once, or, for a model made of repeated blocks (Hugging Face
decoder and encoder stacks, or the stack named by ``blocks=`` / Quark's ``model_decoder_layers``), block by
block: :mod:`quark_brevitas.blocks` calls :meth:`Pipeline.quantize_unit` on one block at a time with the
block's cached inputs, so the work grows linearly with the depth. Calibration data may be sharded over
``torch.distributed`` processes (:mod:`quark_brevitas.brevitas_adapter.distributed`); every process then ends
with the same model.

Every stage runs in list order on a copy of the caller's model (``inplace=True`` opts out; the block-by-block
path copies one block at a time), and the config travels with the quantized model (attribute
:data:`CONFIG_ATTRIBUTE`) so that it can be saved.
"""

from __future__ import annotations

import copy
import functools
import logging
import os
import time
from collections.abc import Mapping
from typing import Any, NamedTuple

from torch import nn

from quark_brevitas.algorithms import SavedStructure, handler_for
from quark_brevitas.algorithms.ties import run_untied
from quark_brevitas.backend import PlannedLayer
from quark_brevitas.blocks.stack import RUN_STACK, find_block_stack
from quark_brevitas.brevitas_adapter import current_shard, discard_handed_over_outputs, require_equal_shares
from quark_brevitas.calibration.data import BatchToInputs, CalibrationData, model_device_dtype
from quark_brevitas.calibration.threads import threads_per_process
from quark_brevitas.config import Config, verify_config
from quark_brevitas.config.algorithms import BiasCorrection
from quark_brevitas.config.attention import attention_format
from quark_brevitas.container import Container
from quark_brevitas.errors import CalibrationDataError, ModelError
from quark_brevitas.model_parts.attention import (
    attach_attention_quantizers,
    finish_attention_calibration,
    query_projections,
    query_specs,
    use_eager_attention,
)
from quark_brevitas.model_parts.kv_cache import attach_kv_quantizers, finish_kv_calibration, kv_targets
from quark_brevitas.model_parts.moe import log_expert_coverage
from quark_brevitas.model_parts.moe_calibration import all_expert_calibration
from quark_brevitas.orchestration.block_runs import blockwise_obstacle, named_decoder_layers, quantize_blocks
from quark_brevitas.resolve import Resolver

logger = logging.getLogger(__name__)

__all__ = ["CONFIG_ATTRIBUTE", "DataPlan", "Pipeline", "SavedStructure", "require_quantized", "restrict_structure"]

#: Attribute under which the pipeline leaves the Config on the quantized model (read by save_quantized).
CONFIG_ATTRIBUTE = "quark_brevitas_config"


def require_quantized(model: Any, function: str) -> nn.Module:
    """``model`` if it is a model the pipeline quantized (it carries :data:`CONFIG_ATTRIBUTE`; so do the models the
    checkpoint loaders return), else a :class:`ModelError` naming ``function``."""
    if not isinstance(model, nn.Module):
        raise ModelError(f"{function}: model must be a torch.nn.Module, got {type(model).__name__}")
    if getattr(model, CONFIG_ATTRIBUTE, None) is None:
        raise ModelError(f"{function}: {type(model).__name__} was not quantized by quark_brevitas (it carries no "
                         "quark_brevitas config); pass the model ModelQuantizer(config).quantize_model returned")
    return model



def _enclosing_layer(module: str | None, rows: list[PlannedLayer]) -> str | None:
    """The quantized layer of the plan that contains module ``module`` of the model being quantized (its name
    may go through wrappers the pipeline added, ``fc1.layer.input_quant``), or ``None``."""
    if not module:
        return None
    names = [row.name for row in rows if row.quantized and row.name
             and (module == row.name or module.startswith(row.name + "."))]
    return max(names, key=len, default=None)


def _failing_layer(module: str | None) -> str:
    """``, in module 'NAME'`` for the message, or nothing when the module is not known."""
    return f", in module {module!r}" if module else ""


def _exclude_hint(module: str | None, rows: list[PlannedLayer]) -> str:
    """What to keep in float: the enclosing quantized layer, named as ``Config.exclude`` takes it."""
    layer = _enclosing_layer(module, rows)
    if layer is None:
        return "the layer involved (Config.exclude)"
    return f"layer {layer!r} (Config(..., exclude=[{layer!r}]))"

class DataPlan(NamedTuple):
    """What :meth:`Pipeline.prepare` found: the data the data phase reads (``None`` if no stage needs data),
    whether activations need calibration, whether any stage needs data."""

    data: CalibrationData | None
    activations: bool
    needs_data: bool


def _algorithm_name(algo: Any) -> str:
    return algo.name or type(algo).__name__


def restrict_structure(saved: SavedStructure, root: str, strip: str) -> SavedStructure:
    """The part of a checkpoint's structure record under module ``root`` (itself included), with the
    prefix ``strip`` removed from the names: what a handler restoring one part of the model sees."""

    def inside(name: str) -> bool:
        return not root or name == root or name.startswith(root + ".")

    def local(name: str) -> str:
        return name[len(strip) + 1:] if strip and name.startswith(strip + ".") else ("" if name == strip else name)

    def pick(mapping: Mapping[str, Any]) -> dict[str, Any]:
        return {local(k): v for k, v in mapping.items() if inside(k)}

    return SavedStructure(modules=pick(saved.modules), tensors=pick(saved.tensors))


def _has_activation_specs(rows: list[PlannedLayer]) -> bool:
    return any(row.layer_config is not None and (row.layer_config.input_tensors is not None
                                                 or row.layer_config.output_tensors is not None) for row in rows)


class Pipeline:
    """The stages of quantizing a model with one config; see the module docstring.

    The config is verified here, before any model is touched; ``container`` supplies the replaceable
    parts (layer map, backend, calibrator).
    """

    def __init__(self, config: Config, container: Container | None = None) -> None:
        if not isinstance(config, Config):
            raise TypeError(f"config must be a quark_brevitas Config, got {type(config).__name__}")
        verify_config(config)
        self.config = config
        self.container = container if container is not None else Container()
        Resolver(config, self.container.layer_map())  # layer-type keys must name quantizable types
        for stage in ("pre_quant_opt_config", "algo_config"):
            for index, algo in enumerate(getattr(config, stage)):
                path = f"{stage}[{index}]"
                handler_for(algo, path).check(algo, path)

    # ------------------------------------------------------------------ plan
    @property
    def backend(self) -> Any:
        return self.container.backends()[self.config.backend.name]

    def plan(self, model: nn.Module) -> list[PlannedLayer]:
        """Which modules would be quantized and with which config; the model is not modified."""
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        return self.backend.plan(model, self.config)

    def _checked_plan(self, model: nn.Module, loaded_later: str | None = None) -> list[PlannedLayer]:
        """The plan, after the checks that must pass before the model is copied or changed. ``loaded_later``:
        a submodule whose weights are still on the ``meta`` device because a block source loads them one
        block at a time (:mod:`quark_brevitas.hf.streaming`)."""
        rows = self.plan(model)
        self.backend.require_values(model, loaded_later)
        model_device_dtype(model)
        if not self._quantizes_attention():  # a KV-cache/attention-only config quantizes no layer
            self.backend.require_targets(model, rows)
        return rows

    def _quantizes_attention(self) -> bool:
        """Whether the config quantizes the KV cache or attention (quantizers outside the layers)."""
        return bool(self.config.kv_cache_quant_config) or self.config.softmax_quant_spec is not None

    def _calibrates(self, rows: list[PlannedLayer], kv_attentions: int = 0) -> bool:
        """Whether calibration runs: static activation specs, or KV-cache quantizers to calibrate."""
        return _has_activation_specs(rows) or kv_attentions > 0

    def _require_data(self, rows: list[PlannedLayer], data: CalibrationData | None) -> bool:
        """Whether activations need calibration; raises if some stage needs data and there is none."""
        activations = self._calibrates(rows, 1 if self._quantizes_attention() else 0)
        needs = [type(a).__name__ for a in [*self.config.pre_quant_opt_config, *self.config.algo_config]
                 if a.needs_data]
        if activations:
            needs.insert(0, "activation calibration")
        if data is None and needs:
            raise CalibrationDataError(
                f"calib_loader is required by: {', '.join(needs)}. Pass a DataLoader (or any re-iterable "
                "of batches), or use a weight-only config without algorithms."
            )
        return activations

    # ------------------------------------------------------------------ stages
    def replace_layers(self, model: nn.Module, *, log: int = logging.INFO) -> nn.Module:
        """Structure: the backend replaces the planned layers (names were checked on the caller's model;
        they are not re-checked on the pre-processed copy, whose BatchNorm layers may be merged away).
        ``log``: the level of the stage's lines (DEBUG when a checkpoint is rebuilt: a run says each stage once)."""
        logger.log(log, "Applying quantization (%s backend)", self.config.backend.name)
        return self.backend.quantize(model, self.config, check_names=False, log=log,
                                     **self._outputs_elsewhere(model))

    def _replace_unit_layers(self, unit: nn.Module, name: str, *,
                             log: int = logging.INFO) -> tuple[nn.Module, list[PlannedLayer]]:
        """:meth:`replace_layers` on one part of the model (``name``: its place; names resolve in full); a part
        without a layer to quantize is returned as it is."""
        rows = self.backend.plan(unit, self.config, check_names=False, prefix=name)
        if any(row.quantized for row in rows):
            unit = self.backend.quantize(unit, self.config, check_names=False, prefix=name, log=log,
                                         **self._outputs_elsewhere(unit))
        return unit, rows

    def _outputs_elsewhere(self, model: nn.Module) -> dict[str, Any]:
        """The backend's ``outputs_elsewhere`` argument where attention quantizers take the query projections'
        output specs (only the layerwise backend has it; the graph backend refuses attention quantization)."""
        projections = query_projections(model, self.config)
        return {"outputs_elsewhere": frozenset(projections)} if projections else {}

    def _attach_attention(self, unit: nn.Module, rows: list[PlannedLayer], prefix: str = "") -> int:
        """The KV-cache and attention quantizers of ``unit`` (``rows``: its plan, before the layers were
        replaced); returns how many attentions got some."""
        kv = attach_kv_quantizers(unit, self.config, prefix=prefix) if self.config.kv_cache_quant_config else 0
        specs = query_specs(rows, query_projections(unit, self.config))
        return kv + attach_attention_quantizers(unit, self.config, specs, prefix=prefix)

    def _finish_attention(self, unit: nn.Module) -> None:
        finish_kv_calibration(unit, self.config)
        finish_attention_calibration(unit)

    def _stage(self, stage: str) -> list[Any]:
        """The algorithms of a stage, in the order they run: ``"pre_quant_opt_config"``: those on the float model
        (with the weight transforms ``algo_config`` lists, Quark 0.13's style), ``"algo_config"``: the rest."""
        if stage == "pre_quant_opt_config":
            return self.config.pre_quant_algorithms()
        if stage == "algo_config":
            return self.config.post_quant_algorithms()
        raise ValueError(f"stage must be 'pre_quant_opt_config' or 'algo_config', got {stage!r}")

    def _run_algorithms(self, stage: str, model: nn.Module, data: CalibrationData | None, *,
                        data_driven: bool | None = None, log: int = logging.INFO,
                        unit: tuple[str, bool] | None = None) -> nn.Module:
        """The algorithms of ``stage`` in list order (only the data-driven ones, or only the data-free ones,
        if ``data_driven`` says so). ``unit``: ``(name, is_block)`` when ``model`` is one part of the model in
        the block-by-block data phase (the handlers' ``apply_unit``)."""
        for algo in self._stage(stage):
            if data_driven is not None and algo.needs_data != data_driven:
                continue
            logger.log(log, "Applying %s", _algorithm_name(algo))
            handler = handler_for(algo)
            discard_handed_over_outputs()  # an earlier algorithm's outputs: this one may change the layers
            apply = handler.apply if unit is None else \
                functools.partial(handler.apply_unit, name=unit[0], block=unit[1])
            # Tied weights of quantized layers are untied only if the algorithm changes them (warning).
            model = run_untied(model, _algorithm_name(algo), apply, algo, data if algo.needs_data else None)
        return model

    def _restore_algorithms(self, stage: str, model: nn.Module, saved: SavedStructure, *,
                            data_driven_only: bool = False) -> nn.Module:
        for algo in self._stage(stage):
            handler = handler_for(algo)
            if algo.needs_data:
                model = handler.restore(algo, model, saved)
            elif not data_driven_only:
                model = handler.apply(algo, model, None)
        return model

    # ------------------------------------------------------------------ one part of the model
    def quantize_unit(self, unit: nn.Module, name: str, data: CalibrationData | None, *,
                      block: bool = True) -> nn.Module:
        """The data phase's stages on one part of the model: a block (``name`` its qualified name) or a
        layer outside the blocks (inside a holder module; ``name`` the holder's place, its parent's name).

        Data-driven pre-quantization algorithms, layer replacement (the config resolved with full names),
        activation calibration and the post-quantization algorithms run on ``unit`` alone, fed by ``data``
        (the unit's cached inputs; ``None`` when nothing needs data). Data-free pre-quantization steps ran
        on the whole model before. ``block``: whether ``unit`` is a block (algorithms that work on decoder
        layers skip the layers outside). Returns the unit (possibly a new module)."""
        try:
            log_expert_coverage(unit, name, quiet=True)  # counts start with this unit's data phase
            with all_expert_calibration(unit, data, self.config, name):
                unit = self._run_algorithms("pre_quant_opt_config", unit, data, data_driven=True,
                                            log=logging.DEBUG, unit=(name, block))
                unit, rows = self._replace_unit_layers(unit, name)
                attached = self._attach_attention(unit, rows, prefix=name)
                if data is not None and self._calibrates(rows, attached):
                    unit = self.container.calibrator()(unit, data)
                    self._finish_attention(unit)
                unit = self._run_algorithms("algo_config", unit, data, log=logging.DEBUG, unit=(name, block))
                log_expert_coverage(unit, name)
            return unit
        except CalibrationDataError as exc:
            if exc.module is not None and name:  # the unit's module names are relative to it: qualify them
                exc.module = f"{name}.{exc.module}" if exc.module else name
            raise

    def rebuild_unit(self, unit: nn.Module, name: str, saved: SavedStructure) -> nn.Module:
        """:meth:`quantize_unit`'s structure without data (for loading a checkpoint one part at a time):
        ``saved`` is the checkpoint's record restricted to the unit (:func:`restrict_structure`)."""
        unit = self._restore_algorithms("pre_quant_opt_config", unit, saved, data_driven_only=True)
        unit, _ = self._replace_unit_layers(unit, name, log=logging.DEBUG)  # a reload: the run said it once
        return self._restore_algorithms("algo_config", unit, saved)

    def quantized_layers(self, model: nn.Module) -> list[str]:
        """The qualified names of ``model``'s layers the config quantizes, in model order (the block engine
        finds the layers outside the blocks with it)."""
        rows = self.backend.plan(model, self.config, check_names=False)
        return [row.name for row in rows if row.quantized and row.name]

    def blockwise_obstacle(self) -> str | None:
        """Why this config cannot run block by block (``None`` if it can)."""
        return blockwise_obstacle(self.config)

    def decoder_layers(self) -> list[str]:
        """The ``model_decoder_layers`` named by the config's algorithms (Quark's field), if any."""
        return named_decoder_layers(self.config)

    def finish(self, model: nn.Module) -> nn.Module:
        model.eval()
        setattr(model, CONFIG_ATTRIBUTE, copy.deepcopy(self.config))
        return model

    # ------------------------------------------------------------------ the two phases, end to end
    def quantize(self, model: nn.Module, calib_loader: Any = None, *, inplace: bool = False,
                 batch_to_inputs: BatchToInputs | None = None, blocks: str | bool | None = None,
                 offload: str | os.PathLike[str] | None = None, distributed: bool | None = None) -> nn.Module:
        """Both phases on a copy of ``model`` (see :meth:`quark_brevitas.api.ModelQuantizer.quantize_model`)."""
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        # Resolve the hierarchy against the caller's model, before copying or changing anything: a
        # misspelt layer name fails here, and the plan says whether activations need calibration.
        if offload is not None and offload != "disk" and not isinstance(offload, str | os.PathLike):
            raise TypeError(f"offload must be None, 'disk' or a directory path, got {type(offload).__name__}")
        plan = self.prepare(model, calib_loader, batch_to_inputs=batch_to_inputs, distributed=distributed)
        data = plan.data
        stack = find_block_stack(model, blocks, self.decoder_layers(), policy=RUN_STACK,
                                 obstacle=self.blockwise_obstacle())
        start = time.perf_counter()
        with threads_per_process(data.shard if data is not None else None):
            try:
                work = self._quantize_blocks(model, stack, data, inplace=inplace, offload=offload)
            except CalibrationDataError as exc:
                if exc.batch_index is not None and not inplace and data.accepted_by(model, exc.batch_index):
                    raise ModelError(
                        f"the model being quantized failed on calibration batch {exc.batch_index}, which the float "
                        f"model accepts{_failing_layer(exc.module)}: a limitation of quantizing this model, not "
                        f"a problem with the data ({exc.__cause__.__class__.__name__}: {exc.__cause__}). Keep "
                        f"{_exclude_hint(exc.module, self.plan(model))} in float or report it"
                    ) from exc.__cause__
                raise
        logger.info("Quantization done in %.1f s", time.perf_counter() - start)
        return self.finish(work)

    def prepare(self, model: nn.Module, calib_loader: Any = None, *, batch_to_inputs: BatchToInputs | None = None,
                distributed: bool | None = None, loaded_later: str | None = None) -> DataPlan:
        """The checks before any work (the plan resolved against ``model``, data present where needed) and
        the calibration data as the data phase will read it (sharded under ``torch.distributed``)."""
        rows = self._checked_plan(model, loaded_later)
        if self.config.softmax_quant_spec is not None:
            use_eager_attention(model)
            for name, spec in query_specs(rows, query_projections(model, self.config)).items():
                attention_format(spec, f"{name}.output_tensors (the query)")  # refused before any work
        if self.config.kv_cache_quant_config and not kv_targets(model, self.config):
            raise ModelError(f"kv_cache_quant_config: the patterns {sorted(self.config.kv_cache_quant_config)} match "
                             f"no key/value projection of an attention module of {type(model).__name__} (a module "
                             "with k_proj and v_proj children)")
        shard = current_shard(distributed)
        if shard is not None:
            logger.info("Calibration data sharded over %d processes (this is rank %d)", shard.world_size, shard.rank)
        data = CalibrationData.wrap(calib_loader, batch_to_inputs, shard=shard)
        activations = self._require_data(rows, data)
        needs_data = activations or any(a.needs_data for a in [*self.config.pre_quant_opt_config,
                                                                 *self.config.algo_config])
        self._check_shards(data, needs_data)
        return DataPlan(data if needs_data else None, activations, needs_data)

    def _check_shards(self, data: CalibrationData | None, needs_data: bool) -> None:
        """Brevitas's bias correction averages its corrections over processes assuming equal shares."""
        if data is None or data.shard is None or not needs_data:
            return
        if any(isinstance(a, BiasCorrection) for a in self.config.algo_config):
            require_equal_shares(data.loader, data.shard, "BiasCorrection")

    def _quantize_blocks(self, model: nn.Module, stack: str | None, data: CalibrationData | None, *, inplace: bool,
                         offload: str | os.PathLike[str] | None) -> nn.Module:
        """The run through the one orchestrator (:func:`~quark_brevitas.orchestration.block_runs.quantize_blocks`):
        with a block stack, the data-free pre-quantization steps first, on the whole model; without one, the whole
        model is the one block (:meth:`quantize_whole`)."""
        data_free = [_algorithm_name(a) for a in self.config.pre_quant_algorithms() if not a.needs_data]
        prepare = functools.partial(self._run_algorithms, "pre_quant_opt_config", data=None, data_driven=False) \
            if data_free and stack is not None else None
        return quantize_blocks(self, model, stack, data, inplace=inplace, offload=offload, prepare=prepare,
                               prepared_by=str(data_free))

    def quantize_whole(self, model: nn.Module, data: CalibrationData | None) -> nn.Module:
        """The data phase and the structure phase on the whole model at once (a model without a block stack is its
        own one block): every algorithm in list order on its whole-model path, the layers replaced in one step,
        activations calibrated over the whole model (when the plan has static activation specs, or the KV cache
        is quantized). ``model`` is changed in place; ``data``: ``None`` when no stage needs data."""
        activations = data is not None and self._calibrates(self.plan(model),
                                                            1 if self._quantizes_attention() else 0)
        with all_expert_calibration(model, data, self.config):
            model = self._run_algorithms("pre_quant_opt_config", model, data)
            rows = self.backend.plan(model, self.config, check_names=False)
            model = self.replace_layers(model)
            self._attach_attention(model, rows)
            if activations:
                logger.info("Applying calibration")
                model = self.container.calibrator()(model, data)
                self._finish_attention(model)
            model = self._run_algorithms("algo_config", model, data)
            log_expert_coverage(model)
        return model

    def rebuild(self, float_model: nn.Module, saved: SavedStructure) -> nn.Module:
        """The structure phase alone, on a copy of ``float_model``: the quantized model's structure, for a
        checkpoint's state dict to fill. Data-driven algorithms recreate the structure they left from
        ``saved`` instead of running."""
        self._checked_plan(float_model)
        work = copy.deepcopy(float_model)
        work = self._restore_algorithms("pre_quant_opt_config", work, saved)
        work = self.replace_layers(work, log=logging.DEBUG)  # a reload: the run that quantized said it
        work = self._restore_algorithms("algo_config", work, saved)
        return self.finish(work)

