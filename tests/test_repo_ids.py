"""Telling a local folder from a Hub repo id, without the network: one check for the commands and the model cards."""

from __future__ import annotations

import pytest

from gated_attention.hub.model_card import base_model_fields
from gated_attention.hub.repo_ids import is_hub_id, missing_folder


@pytest.mark.parametrize(
    "name, hub_id",
    [("someone/tiny-llama", True), ("gpt2", True), ("org/name.v2", True),
     ("./run", False), ("/data/x", False), ("a/b/c", False), ("~/x", False), ("org//name", False)],
)
def test_a_name_that_is_no_path_is_a_hub_id_or_a_missing_folder(name, hub_id, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # none of the names exists here
    assert is_hub_id(name) is hub_id
    assert missing_folder(name) is not hub_id


def test_an_existing_folder_is_neither(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "org" / "name").mkdir(parents=True)
    assert not is_hub_id("org/name") and not missing_folder("org/name")
    assert base_model_fields("org/name") == {"base_model_yaml": "", "base_model_line": "A local checkpoint, `name`."}


def test_a_hub_id_names_its_base_model():
    assert base_model_fields("someone/tiny-llama")["base_model_yaml"] == "base_model: someone/tiny-llama\n"
