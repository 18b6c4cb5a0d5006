"""The transformers-version layer (`gated_attention.compat`).

CI runs the model, convert and remote-code tests a second time on the declared
floor release (see `.ci/run`); these tests check the layer's own promises on
whichever release is installed.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers.modeling_outputs import CausalLMOutputWithPast

from gated_attention import GatedAttentionConfig, GatedAttentionForCausalLM
from gated_attention.compat import (
    CACHE_NAME,
    SUPPORTED_TRANSFORMERS,
    TRANSFORMERS_FLOOR,
    cache_of,
    slice_logits_to_keep,
    with_cache,
)

REPO = Path(__file__).resolve().parents[1]


def test_declared_range_is_the_one_the_code_checks():
    pyproject = (REPO / "pyproject.toml").read_text()
    assert f'"{SUPPORTED_TRANSFORMERS}"' in pyproject, "pyproject.toml and compat.py must declare the same range"


def test_ci_runs_the_declared_floor():
    assert "tests/floor.sh" in (REPO / ".ci" / "run").read_text()
    assert (REPO / "tests" / "floor.sh").read_text().count(f'"transformers=={TRANSFORMERS_FLOOR}.0"') == 1


def test_outputs_carry_the_cache_under_the_installed_name():
    cache = object()
    out = with_cache(CausalLMOutputWithPast, cache, logits=torch.zeros(1))
    assert cache_of(out) is cache
    assert CACHE_NAME in CausalLMOutputWithPast.__dataclass_fields__


@pytest.mark.parametrize("keep", [0, 1, 3])
def test_slice_logits_to_keep(keep):
    h = torch.arange(2 * 5 * 4.0).view(2, 5, 4)
    expected = h if keep == 0 else h[:, -keep:]
    assert torch.equal(slice_logits_to_keep(h, keep), expected)
    assert torch.equal(slice_logits_to_keep(h, torch.tensor([0, 2])), h[:, [0, 2]])


def test_model_answers_to_both_cache_names():
    """`generate()` before 5.24 passes `past_key_values=`; from 5.24 on, `cache=`."""
    config = GatedAttentionConfig(
        vocab_size=53, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2
    )
    model = GatedAttentionForCausalLM(config).eval()
    ids = torch.randint(0, 53, (1, 7))
    with torch.no_grad():
        full = model(ids).logits
        for name in ("cache", "past_key_values"):
            first = model(ids[:, :4], use_cache=True)
            rest = model(ids[:, 4:], use_cache=True, **{name: cache_of(first)})
            torch.testing.assert_close(rest.logits, full[:, 4:], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("release", ["5.16.0", "5.26.0"], ids=["older", "newer"])
def test_remote_code_names_the_release_it_needs(release, tmp_path, run_without_package):
    """A Hub user on an unsupported transformers, older than the floor or past the tested ceiling, gets one line
    naming the range, not a TypeError mid-forward."""
    folder = tmp_path / "checkpoint"
    GatedAttentionForCausalLM(
        GatedAttentionConfig(vocab_size=53, hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=4)
    ).save_pretrained(folder)
    out = run_without_package(
        f"""
        import transformers
        transformers.__version__ = {release!r}  # stands in for another install: the check reads only the version
        from transformers import AutoModelForCausalLM
        try:
            AutoModelForCausalLM.from_pretrained({str(folder)!r}, trust_remote_code=True)
        except ImportError as e:
            print("refused:", e)
        """
    )
    message = out.strip().splitlines()[-1]
    assert message.startswith("refused:"), out
    assert SUPPORTED_TRANSFORMERS in message and release in message
    assert "pip install" in message
