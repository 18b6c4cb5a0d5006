"""Telling a local folder from a Hub repo id, and fetching an id: one check and one policy for the commands and the cards."""

from __future__ import annotations

import pytest

from gated_attention.hub.provenance import read_provenance
from gated_attention.hub.repo_ids import HubUnavailable, cached_or_downloaded, is_hub_id, missing_folder


@pytest.mark.parametrize(
    "name, hub_id",
    [("someone/tiny-llama", True), ("gpt2", True), ("org/name.v2", True), ("org/name/folder", True),
     ("QwQZh/gated_attention/1B_gate_headwise", True), ("./run", False), ("/data/x", False), ("~/x", False),
     ("org//name", False), ("org/name//folder", False), ("org/name/../x", False)],
)
def test_a_name_that_is_no_path_is_a_hub_id_or_a_missing_folder(name, hub_id, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # none of the names exists here
    assert is_hub_id(name) is hub_id
    assert missing_folder(name) is not hub_id


def test_an_existing_folder_is_neither(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "org" / "name").mkdir(parents=True)
    assert not is_hub_id("org/name") and not missing_folder("org/name")
    local = read_provenance("org/name", tmp_path / "org" / "name")
    assert local.base_model is None and local.base_model_line().startswith("A local checkpoint, `name`; it names no Hub repo")


def test_a_hub_id_names_its_base_model(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert read_provenance("someone/tiny-llama", None).card_data("finetune").base_model == "someone/tiny-llama"
    # A folder in a repo of several models: the Hub's base_model is the repo, the link goes to the folder.
    source = read_provenance("QwQZh/gated_attention/1B_gate_headwise", None)
    assert source.card_data("finetune").to_yaml() == "base_model: QwQZh/gated_attention\nbase_model_relation: finetune"
    assert "(https://huggingface.co/QwQZh/gated_attention/tree/main/1B_gate_headwise)" in source.base_model_line()


def test_a_cached_repo_is_read_offline_and_a_missing_one_says_why(tmp_path, monkeypatch):
    from huggingface_hub import constants

    commit = "0" * 40
    repo = tmp_path / "hub" / "models--someone--tiny"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    (repo / "snapshots" / commit).mkdir(parents=True)
    (repo / "snapshots" / commit / "config.json").write_text("{}")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)

    assert cached_or_downloaded("someone/tiny") == repo / "snapshots" / commit
    with pytest.raises(HubUnavailable, match=r"^not in the Hugging Face cache \(HF_HUB_OFFLINE is set\)$"):
        cached_or_downloaded("someone/other")


def test_a_folder_in_a_cached_repo_is_read_offline_and_a_missing_folder_says_so(tmp_path, monkeypatch):
    """The paper's repo holds three models, one folder each: `org/name/folder` is that folder of the cached snapshot."""
    from huggingface_hub import constants

    commit = "1" * 40
    repo = tmp_path / "hub" / "models--QwQZh--gated_attention"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    for model in ("1B_baseline", "1B_gate_headwise"):
        (repo / "snapshots" / commit / model).mkdir(parents=True)
        (repo / "snapshots" / commit / model / "config.json").write_text("{}")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)

    folder = cached_or_downloaded("QwQZh/gated_attention/1B_gate_headwise")
    assert folder == repo / "snapshots" / commit / "1B_gate_headwise"
    # offline, only the cache lacks it: the repo may well have it (it said "the repo has no folder")
    with pytest.raises(HubUnavailable, match=r"^not in the Hugging Face cache \(HF_HUB_OFFLINE is set\): its cached "
                                             r"snapshot of QwQZh/gated_attention has no folder 1B_gate_elementwise$"):
        cached_or_downloaded("QwQZh/gated_attention/1B_gate_elementwise")


def test_provenance_of_a_folder_in_a_cached_repo_by_id_and_by_path(tmp_path, monkeypatch):
    """The snapshot's path names the repo and the commit; the repo's own card, at its root, the license."""
    from huggingface_hub import constants

    from gated_attention.hub.provenance import cached_folder

    commit = "c" * 40
    repo = tmp_path / "hub" / "models--org--multi"
    snapshot = repo / "snapshots" / commit
    (snapshot / "sub").mkdir(parents=True)
    (snapshot / "sub" / "config.json").write_text("{}")
    (snapshot / "README.md").write_text("---\nlicense: other\nlicense_name: acme\nbase_model: x/y\n---\n")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))

    assert cached_folder("org/multi/sub") == snapshot / "sub"
    for name in ("org/multi/sub", str(snapshot / "sub")):
        source = read_provenance(name, snapshot / "sub")
        assert (source.base_model, source.subfolder, source.commit) == ("org/multi", "sub", commit)
        assert (source.license, source.license_name) == ("other", "acme")
    assert "license_name: acme" in source.card_data("finetune").to_yaml()


def test_a_partly_cached_folder_is_completed_from_the_hub_where_the_network_is_allowed(tmp_path, monkeypatch):
    """A folder cached with config.json alone (one file fetched by itself) was taken as it was; with the network
    allowed the Hub fills in what it lacks, and a whole cached folder is still read without asking."""
    import huggingface_hub
    from huggingface_hub import constants

    snapshot = tmp_path / "snapshot"
    (snapshot / "1B_gate_headwise").mkdir(parents=True)
    (snapshot / "1B_gate_headwise" / "config.json").write_text("{}")
    asked = []

    def snapshot_download(repo_id, *, local_files_only=False, allow_patterns=None, **kwargs):
        asked.append((local_files_only, allow_patterns))
        if not local_files_only:  # the Hub: the folder's other files
            (snapshot / "1B_gate_headwise" / "model.safetensors").write_bytes(b"")
        return str(snapshot)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    folder = cached_or_downloaded("QwQZh/gated_attention/1B_gate_headwise")
    assert folder == snapshot / "1B_gate_headwise" and (folder / "model.safetensors").is_file()
    assert asked == [(True, ["1B_gate_headwise/*"]), (False, ["1B_gate_headwise/*"])]
    asked.clear()
    assert cached_or_downloaded("QwQZh/gated_attention/1B_gate_headwise") == folder and asked == [(True, ["1B_gate_headwise/*"])]
