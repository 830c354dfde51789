"""GGUF files (llama.cpp): the writer, the K-quant packers and the tokenizer part (the check of a plan before
calibration quantizes stand-ins with the api, so it is :func:`quark_brevitas.hf.plan_checks.check_gguf_plan`).

:mod:`quark_brevitas.export.gguf` was one module before 0.3.0; its names stay importable from
here (the writer is :mod:`quark_brevitas.export.gguf.writer`)."""

from quark_brevitas.export.gguf.writer import (
    GGUF_FAMILIES,
    GGUF_FILE_NAME,
    GGUF_WEIGHT_TYPES,
    GGUFFamily,
    GGUFPlan,
    GGUFTensor,
    check_gguf_blocks,
    check_tokenizer_fits,
    collect_checked,
    collect_gguf_tensors,
    export_gguf,
    float16_weights,
    plan_gguf,
    refuse_activation_quantizers,
    tokenizer_dir_of,
    write_gguf,
)

__all__ = ["GGUF_FAMILIES", "GGUF_FILE_NAME", "GGUF_WEIGHT_TYPES", "GGUFFamily", "GGUFPlan", "GGUFTensor",
           "check_gguf_blocks", "check_tokenizer_fits", "collect_checked", "collect_gguf_tensors", "export_gguf",
           "float16_weights", "plan_gguf", "refuse_activation_quantizers", "tokenizer_dir_of", "write_gguf"]
