"""The benchmarks: accuracy, time and memory measured beside the anchors (onnxruntime, llama.cpp, AMD Quark) in the
same run. A package so that each one runs as ``python -m benchmarks.<name>`` from the repository root and shares
``benchmarks.tables`` (the table printer), ``benchmarks.models`` and ``benchmarks.sentences`` without path edits;
they use only quark_brevitas's public names. Not installed with the library.
"""
