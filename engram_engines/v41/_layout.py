"""DeepSeek-V4.1's tables as an engine sees them: its config.json against the tables under ``ENGRAM_TABLES``.

An engine builds each Engram layer from the checkpoint's config.json (``engram_layer_ids``, ``engram_vocab_size``,
``engram_n_heads``, ``engram_head_dim``, ...). The tables must be that layout: every layer there, each column as
long as its prime, rows of ``head_dim + head_dim / 32`` bytes; and the engine's own layout (its primes, its table
size, its tensor-parallel split of the columns) must agree with engram's. Each disagreement stops the server at
start, naming the variable, the value and what was found.
"""

from __future__ import annotations

import re
from typing import Any, Sequence

from engram_model.v41 import V41Config, v41_store_config
from engram_store import EngramStore
from engram_store.errors import EngramError

from .._settings import TABLES, EngineSettings, ServingRefused, refused
from .._tables import table_dir

#: The fields of a V4.1 config.json (under text_config) that shape its tables and hash.
FIELDS = ("engram_layer_ids", "engram_max_ngram_size", "engram_n_heads", "engram_head_dim", "engram_vocab_size",
          "engram_compressed_vocab_size", "engram_pad_token_id", "engram_pad_id", "engram_num_embeddings",
          "hidden_size", "hc_mult", "rms_norm_eps")


#: The checkpoint's Engram tables, by their names in it (with or without ``model.``; scales by either name).
TABLE_WEIGHT = re.compile(r"(^|\.)layers\.(\d+)\.engram\.embed\.(weight|scale|weight_scale_inv)$")


def is_table_weight(name: str, layers: set[int]) -> bool:
    """Whether checkpoint tensor ``name`` is the Engram table of one of ``layers`` (what the loaders skip)."""
    m = TABLE_WEIGHT.search(name)
    return bool(m) and int(m.group(2)) in layers


def config_of(engine_config: Any, source: str) -> V41Config:
    """The :class:`V41Config` of an engine's text config object (a transformers ``PretrainedConfig`` or anything
    with the ``engram_*`` attributes); ``source`` names it in a refusal."""
    fields = {name: getattr(engine_config, name) for name in FIELDS if getattr(engine_config, name, None) is not None}
    fields.setdefault("rms_norm_eps", 1e-20)  # not a table field; engines keep it elsewhere at times
    try:
        return V41Config.from_hf_config(fields)
    except EngramError as exc:
        raise ServingRefused(f"{source}: {exc}") from None


def open_layer(settings: EngineSettings, config: V41Config, layer_id: int, source: str) -> EngramStore:
    """Layer ``layer_id``'s table under ``ENGRAM_TABLES``, after checking that every Engram layer of ``config`` is
    there and that this one has ``config``'s layout."""
    tables = table_dir(settings)
    tables.require(list(config.layer_ids), source)
    return tables.open(layer_id, v41_store_config(config, layer_id), source)


def check_engine_layout(config: V41Config, layer_id: int, head_sizes: Sequence[int], num_embeddings: int,
                        source: str) -> None:
    """Refuse when the engine's own layout of a layer (its column sizes, its table's rows) is not engram's."""
    primes = [p for order in config.primes(layer_id) for p in order]
    if list(head_sizes) != primes or int(num_embeddings) != config.num_embeddings(layer_id):
        raise ServingRefused(f"{source}: the engine lays layer {layer_id} out as {len(head_sizes)} columns of "
                             f"{list(head_sizes)[:3]}... rows ({num_embeddings} in all), engram as {len(primes)} of "
                             f"{primes[:3]}... ({config.num_embeddings(layer_id)}): another prime search or config")


def check_split(config: V41Config, layer_id: int, head_start: int, part: int, shards: int,
                settings: EngineSettings) -> None:
    """Refuse a tensor-parallel split whose shard reads no column, or columns the table lacks."""
    cols = config.cols
    if head_start >= cols or part < 1:
        raise refused(TABLES, settings.tables, f"layer {layer_id} has {cols} columns (engram_n_heads x orders); a "
                                               f"split over {shards} ranks leaves this rank columns {head_start}.."
                                               f"{head_start + part - 1}, none of them: use at most {cols} ranks")
