"""kernels"""

from .gated_sdpa import gated_sdpa
