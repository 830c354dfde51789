"""The recipes of the LLM codes snapshot (``tests/algorithms/test_llm_codes_snapshot.py``), shared with the GPU
tests (``tests/test_cuda.py``), which run the same recipes on a CUDA model.

A test module imports them from here rather than from the snapshot's test module: one test module importing
another would collect and run the other's tests twice over and tie the two files' imports together.
"""

from __future__ import annotations

from collections.abc import Callable

from helpers.llm_models import UINT4_G32, llm_config
from quark_brevitas import algos
from quark_brevitas.config import AWQConfig, Config, GPTQConfig, QuantizationSpec, SmoothQuantConfig
from quark_brevitas.types import Dtype, QSchemeType

# narrow_range=True: the snapshot was written when -7..7 was the default int4 grid; pinned so that it keeps
# comparing the same stored codes now that the default is the full range -8..7 (issue 19).
NARROW_INT4_G32 = QuantizationSpec(dtype=Dtype.int4, qscheme=QSchemeType.per_group, group_size=32, narrow_range=True)
INT8_CHANNEL = QuantizationSpec(qscheme=QSchemeType.per_channel)

#: The recipes of the snapshot: Quark's three LLM algorithms and the whole-model GPTQ (Brevitas's).
RECIPES: dict[str, Callable[[], Config]] = {
    "gptqconfig_uint4_g32": lambda: llm_config(UINT4_G32, [GPTQConfig(group_size=32)]),
    "gptqconfig_int4_g32_static": lambda: llm_config(NARROW_INT4_G32, [GPTQConfig(
        sym=True, group_size=32, static_groups=True, true_sequential=False, desc_act=False)]),
    "awqconfig_uint4_g32": lambda: llm_config(UINT4_G32, [AWQConfig(group_size=32)]),
    "smoothquant_w8a8": lambda: llm_config(INT8_CHANNEL, pre=[SmoothQuantConfig(alpha=0.5)], act=QuantizationSpec()),
    "gptq_whole_int4_g32": lambda: llm_config(NARROW_INT4_G32, [algos.GPTQ()]),
}
