"""DeepSeek-V4.1 in the serving engines: what is particular to its Engram tables.

    config_of, open_layer       the engine's config.json as a V41Config; a layer's table, checked against it
    check_engine_layout         the engine's own layout (primes, table size) against engram's
    LayerReader                 one layer for an engine module: host gathers (timed) and the GPU's in-place read
    HostSteps                   a step's ids to the host once, each layer gathered behind the one before

The engines' patches: :mod:`._vllm` (vLLM 0.33.0) and :mod:`._sglang` (SGLang 0.5.23); the Triton kernels that
give a GPU vLLM's rows bit for bit: :mod:`._triton` (imported by the patches only: it needs torch and Triton).
"""

from ._layout import check_engine_layout, config_of, open_layer
from ._reader import LayerReader
from ._steps import HostSteps, ModelLayer

__all__ = ["HostSteps", "LayerReader", "ModelLayer", "check_engine_layout", "config_of", "open_layer"]
