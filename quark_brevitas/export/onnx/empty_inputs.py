"""Empty optional inputs of ONNX nodes, given a name.

ONNX writes an omitted optional input as ``""`` (``Resize(X, "", scales)``: no region of interest). qonnx's
executor, and with it FINN's front end, asks every input of every node for a shape, and ``""`` has none, so it
refuses to run such a file ("Found unspecified tensor shapes"). An empty initializer means the same as the
omitted input (Resize reads ``roi`` only in ``tf_crop_and_resize`` mode), so the exported QONNX file names one.
"""

from __future__ import annotations

from typing import Any

import numpy as np

#: op type -> positions of optional inputs that may be given as an empty float tensor instead of omitted
_EMPTY_FLOAT_INPUTS: dict[str, tuple[int, ...]] = {"Resize": (1,)}


def name_empty_inputs(graph: Any) -> int:
    """Give every omitted ``roi`` of a Resize an empty initializer (in place); how many were given."""
    from onnx import numpy_helper

    given = 0
    for index, node in enumerate(graph.node):
        for position in _EMPTY_FLOAT_INPUTS.get(node.op_type, ()):
            if len(node.input) > position and node.input[position] == "":
                name = f"{node.name or node.op_type + str(index)}_empty_input{position}"
                graph.initializer.append(numpy_helper.from_array(np.zeros(0, np.float32), name))
                node.input[position] = name
                given += 1
    return given


__all__ = ["name_empty_inputs"]
