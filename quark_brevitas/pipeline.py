"""The quantization pipeline: one module owns the stages, in two phases.

- **Structure phase**: everything that depends only on the model and the config: structural
  pre-quantization steps (``Preprocess``: FX trace, BatchNorm merge, equalization) and layer
  replacement by the backend. Loading a checkpoint replays exactly this phase (:meth:`Pipeline.rebuild`),
  plus the structure data-driven steps left behind, which each algorithm's handler recreates from the
  checkpoint's record of the model (:meth:`~quark_brevitas.algorithms.AlgorithmHandler.restore`).
- **Data phase**: data-driven pre-quantization algorithms (``ActivationEqualization``), activation
  calibration and post-quantization algorithms (GPTQ, GPFQ, bias correction, ...). The pipeline owns the
  loop over calibration data: algorithms receive a :class:`~quark_brevitas.data.CalibrationData`
  and call its ``forward``; they never iterate a loader themselves.

Every stage runs in list order on a copy of the caller's model (``inplace=True`` opts out), and the
config travels with the quantized model (attribute :data:`CONFIG_ATTRIBUTE`) so that it can be saved.
"""

from __future__ import annotations

import copy
import logging
import time
from typing import Any

from torch import nn

from quark_brevitas.algorithms import SavedStructure, handler_for
from quark_brevitas.backend import PlannedLayer
from quark_brevitas.config import Config, verify_config
from quark_brevitas.container import Container
from quark_brevitas.data import BatchToInputs, CalibrationData, model_device_dtype
from quark_brevitas.errors import CalibrationDataError, ModelError
from quark_brevitas.resolve import Resolver
from quark_brevitas.ties import run_untied

logger = logging.getLogger(__name__)

__all__ = ["CONFIG_ATTRIBUTE", "Pipeline", "SavedStructure"]

#: Attribute under which the pipeline leaves the Config on the quantized model (read by save_quantized).
CONFIG_ATTRIBUTE = "quark_brevitas_config"


def _algorithm_name(algo: Any) -> str:
    return algo.name or type(algo).__name__


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

    def _checked_plan(self, model: nn.Module) -> list[PlannedLayer]:
        """The plan, after the checks that must pass before the model is copied or changed."""
        rows = self.plan(model)
        model_device_dtype(model)
        self.backend.require_targets(model, rows)
        return rows

    def _require_data(self, rows: list[PlannedLayer], data: CalibrationData | None) -> bool:
        """Whether activations need calibration; raises if some stage needs data and there is none."""
        activations = any(row.layer_config is not None and (row.layer_config.input_tensors is not None
                                                            or row.layer_config.output_tensors is not None)
                          for row in rows)
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
    def replace_layers(self, model: nn.Module) -> nn.Module:
        """Structure: the backend replaces the planned layers (names were checked on the caller's model;
        they are not re-checked on the pre-processed copy, whose BatchNorm layers may be merged away)."""
        logger.info("Applying quantization (%s backend)", self.config.backend.name)
        return self.backend.quantize(model, self.config, check_names=False)

    def _run_algorithms(self, stage: str, model: nn.Module, data: CalibrationData | None) -> nn.Module:
        for algo in getattr(self.config, stage):
            logger.info("Applying %s", _algorithm_name(algo))
            # Tied weights of quantized layers are untied only if the algorithm changes them (warning).
            model = run_untied(model, _algorithm_name(algo), handler_for(algo).apply, algo,
                               data if algo.needs_data else None)
        return model

    def _restore_algorithms(self, stage: str, model: nn.Module, saved: SavedStructure) -> nn.Module:
        for algo in getattr(self.config, stage):
            handler = handler_for(algo)
            model = handler.restore(algo, model, saved) if algo.needs_data else handler.apply(algo, model, None)
        return model

    def _finish(self, model: nn.Module) -> nn.Module:
        model.eval()
        setattr(model, CONFIG_ATTRIBUTE, copy.deepcopy(self.config))
        return model

    # ------------------------------------------------------------------ the two phases, end to end
    def quantize(self, model: nn.Module, calib_loader: Any = None, *, inplace: bool = False,
                 batch_to_inputs: BatchToInputs | None = None) -> nn.Module:
        """Both phases on a copy of ``model`` (see :meth:`quark_brevitas.api.ModelQuantizer.quantize_model`)."""
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        # Resolve the hierarchy against the caller's model, before copying or changing anything: a
        # misspelt layer name fails here, and the plan says whether activations need calibration.
        rows = self._checked_plan(model)
        data = CalibrationData.wrap(calib_loader, batch_to_inputs)
        activations = self._require_data(rows, data)
        start = time.perf_counter()
        work = model if inplace else copy.deepcopy(model)
        try:
            work = self._run_algorithms("pre_quant_opt_config", work, data)
            work = self.replace_layers(work)
            if activations:
                logger.info("Applying calibration")
                work = self.container.calibrator()(work, data)
            work = self._run_algorithms("algo_config", work, data)
        except CalibrationDataError as exc:
            if exc.batch_index is not None and not inplace and data.accepted_by(model, exc.batch_index):
                raise ModelError(
                    f"the model being quantized failed on calibration batch {exc.batch_index}, which the float "
                    f"model accepts: a limitation of quantizing this model, not a problem with the data "
                    f"({exc.__cause__.__class__.__name__}: {exc.__cause__}). Keep the layer involved in float "
                    "(Config.exclude) or report it"
                ) from exc.__cause__
            raise
        logger.info("Quantization done in %.1f s", time.perf_counter() - start)
        return self._finish(work)

    def rebuild(self, float_model: nn.Module, saved: SavedStructure) -> nn.Module:
        """The structure phase alone, on a copy of ``float_model``: the quantized model's structure, for a
        checkpoint's state dict to fill. Data-driven algorithms recreate the structure they left from
        ``saved`` instead of running."""
        self._checked_plan(float_model)
        work = copy.deepcopy(float_model)
        work = self._restore_algorithms("pre_quant_opt_config", work, saved)
        work = self.replace_layers(work)
        work = self._restore_algorithms("algo_config", work, saved)
        return self._finish(work)
