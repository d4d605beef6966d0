"""engram_model.v41: DeepSeek-V4.1's Engram (hash, FP8 rows, gate), tables in the store.

Public surface::

    V41Config                       geometry: primes, column offsets, multipliers, row bytes; from_hf_config()
    build_token_map                 tokenizer -> compressed token ids (save_token_map / load_token_map)
    decode_fp8_rows, encode_fp8_rows packed FP8 rows (e4m3 + e8m0 scale per 32 values) <-> bf16-exact float32
    V41Hasher, V41HashState         token ids -> rows of every layer's table; begin/step/copy for decode
"""

from ._config import V41Config
from ._fp8 import decode_fp8_rows, encode_fp8_rows
from ._hasher import V41Hasher, V41HashState
from ._tokens import build_token_map, check_token_map, load_token_map, save_token_map

__all__ = [
    "V41Config",
    "V41HashState",
    "V41Hasher",
    "build_token_map",
    "decode_fp8_rows",
    "encode_fp8_rows",
    "check_token_map",
    "load_token_map",
    "save_token_map",
]
