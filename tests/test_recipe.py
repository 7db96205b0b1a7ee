"""recipes/finetune_long_docs.py in one process: real data paths through `datasets`, and its errors."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os

import pytest

from hf_distca.cli import _field_docs, config_from_args
from hf_distca.config import DistCAConfig
from hf_distca.data.synthetic import generate_text_documents

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def load_recipe():
    spec = importlib.util.spec_from_file_location(
        "finetune_long_docs", os.path.join(ROOT, "recipes", "finetune_long_docs.py")
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def write_jsonl(path, key: str, texts) -> str:
    with open(path, "w") as f:
        for t in texts:
            f.write(json.dumps({key: t}) + "\n")
    return str(path)


@pytest.mark.parametrize("fmt", ["jsonl", "txt"])
def test_local_dataset_trains_and_saves(tmp_path, fmt):
    texts = generate_text_documents(40, seed=3, mean_words=120, max_words=600)
    if fmt == "jsonl":
        data = write_jsonl(tmp_path / "docs.jsonl", "text", texts)
    else:  # one document per line
        data = str(tmp_path / "docs.txt")
        (tmp_path / "docs.txt").write_text("\n".join(t.replace("\n", " ") for t in texts) + "\n")
    out = tmp_path / "run"
    summary = load_recipe().main(
        [
            "--dataset",
            data,
            "--max-steps",
            "2",
            "--tokens-per-rank",
            "512",
            "--output-dir",
            str(out),
            "--seed",
            "1",
        ]
    )
    assert summary["steps"] == 2 and summary["world_size"] == 1
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2]
    assert all(r["tokens"] == 512 and r["loss"] > 0 for r in records)
    assert (out / "model" / "config.json").exists() and (out / "model" / "tokenizer.json").exists()
    assert os.path.getsize(out / "attention_load.png") > 1000


def test_dataset_without_text_column(tmp_path):
    data = write_jsonl(tmp_path / "docs.jsonl", "body", ["a b c", "d e f"])
    with pytest.raises(ValueError, match="has no column 'text'.*--text-column"):
        load_recipe().main(["--dataset", data, "--output-dir", str(tmp_path / "run")])


def test_unsupported_local_file(tmp_path):
    path = tmp_path / "docs.xml"
    path.write_text("<doc/>")
    with pytest.raises(ValueError, match="unsupported local dataset file"):
        load_recipe().main(["--dataset", str(path), "--output-dir", str(tmp_path / "run")])


def test_document_lengths_from_a_sample(tmp_path):
    sample = tmp_path / "lengths.json"
    sample.write_text(json.dumps([40, 700, 1500, 90, 3000]))
    out = tmp_path / "run"
    summary = load_recipe().main(
        ["--doc-lengths", str(sample), "--num-documents", "30", "--max-steps", "2", "--tokens-per-rank", "1024",
         "--output-dir", str(out), "--no-save"]
    )  # fmt: skip
    assert summary["steps"] == 2
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert all(r["tokens"] == 1024 for r in records)
    with pytest.raises(ValueError, match="exclude each other"):
        load_recipe().main(["--doc-lengths", str(sample), "--dataset", str(sample), "--output-dir", str(out)])


def test_distca_flags_come_from_the_config(capsys):
    """One option per DistCAConfig field, with the field's default and docstring: no second copy."""
    recipe = load_recipe()
    defaults = recipe.parse_args([])
    assert config_from_args(defaults) == DistCAConfig()
    for field in dataclasses.fields(DistCAConfig):
        assert getattr(defaults, field.name) == field.default
    args = recipe.parse_args(["--tolerance", "0.25", "--shard-tokens", "64", "--backend", "reference"])
    assert config_from_args(args) == DistCAConfig(tolerance=0.25, shard_tokens=64, backend="reference")
    with pytest.raises(ValueError, match="DistCAConfig.tolerance must be in"):
        config_from_args(recipe.parse_args(["--tolerance", "-1"]))
    with pytest.raises(SystemExit):
        recipe.parse_args(["--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    for field in dataclasses.fields(DistCAConfig):
        flag = "--" + field.name.replace("_", "-")
        assert flag in help_text
        assert " ".join(_field_docs()[field.name].split())[:40] in help_text, field.name
