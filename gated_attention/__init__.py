"""gated-attention: gated softmax attention and hybrid Gated DeltaNet models for transformers.

Importing the package registers its configs and models with AutoConfig,
AutoModel and AutoModelForCausalLM.
"""

from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

from .configuration.gate_spec import DEFAULT_GATE_SPEC, normalize_gate_spec
from .configuration.gated_attention import GatedAttentionConfig
from .configuration.gated_attention_moe import GatedAttentionMoeConfig
from .configuration.gated_deltanet_hybrid import GatedDeltaNetHybridConfig
from .modeling.gated_attention import GatedAttentionForCausalLM, GatedAttentionModel
from .modeling.gated_attention_moe import GatedAttentionMoeForCausalLM, GatedAttentionMoeModel
from .modeling.gated_deltanet_hybrid import GatedDeltaNetHybridForCausalLM, GatedDeltaNetHybridModel
from .modeling.load_balancing import GlobalLoadBalancer

__version__ = "0.1.0"

_REGISTRY = [
    (GatedAttentionConfig, GatedAttentionModel, GatedAttentionForCausalLM),
    (GatedAttentionMoeConfig, GatedAttentionMoeModel, GatedAttentionMoeForCausalLM),
    (GatedDeltaNetHybridConfig, GatedDeltaNetHybridModel, GatedDeltaNetHybridForCausalLM),
]
for _config, _model, _causal_lm in _REGISTRY:
    AutoConfig.register(_config.model_type, _config, exist_ok=True)
    AutoModel.register(_config, _model, exist_ok=True)
    AutoModelForCausalLM.register(_config, _causal_lm, exist_ok=True)

__all__ = [
    "DEFAULT_GATE_SPEC",
    "GatedAttentionConfig",
    "GatedAttentionForCausalLM",
    "GatedAttentionModel",
    "GatedAttentionMoeConfig",
    "GatedAttentionMoeForCausalLM",
    "GatedAttentionMoeModel",
    "GatedDeltaNetHybridConfig",
    "GatedDeltaNetHybridForCausalLM",
    "GatedDeltaNetHybridModel",
    "GlobalLoadBalancer",
    "normalize_gate_spec",
]
