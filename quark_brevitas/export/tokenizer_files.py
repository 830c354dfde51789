"""A Hugging Face tokenizer folder: which files make one, and loading it with an error that names the remedy.

Export writers (a Hugging Face folder holds the tokenizer; GGUF embeds it) and the language-model workflow
(:mod:`quark_brevitas.hf.lm`, which re-exports both names) need it, so it sits in the export room, below both.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from quark_brevitas.errors import ModelError
from quark_brevitas.extras import require

__all__ = ["TOKENIZER_COPIED", "TOKENIZER_FILES", "load_tokenizer"]

#: Files of which a folder holding a Hugging Face tokenizer has at least one (``save_pretrained`` writes the first
#: two; the others are the vocabularies of slow tokenizers).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.txt", "vocab.json",
                   "spiece.model", "sentencepiece.bpe.model")
#: Every file of a tokenizer folder copied beside a checkpoint or an exported folder.
TOKENIZER_COPIED = (*TOKENIZER_FILES, "special_tokens_map.json", "added_tokens.json", "merges.txt",
                    "chat_template.jinja", "chat_template.json")


def load_tokenizer(folder: str | os.PathLike[str], model_dir: str | os.PathLike[str] | None = None) -> Any:
    """The tokenizer saved in ``folder`` (``AutoTokenizer``, local files only).

    Text calibration needs it to turn text into token ids, and a model folder may lack it (a checkpoint saved
    with ``model.save_pretrained`` alone): then, instead of transformers' long traceback, a :class:`ModelError`
    names the folder, the files looked for and the remedies. ``model_dir``, when the tokenizer folder was given
    separately, is named too.
    """
    folder = Path(folder)
    transformers = require("transformers", "a Hugging Face tokenizer")
    remedy = (f"save the model's tokenizer there (tokenizer.save_pretrained({str(folder)!r})) or point to a folder "
              "that has it (quantize --tokenizer DIR)")
    if not folder.is_dir():
        raise ModelError(f"tokenizer folder {str(folder)!r} does not exist or is not a directory")
    if not any((folder / name).is_file() for name in TOKENIZER_FILES):
        owner = f" (for the model {str(model_dir)!r})" if model_dir is not None and Path(model_dir) != folder else ""
        raise ModelError(f"{str(folder)!r}{owner} has no tokenizer (none of {', '.join(TOKENIZER_FILES)}); "
                         f"calibration text needs one to become token ids: {remedy}")
    try:
        return transformers.AutoTokenizer.from_pretrained(folder, local_files_only=True)
    except (OSError, ValueError, TypeError, KeyError, ImportError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ModelError(f"{str(folder)!r}: its tokenizer cannot be loaded ({type(exc).__name__}: {first}); "
                         f"{remedy}") from exc
