"""engram_model.v41: DeepSeek-V4.1's Engram (hash, FP8 rows, gate), tables in the store.

Public surface::

    V41Config                       geometry: primes, column offsets, multipliers, row bytes; from_hf_config()
    build_token_map                 tokenizer -> compressed token ids (save_token_map / load_token_map)
    decode_fp8_rows, encode_fp8_rows packed FP8 rows (e4m3 + e8m0 scale per 32 values) <-> bf16-exact float32
    V41Engram, V41Prefetch          one layer: FP8 table in an EngramStore (v41_store_config), fused gather+decode,
                                    gate; prefetch() reads in the background
    V41Hasher, V41HashState         token ids -> rows of every layer's table; begin/step/copy for decode
"""

from ._config import V41Config
from ._engram import V41Engram, V41Prefetch, v41_store_config
from ._fp8 import decode_fp8_rows, encode_fp8_rows
from ._hasher import V41Hasher, V41HashState
from ._tokens import build_token_map, check_token_map, load_token_map, save_token_map

__all__ = [
    "V41Config",
    "V41Engram",
    "V41HashState",
    "V41Hasher",
    "V41Prefetch",
    "build_token_map",
    "decode_fp8_rows",
    "encode_fp8_rows",
    "check_token_map",
    "load_token_map",
    "save_token_map",
    "v41_store_config",
]
