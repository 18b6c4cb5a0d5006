"""`--push-to-hub REPO_ID [--private]` and `save_pretrained(push_to_hub=True)`, offline: huggingface_hub's
`HfApi` is replaced in-process, so the tests see which calls are made, with which files and flags, and
what a failed push leaves on disk."""

from __future__ import annotations

import pytest
import torch
from huggingface_hub import HfApi
from huggingface_hub.errors import HfHubHTTPError
from transformers import AutoModelForCausalLM

from convert_helpers import PROMPT, file_hashes, make_gated, make_source
from gated_attention.cli import main


def refused(message: str) -> HfHubHTTPError:
    """The error huggingface_hub raises for a refused request (its HTTP client is httpx2 from huggingface_hub
    2.x, httpx before)."""
    try:
        import httpx2 as http
    except ImportError:
        import httpx as http
    return HfHubHTTPError(message, response=http.Response(403, request=http.Request("POST", "https://huggingface.co")))


class FakeHub:
    """Records HfApi's calls; `fail` makes the upload raise as the Hub does on a refused token."""

    def __init__(self, fail: bool = False):
        self.calls, self.fail = [], fail

    def install(self, monkeypatch) -> FakeHub:
        hub = self

        def create_repo(api, repo_id, **kwargs):
            hub.calls.append(("create_repo", repo_id, kwargs))
            return type("RepoUrl", (), {"repo_id": repo_id})()

        def upload_folder(api, *, repo_id, folder_path, **kwargs):
            files = sorted(p.relative_to(folder_path).as_posix() for p in __import__("pathlib").Path(folder_path).rglob("*"))
            hub.calls.append(("upload_folder", repo_id, {**kwargs, "folder_path": str(folder_path), "files": files}))
            if hub.fail:
                raise refused("403 Forbidden: you do not have write access to me/tiny\nmore lines")
            return type("CommitInfo", (), {"commit_url": f"https://huggingface.co/{repo_id}/commit/abc"})()

        def create_commit(api, repo_id, operations, **kwargs):
            hub.calls.append(("create_commit", repo_id, {**kwargs, "files": sorted(op.path_in_repo for op in operations)}))
            return type("CommitInfo", (), {"commit_url": f"https://huggingface.co/{repo_id}/commit/abc"})()

        monkeypatch.setattr(HfApi, "create_repo", create_repo)
        monkeypatch.setattr(HfApi, "upload_folder", upload_folder)
        monkeypatch.setattr(HfApi, "create_commit", create_commit)
        return self


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    return make_source("llama", tmp_path_factory.mktemp("push") / "src")


def test_convert_pushes_the_verified_folder_in_one_commit(source, tmp_path, monkeypatch, capsys):
    hub = FakeHub().install(monkeypatch)
    dst = tmp_path / "dst"
    assert main(["convert", str(source), str(dst), "--push-to-hub", "me/tiny", "--private"]) == 0
    out = capsys.readouterr().out
    assert out.index("verify:") < out.index("wrote") < out.index("pushed")  # only after verification, DST in place
    (create, repo_id, flags), (upload, target, upload_flags) = hub.calls
    assert (create, repo_id, flags) == ("create_repo", "me/tiny", {"repo_type": "model", "private": True, "exist_ok": True})
    assert (upload, target, upload_flags["folder_path"]) == ("upload_folder", "me/tiny", str(dst))
    assert upload_flags["commit_message"] == f"Upload with `gated-attention convert {source}`"
    assert {"README.md", "config.json", "modeling_gated_attention.py"} <= set(upload_flags["files"])
    assert upload_flags["files"] == sorted(p.relative_to(dst).as_posix() for p in dst.rglob("*"))


def test_a_failed_push_is_one_line_and_leaves_dst_whole(source, tmp_path, monkeypatch, capsys):
    FakeHub(fail=True).install(monkeypatch)
    dst = tmp_path / "dst"
    assert main(["convert", str(source), str(dst), "--no-verify", "--push-to-hub", "me/tiny"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "403 Forbidden" in err and f"hf upload me/tiny {dst}" in err
    reference = AutoModelForCausalLM.from_pretrained(source).eval()
    result = AutoModelForCausalLM.from_pretrained(dst).eval()  # whole: it loads and gives the source's logits
    with torch.no_grad():
        assert torch.equal(reference(PROMPT).logits, result(PROMPT).logits)


@pytest.mark.parametrize("argv, message", [
    (["--private"], "--private applies to the repo --push-to-hub REPO_ID creates"),
    (["--push-to-hub", "me/bad..name"], "--push-to-hub me/bad..name: "),
])
def test_push_flags_are_checked_before_anything_is_written(source, tmp_path, monkeypatch, capsys, argv, message):
    hub = FakeHub().install(monkeypatch)
    hashes = file_hashes(source)
    assert main(["convert", str(source), str(tmp_path / "dst"), *argv]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "dst").exists() and hub.calls == [] and file_hashes(source) == hashes


def test_extend_pushes_too(source, tmp_path, monkeypatch):
    hub = FakeHub().install(monkeypatch)
    assert main(["convert", str(source), str(tmp_path / "gated"), "--no-verify"]) == 0
    assert main(["extend", str(tmp_path / "gated"), str(tmp_path / "long"), "--rope-theta", "20000", "--no-verify",
                 "--push-to-hub", "me/long"]) == 0
    assert [(name, repo) for name, repo, _ in hub.calls] == [("create_repo", "me/long"), ("upload_folder", "me/long")]
    assert "gated-attention extend" in hub.calls[1][2]["commit_message"]


def test_export_pushes_a_card_the_hub_reads(tmp_path, monkeypatch):
    """export's card, like convert's: parsed without a warning, its relation, a pinned revision; then pushed."""
    import json
    import warnings

    from huggingface_hub import ModelCard

    hub = FakeHub().install(monkeypatch)
    dst = tmp_path / "native"
    assert main(["export", str(make_gated(tmp_path / "gated")), str(dst), "--format", "qwen3_5",
                 "--push-to-hub", "me/native"]) == 0
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        card = ModelCard((dst / "README.md").read_text())
    assert card.data.base_model_relation == "finetune" and 'revision="COMMIT"' in card.text
    assert json.loads((dst / "config.json").read_text())["source_commit"] is None  # a plain folder has no commit
    assert hub.calls[1][2]["commit_message"].startswith("Upload with `gated-attention export ")


def test_save_pretrained_pushes_through_transformers_with_the_remote_code(tmp_path, monkeypatch):
    """transformers' own push: the repo created with its flags, and the remote-code files in the commit."""
    from huggingface_hub import ModelCard

    hub = FakeHub().install(monkeypatch)
    monkeypatch.setattr(ModelCard, "load", classmethod(lambda cls, *a, **k: (_ for _ in ()).throw(
        __import__("huggingface_hub").errors.EntryNotFoundError("no card"))))
    from gated_attention import GatedAttentionConfig, GatedAttentionForCausalLM

    config = GatedAttentionConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                  num_attention_heads=2, num_key_value_heads=1, head_dim=8)
    GatedAttentionForCausalLM(config).save_pretrained(tmp_path / "m", push_to_hub=True, repo_id="me/m", private=True,
                                                      commit_message="first")
    (create, repo_id, flags), (commit, target, commit_flags) = hub.calls
    assert (create, repo_id, flags["private"], commit, target) == ("create_repo", "me/m", True, "create_commit", "me/m")
    assert commit_flags["commit_message"] == "first"
    assert {"config.json", "model.safetensors", "modeling_gated_attention.py",
            "configuration_gated_attention.py"} <= set(commit_flags["files"])
