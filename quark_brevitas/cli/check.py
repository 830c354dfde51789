"""``quark-brevitas check --target finn FILE.onnx``: what stops FINN from turning a QONNX file into integer hardware
(:func:`quark_brevitas.export.onnx.finn_readiness`), one line per finding with the config change that fixes it; exit
status 1 when there are findings, 0 when there are none. Its arguments are declared in
:mod:`quark_brevitas.cli.parser` (with every command's, so that ``--help`` imports nothing heavy)."""

from __future__ import annotations

import argparse
import os

from quark_brevitas.export.errors import ExportError

TARGETS = ("finn",)


def cmd_check(args: argparse.Namespace) -> int:
    from quark_brevitas.export.onnx.finn_readiness import finn_readiness

    if not os.path.isfile(args.file):
        raise ExportError(f"{args.file}: no such file")
    findings = finn_readiness(args.file)
    for finding in findings:
        print(finding)
    print(f"{args.file}: {len(findings)} finding(s) for target {args.target}")
    return 1 if findings else 0


__all__ = ["TARGETS", "cmd_check"]
