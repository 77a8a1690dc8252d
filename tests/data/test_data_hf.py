"""The Hugging Face corpora (``openwebtext``, ``fineweb``) offline, from local parquet / JSON files made
here, and multi-process tokenisation (``num_proc``): byte-identical files for any number of processes."""

import json

import numpy as np
import pytest

from geomtrain import data
from geomtrain.cli import main
from geomtrain.data import corpora

datasets = pytest.importorskip("datasets")  # in [test]; its absence is tested in test_data_prepare.py

WORDS = "river stone owl lantern harbour quiet meadow silver thread winter ember".split()


@pytest.fixture(autouse=True)
def hf_cache(tmp_path, monkeypatch):
    """``datasets`` caches its Arrow conversions under the test's folder, not the home directory."""
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf-cache"))
    datasets.disable_progress_bars()


def texts(n, seed=0):
    rng = np.random.default_rng(seed)
    return [" ".join(rng.choice(WORDS, size=int(rng.integers(5, 40)))) + f" ({i})" for i in range(n)]


def write_source(path, rows, kind):
    """``rows`` (a list of texts) as a parquet or JSON-lines file with a ``text`` column (and an ``id``)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    ds = datasets.Dataset.from_dict({"id": [f"doc-{i}" for i in range(len(rows))], "text": rows})
    ds.to_parquet(str(path)) if kind == "parquet" else ds.to_json(str(path))
    return path


def expected_tokens(dataset, rows, tok):
    """Per split, ``ids + [EOT]`` of each row in row order (row ``i`` named ``<dataset>/<i:08d>``)."""
    splits = corpora.assign_splits(f"{dataset}/{i:08d}" for i in range(len(rows)))
    out = {"train": [], "val": []}
    for i, text in enumerate(rows):
        out[splits[f"{dataset}/{i:08d}"]].extend([*tok.encode(text), tok.eot_token])
    return out


@pytest.mark.parametrize("kind", ["parquet", "json"])
def test_fineweb_from_local_files_tokenizes_every_row_in_order(tmp_path, kind):
    rows = texts(40)
    source = write_source(tmp_path / f"src/part.{'parquet' if kind == 'parquet' else 'jsonl'}", rows, kind)
    manifest = data.prepare(tmp_path / "out", dataset="fineweb", source=source)
    want = expected_tokens("fineweb", rows, data.get_tokenizer("gpt2"))
    for split in ("train", "val"):
        got = np.fromfile(tmp_path / "out" / f"{split}.bin", dtype=np.uint16).tolist()
        assert got == want[split] and manifest["splits"][split]["tokens"] == len(want[split])
    assert manifest["dataset"] == "fineweb" and list(manifest["sources"]["files"]) == [source.name]
    assert data.verify(tmp_path / "out") == []


@pytest.mark.slow
@pytest.mark.parametrize("tokenizer", ["gpt2", "bpe4k"])
def test_token_files_are_identical_for_any_number_of_processes(tmp_path, tokenizer):
    """700 documents are 11 batches of 64: with 2 processes, two windows of 8 batches go to the pool."""
    source = write_source(tmp_path / "src" / "rows.parquet", texts(700, seed=1), "parquet")
    one = data.prepare(tmp_path / "one", dataset="openwebtext", tokenizer=tokenizer, source=source)
    two = data.prepare(tmp_path / "two", dataset="openwebtext", tokenizer=tokenizer, source=source, num_proc=2)
    for split in ("train", "val"):
        assert (tmp_path / "one" / f"{split}.bin").read_bytes() == (tmp_path / "two" / f"{split}.bin").read_bytes()
        assert one["splits"][split] == two["splits"][split]
    assert one["source_fingerprint"] == two["source_fingerprint"]


def test_a_changed_source_file_is_rebuilt_an_unchanged_one_is_not(tmp_path):
    rows = texts(30, seed=2)
    source = write_source(tmp_path / "src" / "rows.parquet", rows, "parquet")
    first = data.prepare(tmp_path / "out", dataset="fineweb", source=source)
    assert data.prepare(tmp_path / "out", dataset="fineweb", source=source) == first  # nothing rewritten
    write_source(source, [*rows[:-1], "a changed last row"], "parquet")
    again = data.prepare(tmp_path / "out", dataset="fineweb", source=source)
    assert again["source_fingerprint"] != first["source_fingerprint"] and again["created"] >= first["created"]


def test_without_a_source_the_hub_id_and_config_are_loaded(monkeypatch):
    calls = []

    def load_dataset(*args, **kwargs):
        calls.append((args, kwargs))
        return datasets.Dataset.from_dict({"text": ["one", "two"]})

    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    assert list(data.iter_documents("fineweb")) == [("fineweb/00000000", "one"), ("fineweb/00000001", "two")]
    assert list(data.openwebtext_documents())[1] == ("openwebtext/00000001", "two")
    assert calls == [
        (("HuggingFaceFW/fineweb-edu", "sample-10BT"), {"split": "train"}),
        (("openwebtext", None), {"split": "train"}),
    ]
    sources, _ = corpora.source_info("fineweb", None)
    assert sources["hf_id"] == "HuggingFaceFW/fineweb-edu" and sources["hf_config"] == "sample-10BT"


def test_bad_sources_are_one_line(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match=r"^source .*empty must hold parquet or JSON files \(.parquet, .json"):
        next(data.iter_documents("fineweb", source=tmp_path / "empty"))
    with pytest.raises(ValueError, match="source is only used with the datasets openwebtext, fineweb, not 'classics'"):
        data.prepare(tmp_path / "out", dataset="classics", source=tmp_path / "empty")
    no_text = tmp_path / "no_text.jsonl"
    no_text.write_text(json.dumps({"body": "x"}) + "\n")
    with pytest.raises(ValueError, match="dataset 'fineweb' from .*no_text.jsonl has no 'text' column"):
        next(data.iter_documents("fineweb", source=no_text))
    with pytest.raises(ValueError, match="num_proc must be an integer >= 1; got 0"):
        data.prepare(tmp_path / "out", dataset="fineweb", source=no_text, num_proc=0)


@pytest.mark.slow
def test_cli_prepares_fineweb_with_processes(tmp_path, capsys):
    source = write_source(tmp_path / "src" / "rows.jsonl", texts(20, seed=3), "json")
    out = tmp_path / "fw"
    assert main(["prepare", "--dataset", "fineweb", "--source", str(source), "--num-proc", "2", "--out", str(out)]) == 0
    assert capsys.readouterr().out.startswith(f"prepared fineweb in {out}: train ")
    assert main(["prepare", "--dataset", "fineweb", "--num-proc", "0", "--out", str(out)]) == 2
