"""``quark-brevitas check --target finn FILE.onnx``: what stops FINN from turning a QONNX file into integer hardware
(:func:`quark_brevitas.export.finn_readiness`), one line per finding with the config change that fixes it; exit
status 1 when there are findings, 0 when there are none."""

from __future__ import annotations

import argparse
import os
from typing import Any

from quark_brevitas.export.errors import ExportError

TARGETS = ("finn",)


def add_check_command(sub: Any, verbosity: argparse.ArgumentParser) -> None:
    check = sub.add_parser("check", parents=[verbosity],
                           help="check an exported file against a deployment target's rules (FINN)")
    check.add_argument("--target", choices=TARGETS, required=True, help="the target whose rules apply")
    check.add_argument("file", metavar="FILE.onnx", help="a QONNX file (export --format qonnx)")
    check.set_defaults(func=cmd_check)


def cmd_check(args: argparse.Namespace) -> int:
    from quark_brevitas.export.finn_readiness import finn_readiness

    if not os.path.isfile(args.file):
        raise ExportError(f"{args.file}: no such file")
    findings = finn_readiness(args.file)
    for finding in findings:
        print(finding)
    print(f"{args.file}: {len(findings)} finding(s) for target {args.target}")
    return 1 if findings else 0


__all__ = ["add_check_command", "cmd_check"]
