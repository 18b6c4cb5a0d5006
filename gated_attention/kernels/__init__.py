"""kernels"""

from .gated_delta_rule import gated_delta_rule
from .gated_sdpa import gated_sdpa
