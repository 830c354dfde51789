"""``quark-brevitas plan`` / ``presets``: which layers a config quantizes and how, what the algorithms infer and
in which order they run (also for a Hugging Face folder or a Quark 0.13 template), without quantizing.
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path
from typing import Any

from quark_brevitas.api import ModelQuantizer
from quark_brevitas.cli.options import CLIError, resolve_config
from quark_brevitas.config import Config
from quark_brevitas.config.presets import DESCRIPTIONS, PRESETS
from quark_brevitas.errors import ConfigError

logger = logging.getLogger("quark_brevitas.cli")


def plan_digits(config: Config, args: argparse.Namespace) -> list[Any]:
    """The plan of the digits CNN; errors about the config (a layer name that matches nothing, ...)
    name the config file they come from."""
    from quark_brevitas.cli.digits import DigitsCNN

    try:
        return ModelQuantizer(config).plan(DigitsCNN())
    except ConfigError as exc:
        if args.config is None or str(args.config) in str(exc):
            raise
        raise CLIError(f"{args.config}: {exc}") from exc


def _plan_model(args: argparse.Namespace) -> int:
    """``plan --model DIR``: the plan of a Hugging Face folder's model, built on the meta device (no weights
    read), with the block stack that ``quantize --model`` walks and what the algorithms infer in it."""
    from quark_brevitas.algorithms import describe_algorithms
    from quark_brevitas.backend import plan_table
    from quark_brevitas.blocks.stack import RUN_STACK, find_block_stack
    from quark_brevitas.hf.lm import default_llm_config
    from quark_brevitas.hf.streaming import load_skeleton
    from quark_brevitas.model_parts.attention import attention_plan_lines, query_projections, query_specs
    from quark_brevitas.model_parts.kv_cache import kv_plan_lines

    if not (Path(args.model) / "config.json").is_file():
        raise CLIError(f"--model {args.model!r} is not a Hugging Face model folder (no config.json)")
    config, source = default_llm_config(), "default (int4 per-group 128 + GPTQ)"
    if args.template is not None:
        config, source = _template_config(args)
    elif args.config is not None or args.preset is not None:
        config, source = resolve_config(args)
    skeleton, _ = load_skeleton(args.model)
    try:
        rows = ModelQuantizer(config).plan(skeleton)
    except ConfigError as exc:
        raise CLIError(f"{args.config or source}: {exc}") from exc
    stack = find_block_stack(skeleton, policy=RUN_STACK)
    blocks = f"{len(skeleton.get_submodule(stack))} blocks in {stack}" if stack else "none (quantized in memory)"
    pre = ", ".join(type(a).__name__ for a in config.pre_quant_opt_config) or "-"
    post = ", ".join(type(a).__name__ for a in config.algo_config) or "-"
    print(f"{type(skeleton).__name__} plan ({args.model}; {source}; pre-quant: {pre}; algorithms: {post})")
    print(f"block stack: {blocks}")
    print(plan_table(rows))
    kv_lines = kv_plan_lines(skeleton, config)
    kv_lines += attention_plan_lines(skeleton, config, query_specs(rows, query_projections(skeleton, config)))
    if kv_lines:
        print("\n" + "\n".join(kv_lines))
    print("\n" + "\n".join(run_order_lines(config)))
    described = describe_algorithms(config, skeleton)
    if described:
        print("\n" + "\n".join(described))
    return 0


def _template_config(args: argparse.Namespace) -> tuple[Config, str]:
    """``plan --template T --scheme S [--algorithm A ...]``: the Config Quark 0.13's ``LLMTemplate.get(T)
    .get_config(scheme=S, algorithm=[A, ...])`` gives, and a label saying what the template chose."""
    from quark_brevitas.config import LLMTemplate

    if args.config is not None or args.preset is not None:
        raise CLIError("--template builds the config; leave out --config and --preset")
    if args.scheme is None:
        raise CLIError(f"--template needs --scheme; supported: {', '.join(LLMTemplate.get_supported_schemes())}")
    try:
        template = LLMTemplate.get(args.template)
        config = template.get_config(scheme=args.scheme, algorithm=args.algorithm,
                                     kv_cache_scheme=getattr(args, "kv_cache_scheme", None),
                                     attention_scheme=getattr(args, "attention_scheme", None))
    except ConfigError as exc:
        raise CLIError(f"--template {args.template}: {exc}") from exc
    chosen = LLMTemplate.get_scheme(args.scheme)
    return config, (f"template {args.template}, scheme {args.scheme} ({chosen.description}), exclude "
                    f"{', '.join(config.exclude) or '-'}")


def _print_template(config: Config, source: str, model_type: str) -> int:
    """Without a model: what the template chose, spec by spec and algorithm by algorithm, in order."""
    from quark_brevitas.config import LLMTemplate

    print(source)
    for role in ("weight", "input_tensors"):
        spec = getattr(config.global_quant_config, role)
        print(f"  {role}: {spec.short() if spec is not None else 'float'}")
    for pattern, layer in config.layer_quant_config.items():
        print(f"  {pattern}: weight {layer.weight.short() if layer.weight else 'float'}")
    for pattern, layer in config.kv_cache_quant_config.items():
        print(f"  {pattern}: KV cache {layer.output_tensors.short()}, static, shared within "
              f"{config.kv_cache_group or 'no group'}, min_kv_scale {config.min_kv_scale}")
    print("\n".join(run_order_lines(config)))
    print("\n".join(LLMTemplate.get(model_type).describe()))
    return 0


def run_order_lines(config: Config) -> list[str]:
    """What ``plan`` says about the algorithms: each with its place in the config, in the order they run and
    when (an ``algo_config`` entry that transforms the float weights runs before quantization, as written)."""
    pre = {id(a) for a in config.pre_quant_algorithms()}
    lines = ["algorithms, in the order they run:"]
    for number, (where, algo) in enumerate(config.run_order(), start=1):
        when = "before quantization, on the float model" if id(algo) in pre else "after quantization and calibration"
        lines.append(f"  {number}. {where} {type(algo).__name__} ({when})")
    return lines if len(lines) > 1 else ["algorithms: none"]


def cmd_plan(args: argparse.Namespace) -> int:
    from quark_brevitas.algorithms import describe_algorithms
    from quark_brevitas.backend import plan_table

    if args.model is not None:
        return _plan_model(args)
    if args.template is not None:
        return _print_template(*_template_config(args), args.template)
    if args.scheme is not None or args.algorithm is not None:
        raise CLIError("--scheme and --algorithm are the template's; give --template too")
    config, source = resolve_config(args)
    rows = plan_digits(config, args)
    pre = ", ".join(type(a).__name__ for a in config.pre_quant_opt_config) or "-"
    post = ", ".join(type(a).__name__ for a in config.algo_config) or "-"
    print(f"DigitsCNN plan ({source}; pre-quant: {pre}; algorithms: {post})")
    print(plan_table(rows))
    print("\n" + "\n".join(run_order_lines(config)))
    from quark_brevitas.cli.digits import DigitsCNN

    described = describe_algorithms(config, DigitsCNN())  # what the algorithms work on (inferred structure)
    if described:
        print("\n" + "\n".join(described))
    return 0


def cmd_presets(args: argparse.Namespace) -> int:
    width = max(len(name) for name in PRESETS)
    for name in PRESETS:
        print(f"{name:<{width}}  {DESCRIPTIONS[name]}")
    return 0
