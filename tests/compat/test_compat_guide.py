"""docs/mooncake-compat.md names every method of Mooncake's store reference and every method offered here.

Its python blocks run in tests/test_docs.py; this holds its method table to both APIs, so a method added on
either side without a row in the guide fails here.
"""
from __future__ import annotations

import re

from compat_helpers import REPO

from engram_store.compat import MooncakeDistributedStore

#: The methods of ``MooncakeDistributedStore`` in Mooncake's Python API reference (docs/source/api-reference/
#: python/mooncake-store.md of kvcache-ai/Mooncake).
MOONCAKE_REFERENCE = """
setup setup_dummy init_all get_hostname close register_buffer unregister_buffer alloc_from_mem_pool
put put_from put_parts put_batch batch_put_from put_from_with_metadata batch_put_from_multi_buffers
upsert upsert_from upsert_parts upsert_batch batch_upsert_from
get get_batch get_buffer batch_get_buffer get_into batch_get_into get_into_ranges batch_get_into_multi_buffers
batch_get_session_start batch_get_into_multi_buffer_ranges batch_get_session_end
batch_put_session_start batch_put_from_multi_buffer_ranges batch_put_session_end batch_put_session_revoke
is_exist batch_is_exist get_size remove batch_remove remove_all remove_by_regex
mount_segment unmount_segment allocate_and_mount_segment unmount_and_free_segment
get_replica_desc batch_get_replica_desc create_copy_task create_move_task query_task
put_tensor get_tensor batch_put_tensor batch_get_tensor pub_tensor batch_pub_tensor get_tensor_into
batch_get_tensor_into put_tensor_from batch_put_tensor_from upsert_tensor batch_upsert_tensor upsert_pub_tensor
batch_upsert_pub_tensor upsert_tensor_from batch_upsert_tensor_from
put_tensor_with_tp pub_tensor_with_tp get_tensor_with_tp batch_put_tensor_with_tp batch_pub_tensor_with_tp
batch_get_tensor_with_tp get_tensor_with_tp_into batch_get_tensor_with_tp_into put_tensor_with_tp_from
batch_put_tensor_with_tp_from
put_tensor_with_parallelism batch_put_tensor_with_parallelism get_tensor_with_parallelism
batch_get_tensor_with_parallelism get_tensor_with_parallelism_into batch_get_tensor_with_parallelism_into
upsert_tensor_with_parallelism batch_upsert_tensor_with_parallelism
""".split()


def _table_names() -> set[str]:
    """The method names in the first column of the guide's method table."""
    with open(f"{REPO}/docs/mooncake-compat.md", encoding="utf-8") as f:
        text = f.read()
    table = text[text.index("## The store, method by method"):text.index("## ReplicateConfig")]
    names = set()
    for row in re.findall(r"^\| (.*?) \|", table, flags=re.M):
        names.update(re.findall(r"`([a-z_]+)[(`]", row))
    return names


def test_the_guide_has_a_row_for_every_method_of_mooncakes_reference():
    missing = sorted(set(MOONCAKE_REFERENCE) - _table_names())
    assert not missing, f"docs/mooncake-compat.md has no row for {missing}"


def test_the_guide_has_a_row_for_every_method_offered_here():
    offered = {name for name in dir(MooncakeDistributedStore) if not name.startswith("_") and
               callable(getattr(MooncakeDistributedStore, name))}
    missing = sorted(offered - _table_names())
    assert not missing, f"docs/mooncake-compat.md has no row for {missing}"
