"""What ``tests/mutate.py`` mutates, and with which tests: the guards of the contract, the tests that cover each
module, the mutants written by hand, and the mutants known to be equivalent (with the reason).

Tests are listed fastest first: a run stops at the first failure (``-x``), so a killed mutant costs little. A
module's list names the tests that exist to catch a broken guard of it, not every test that happens to pass
through it; the whole suite is the last resort, not the measure. The checked wrappers' type checks (a dtype, a
shape) are left out: they guard arguments, not the contract's rows and objects, and ``tests/kernels`` holds them.
"""
from __future__ import annotations

from typing import NamedTuple


class Target(NamedTuple):
    path: str                   # the module, relative to the repository
    functions: tuple[str, ...]  # "function" or "Class.method"
    tests: tuple[str, ...]      # pytest arguments, relative to the repository


DISK_TESTS = ("tests/disk/test_disk_kernels.py", "tests/disk/test_cache_guards.py", "tests/disk/test_disk_read.py",
              "tests/disk/test_host_cache.py")
GENERATION_TESTS = ("tests/store/test_generations.py", "tests/store/test_raw_io.py")
MASTER_TESTS = ("tests/master/test_master_journal.py", "tests/master/test_master_state.py")
PLANNING_TESTS = ("tests/kernels/test_planning.py", "tests/kernels/test_kernels.py", "tests/store/test_raw_io.py")
CHURN = "tests/faults/test_churn_reads.py::test_"
MAPPED_TESTS = ("tests/store/test_mapped_reads.py",
                f"{CHURN}lookups_and_local_copies_cut_off_from_the_master_never_read_what_took_the_space")
PLACEMENT_TESTS = ("tests/store/test_read_matrix.py", "tests/faults/test_at_rest.py::test_a_reader_cut_off_from_the_"
                   "master_never_reads_a_layer_written_where_a_restarted_segment_held_its_own",
                   "tests/faults/test_segment_files.py::test_a_durable_segments_file_cut_short_at_rest_is_never_read_"
                   "past_its_end_where_it_is_mapped")
V41_TESTS = ("tests/model/test_v41_rows.py::test_every_table_kind_gives_the_engines_rows",
             f"{CHURN}v41_rows_cut_off_from_the_master_never_read_the_layer_written_in_its_space",
             "tests/model/test_v41_rows.py")
PLE_BOUND = "tests/model/test_ple_rows.py::test_a_bound_buffer_"
HELD_TESTS = ("tests/model/test_rows_gather_span.py",
              f"{PLE_BOUND}over_tables_of_this_process_is_one_kernel_call_until_they_close",
              f"{PLE_BOUND}gives_what_gather_into_gives", "tests/model/test_v41_rows_bind.py")
CACHE_TESTS = (f"{CHURN}a_row_cache_filled_while_the_layer_is_written_again_never_serves_the_earlier_rows",
               *(f"tests/tables/test_engram_store.py::test_row_cache_{name}" for name in (
                   "returns_the_same_rows_and_counts_hits", "serves_repeats_without_requests_and_forgets_a_repopulated_"
                   "layer")))

TARGETS = [
    # the master's replay and fencing
    Target("engram_store/master/_replay.py", ("Replay.replay", "Replay._free_replicas", "Replay._quarantine_replayed",
                                 "Replay._replay_object"), MASTER_TESTS),
    Target("engram_store/master/_fencing.py", ("Fencing._end_registration", "Fencing._report_held", "Fencing._reserved_by_fence",
                                  "Fencing._fence", "Fencing._fence_acknowledged", "Fencing._forget_settled_fences",
                                  "Fencing.fencing_bytes"), MASTER_TESTS),
    Target("engram_store/master/_state.py", ("MasterState.heartbeat", "MasterState.take_put_id"), MASTER_TESTS),
    # objects a segment found damaged: dropped, and lost where it was the last replica, in one journal record
    Target("engram_store/master/_repairs.py", ("Repairs.drop_damaged",), MASTER_TESTS + ("tests/faults/test_at_rest.py",)),
    # the segment's fence
    Target("engram_store/segment/_fence.py",
           ("WriteFence.new_registration", "WriteFence._admit", "WriteFence.check", "WriteFence.ticket_of",
            "WriteFence.open_direct", "WriteFence.close_direct", "WriteFence.fence", "WriteFence.heartbeat_fields",
            "WriteFence.acknowledged"), ("tests/store/test_fence.py", "tests/faults/test_fencing.py")),
    # generations, on the segment's side and in the kernels both sides share, and the client's read checks
    Target("engram_store/segment/_generations.py",
           ("Generations.claim", "Generations.drop", "Generations.holds", "Generations.seed", "Generations._publish",
            "Generations.split", "Generations.recheck"), GENERATION_TESTS),
    Target("engram_store/kernels/_generations.py", ("_check_generations", "check_generations", "check_pairs_for"),
           GENERATION_TESTS),
    Target("engram_store/kernels/_generations_table.py", ("_check_table",), GENERATION_TESTS),
    Target("engram_store/client/_reads.py", ("ReadPath._read_remote", "reply_bytes", "with_checks"),
           ("tests/store/test_generations.py", *(f"tests/store/test_store.py::test_{name}" for name in (
               "put_get_roundtrip_random_sizes", "get_into_ranges_equals_numpy_slicing",
               "remote_reads_split_at_the_reply_limit_land_where_numpy_slicing_puts_them",
               "get_fails_over_to_second_replica_before_master_notices")))),
    # reads of mapped memory: the one rule (client.read_mapped), a placement's age guard and checks, the store row
    # cache's placement tag, and V4.1's engine reads through it
    Target("engram_store/client/_mapped.py", ("read_mapped", "_check", "object_checks"), MAPPED_TESTS),
    # (Placements.get and resolve decide how often a placement is checked with the master, not what may be read:
    # read_mapped refuses what a stale placement maps, however it was kept)
    Target("engram_store/tables/_placement.py",
           ("Placements.local_safe_s", "Placements.read_mapped", "Placements.gather", "Placements._build"),
           MAPPED_TESTS + PLACEMENT_TESTS),
    Target("engram_store/tables/_source_store.py",
           ("StoreSource.read_local", "StoreSource._clear_cache", "_RowCache.probe", "_RowCache.fill",
            "_RowCache.clear"), MAPPED_TESTS + CACHE_TESTS + V41_TESTS),
    Target("engram_model/v41/_rows.py", ("V41Rows._run",), V41_TESTS),
    # a populate whose publish raised: the manifest naming its heads goes first, another writer's stays
    Target("engram_store/tables/_keyed.py", ("KeyedSource.undo_failed_publish", "_names_heads"),
           ("tests/tables/test_engram_store.py::test_a_populate_interrupted_while_its_manifest_is_put_leaves_no_"
            "manifest_without_heads", "tests/store/test_remove.py::test_a_populate_that_cannot_publish_undoes_its_"
            "own_heads_and_never_another_writers")),
    # a layer's heads against its manifest: a head of another populate is refused, never read (seed 977060)
    Target("engram_store/tables/_manifest.py", ("check_heads",),
           ("tests/tables/test_engram_store.py::test_a_layer_whose_head_is_not_the_table_its_manifest_names_is_"
            "refused_never_read_mixed",)),
    Target("engram_store/tables/_placement.py", ("Placements._check_heads",),
           ("tests/tables/test_engram_store.py::test_a_layer_whose_head_is_not_the_table_its_manifest_names_is_"
            "refused_never_read_mixed", "tests/tables/test_engram_store.py::test_a_layer_written_again_while_a_"
            "reader_checks_it_is_read_whole_from_the_new_populate")),
    Target("engram_model/_rows_gather.py", ("RowGather.gather", "RowGather.in_memory", "RowGather._span_over",
                                            "RowGather.held"),
           V41_TESTS + HELD_TESTS),
    # the gathers' own id check, folded into a decode step's one kernel (nothing written for a bad id)
    Target("engram_model/_rows_gather_kernels.py", ("first_bad", "checked_rows_from_span", "plan_window"), HELD_TESTS),
    # tables this process holds (bind_local, local_dir): read by the kernel alone while they hold
    Target("engram_store/tables/_source.py", ("HeldTables.holds",), HELD_TESTS),
    Target("engram_store/tables/_source_memory.py", ("ArraySource.held_tables",), HELD_TESTS),
    # V4.1's ragged decode state
    Target("engram_model/v41/_hasher.py",
           ("V41Hasher.step_ragged", "V41Hasher.commit", "V41Hasher._ragged", "V41Hasher._ragged_refused"),
           ("tests/model/test_v41_ragged.py",)),
    Target("engram_model/_ngram.py", ("ragged_arguments", "ragged_refused"), ("tests/model/test_v41_ragged.py",)),
    Target("engram_model/v41/_kernels.py", ("hash_ragged",), ("tests/model/test_v41_ragged.py",)),
    Target("engram_model/_ngram_kernels.py", ("ragged_refusal",), ("tests/model/test_v41_ragged.py",)),
    # read planning
    Target("engram_store/kernels/_planning.py",
           ("_check_ranges", "_pairs_total", "_plan_pieces", "plan_pieces", "_first_bad_row", "_plan_unique_rows",
            "_rows_to_ranges", "_plan_reads", "plan_reads", "_direct_pairs"), PLANNING_TESTS),
    Target("engram_store/kernels/_sort.py", ("_sort_positions", "_minus_ones"), PLANNING_TESTS),
    Target("engram_store/kernels/raw_io.py", ("_direct_request", "direct_read_plan"), PLANNING_TESTS),
    # the hot-row cache (a process's and the host's) and its kernels: a busy set is never read, a half-written
    # row never served, a dead writer's set repaired, a layer's keys never meet another's (last: each mutant
    # recompiles the disk tier's kernels, and the host cache's tests start processes)
    Target("engram_store/disk/_host_cache.py", ("HostRowCache.new_tag", "HostRowCache.fill", "HostRowCache._repair"),
           ("tests/disk/test_cache_guards.py", "tests/disk/test_host_cache.py",
            "tests/disk/test_host_cache_leaving.py")),
    Target("engram_store/disk/_cache_kernels.py",
           ("_find", "_clock_victim", "_replace", "_cache_fill", "_cache_pin", "_cache_repair"), DISK_TESTS),
    Target("engram_store/disk/_kernels.py", ("_find_way", "_probe_all", "_first_bad", "_serve_hits", "_plan_read",
                                             "_mark_used"),
           DISK_TESTS),
]

#: Mutants written by hand: ``(path, function, text, replacement, what it breaks)``. The first five were found by
#: hand before this tool existed; each has a test that kills it.
HAND = [
    ("engram_store/disk/_kernels.py", "_probe_all", "if way < WAYS and not (version & BUSY):", "if way < WAYS:",
     "a busy set's rows are served"),
    ("engram_store/client/_reads.py", "ReadPath._read_remote",
     "named.add((replica.offset, info.size, replica.generation))", "named.add((replica.offset, info.size, 0))",
     "remote reads name no generation"),
    ("engram_store/master/_replay.py", "Replay.replay", "*(g + 1 for g in generations)", "*(g for g in generations)",
     "put ids repeat after a replay"),
    ("engram_store/segment/_fence.py", "WriteFence._admit", "if fields[0] in self._fenced:",
     "if fields[0] in self._acks:", "a fenced put writes again once its fence is acknowledged"),
    ("engram_store/segment/_fence.py", "WriteFence.check", "offset + nbytes > start + size", "offset > start + size",
     "a write runs past its ticket's range"),
]

#: Why a plan's first row of a head never continues a range: rows are never negative (lookups refuse other ids
#: before they plan: first_bad_row), so the sentinel before a head's first row (-2) is no row's predecessor.
NON_NEGATIVE_ROWS = ("a head's first row starts a range whatever the guard: the sentinel before it (-2, or -3) is no "
                     "non-negative row's predecessor, and lookups refuse negative ids before they plan")
CONTINUES = "r >= 0 and range_head[r] == j and row == prev + 1"  # _rows_to_ranges: the row continues the range
RESHAPE = "NumPy's reshape takes any negative size as the one size it works out"
#: Why CLOCK always finds a victim where the cache kernels guard against none.
ONE_UNPINNED = "redundant (see the comment beside it): pin() leaves a way of every set unpinned, so CLOCK finds a victim"

#: Why V41Rows' memory path never meets tables that are not C-contiguous: EngramStore.local_tables gives each head's
#: table as a reshape of a flat read-only view (InMemory.views), for every source with tables here.
CONTIGUOUS = ("redundant (see the comment beside it): every table local_tables gives is C-contiguous (a reshape of a "
              "flat view, InMemory.views), so the memory path is taken whatever the guard says")
SPAN_GUARD = "tables is not self._span_of and not all(t.flags.c_contiguous for t in tables)"

#: Why RowGather.held may drop its kept tables: it is a shortcut; asked again, the source gives the same held tables
#: and _span_over the span it built over them (keyed on the list's identity), so every read is the same.
HELD_AGAIN = "a shortcut: asked again, held_tables gives the same tables and _span_over the same span"

#: Mutants that change nothing a caller can observe: ``(path, function, old, new) -> why``, or with the code of the
#: line the change is on (no indentation, no comment) as a fifth item where the same change occurs twice in a
#: function. Not run.
EQUIVALENT: dict[tuple[str, ...], str] = {
    # a layer's heads against its manifest: the bounds guard a manifest made by hand (manifest.check has compared
    # its head sizes first, so it records a checksum a head; the store's checksums come one a key of the layer)
    ("engram_store/tables/_manifest.py", "check_heads",
     'record.get("checksum") != "xxh3_64" or not isinstance(recorded, list)', "record.get('checksum') != 'xxh3_64'"):
        "every manifest engram writes has a list of checksums; the guard is for one made by hand",
    ("engram_store/tables/_manifest.py", "check_heads", "0 <= h < len(recorded)", "0 <= h <= len(recorded)"):
        "a manifest engram writes records a checksum for every head",
    ("engram_store/tables/_manifest.py", "check_heads", "j < len(stored)", "j <= len(stored)"):
        "the store's checksums are located one a key of the layer",
    ("engram_store/tables/_placement.py", "Placements._check_heads", "False", "True"):
        "a lease taken by the second look only holds a writer's remove back for its time to live; the heads located and "
        "checked are the same",
    # tables this process holds
    ("engram_model/_rows_gather.py", "RowGather.held", "held is not None and held[0].holds()", "False"): HELD_AGAIN,
    ("engram_model/_rows_gather.py", "RowGather.held",
     "tables is None or not all(t.flags.c_contiguous for t in tables.tables)", "tables is None"): CONTIGUOUS,
    # the one rule of mapped reads: whether the proof of time holds at the very instant it ends decides nothing (a
    # reuse delay is 2 s by default; half of it is the margin), and monotonic clocks are never read twice alike
    ("engram_store/client/_mapped.py", "read_mapped", "time.monotonic() < fresh_until",
     "time.monotonic() <= fresh_until"): "the instant the proof ends: either side of it is half a reuse delay "
                                         "inside the delay",
    ("engram_store/client/_mapped.py", "read_mapped", "time.monotonic() >= fresh_until",
     "time.monotonic() > fresh_until"): "the instant the proof ends: either side of it is half a reuse delay "
                                        "inside the delay",
    # the master's replay
    ("engram_store/master/_replay.py", "Replay._quarantine_replayed", "self.reuse_delay_s <= 0", "False"):
        "with no reuse delay what it quarantines is due at once, and put_start frees what is due before it allocates",
    ("engram_store/master/_replay.py", "Replay._quarantine_replayed", "self.reuse_delay_s <= 0", "self.reuse_delay_s < 0"):
        "with no reuse delay what it quarantines is due at once, and put_start frees what is due before it allocates",
    ("engram_store/master/_replay.py", "Replay._quarantine_replayed", "lo < hi", "lo <= hi"):
        "an empty overlap reserves, quarantines and later frees 0 bytes: the allocator takes each as a no-op",
    **{("engram_store/master/_repairs.py", "Repairs.drop_damaged", "segment is None or not damaged", new):
       "redundant (see the comment beside it): with nothing damaged the loop does nothing, and dropping a segment "
       "takes its replicas out of every object, so no entry finds one there"
       for new in ("False", "segment is None and (not damaged)", "not damaged", "segment is None")},
    # the master's fencing
    ("engram_store/master/_fencing.py", "Fencing._end_registration", "segment.fences.clear()", "pass"):
        "the ids left go out with the next heartbeat reply; the segment applies and acknowledges them, and "
        "heartbeat() drops them (their fences were settled here already)",
    ("engram_store/master/_fencing.py", "Fencing._reserved_by_fence", "f.waiting.get(segment_id) == offset and f.size == size",
     "f.waiting.get(segment_id) == offset"):
        "a held range is always one put's whole ticket range, and a fence waiting at that offset of that segment is "
        "that put's (fenced space is not placed again), so the sizes are equal",
    ("engram_store/master/_fencing.py", "Fencing._fence", "segment is None", "False"):
        "redundant (see the comment beside it): dropping a segment takes its replicas out of pending puts first",
    ("engram_store/master/_fencing.py", "Fencing._fence", "replica.segment_id in settled or not meta.size",
     "replica.segment_id in settled"):
        "a put of 0 bytes holds no space: fencing it only waits for an acknowledgement that frees 0 bytes",
    ("engram_store/master/_fencing.py", "Fencing._fence_acknowledged", "fence is None", "False"):
        "redundant (see the comment beside it): a put id in a segment's fences always has a fence waiting on it",
    ("engram_store/master/_fencing.py", "Fencing._fence_acknowledged",
     "held is not None and (offset, fence.size) in {(int(o), int(n)) for o, n in held}", "held is not None"):
        "redundant (see the comment beside it): heartbeat() reports the same list next, which frees a range it lacks",
    ("engram_store/master/_fencing.py", "Fencing._fence_acknowledged", "(offset, fence.size) in {(int(o), int(n)) for o, n in held}",
     "(offset, fence.size) not in {(int(o), int(n)) for o, n in held}"):
        "heartbeat() reports the same list next: a listed range freed here is reserved again as held there, an "
        "unlisted one kept here is freed there",
    # the segment's fence
    ("engram_store/segment/_fence.py", "WriteFence.new_registration", "self._fenced.clear()", "pass"):
        "put ids never repeat (a new master starts at a random point, a replayed one past every id its journal "
        "names): a put fenced under an earlier key never comes back with a ticket of this one",
    ("engram_store/segment/_fence.py", "WriteFence.new_registration", "self._acks.clear()", "pass"):
        "the acknowledgements left reach the master with the next heartbeat, which drops put ids it is not waiting "
        "on (it settled this segment's fences when it registered again)",
    ("engram_store/segment/_fence.py", "WriteFence.new_registration", "True", "False"):
        "redundant (see the comment beside it): each check of a writer compares its registration too",
    ("engram_store/segment/_fence.py", "WriteFence.close_direct",
     "writer is None or writer.fenced or writer.registration != self.registration or writer.put_id in self._fenced",
     "writer is None or writer.registration != self.registration or writer.put_id in self._fenced"):
        "redundant (see the comment beside it)",
    ("engram_store/segment/_fence.py", "WriteFence.close_direct",
     "writer is None or writer.fenced or writer.registration != self.registration or writer.put_id in self._fenced",
     "writer is None or writer.fenced or writer.put_id in self._fenced"):
        "redundant (see the comment beside it)",
    ("engram_store/segment/_fence.py", "WriteFence.close_direct",
     "writer is None or writer.fenced or writer.registration != self.registration or writer.put_id in self._fenced",
     "writer is None or writer.fenced or writer.registration != self.registration"):
        "redundant (see the comment beside it)",
    ("engram_store/segment/_fence.py", "WriteFence.fence",
     "writer.put_id == put_id and writer.registration == self.registration", "writer.put_id == put_id"):
        "a writer opened under an earlier registration was marked fenced when the registration changed",
    ("engram_store/segment/_fence.py", "WriteFence.heartbeat_fields",
     "writer.fenced or writer.registration != self.registration", "writer.fenced"):
        "a writer opened under an earlier registration was marked fenced when the registration changed",
    # the segment's generations
    ("engram_store/segment/_generations.py", "Generations.drop", "generation > 0", "generation >= 0"):
        "no entry is of put 0 (claim and seed skip it), so a drop naming 0 marks nothing either way",
    ("engram_store/segment/_generations.py", "Generations._publish", "1", "2",
     "table[OVERFLOW], table[COUNT] = 1, 0"):
        "readers take any non-zero overflow word as overflowed",
    ("engram_store/segment/_generations.py", "Generations._publish", "0", "1",
     "table[OVERFLOW], table[COUNT] = 1, 0"):
        "readers test the overflow word first and read no entry of an overflowed table",
    ("engram_store/segment/_generations.py", "Generations.recheck", "self.version == version", "False"):
        "the second check is made even when no claim came meanwhile, and answers as the first did",
    # the check kernels
    **{("engram_store/kernels/_generations.py", "check_generations", "pairs.shape[0] == 0 or pairs[0, 0] >= 0", new):
       "a fast path: for a read that names no object the kernel finds no leading check either and answers (0, -1)"
       for new in ("False", "pairs.shape[0] == 0 and pairs[0, 0] >= 0", "pairs[0, 0] >= 0", "pairs.shape[0] == 0")},
    ("engram_store/kernels/_generations.py", "check_generations", "pairs[0, 0] >= 0", "pairs[0, 0] > 0"):
        "a fast path: for a read that names no object the kernel finds no leading check either and answers (0, -1)",
    ("engram_store/kernels/_generations_table.py", "_check_table", "1000", "1001"):
        "how long a reader waits out a writer (a few microseconds are held odd): one spin more changes nothing",
    ("engram_store/kernels/_generations_table.py", "_check_table", "1", "2", "return UNKNOWN, -1"):
        "callers read no seq with an UNKNOWN answer",
    # read planning
    **{("engram_store/kernels/_planning.py", function, "o < 0 or n < 0 or o > limit or n > limit - o",
        "o < 0 or n < 0 or n > limit - o"): "redundant (see the comment beside it): n >= 0 > limit - o then"
       for function in ("_check_ranges", "_pairs_total")},
    **{("engram_store/kernels/_planning.py", function, old, new):
       "scratch room: the sort indexes counts by its own digit width (8 or 11 bits); a larger array's extra counts "
       "stay 0" for function in ("_plan_unique_rows", "_plan_reads") for old, new in (("8", "9"), ("11", "12"))},
    **{("engram_store/kernels/_planning.py", function, old, new): NON_NEGATIVE_ROWS for function, old, new in (
        ("_rows_to_ranges", "2", "3"),
        ("_rows_to_ranges", CONTINUES, "range_head[r] == j and row == prev + 1"),
        ("_rows_to_ranges", CONTINUES, "r >= 0 and row == prev + 1"),
        ("_plan_reads", "2", "3"),
        ("_plan_reads", "i == 0 or v != last", "v != last"),
        ("_plan_reads", "r > first and v == last + 1", "v == last + 1"),
        ("_plan_reads", "r > first", "r >= first"))},
    ("engram_store/kernels/raw_io.py", "_direct_request", "2", "3", "return -2"):
        "read_direct_unchecked answers NO_ROOM for -1 and BAD_ID for any other negative count",
    ("engram_store/kernels/raw_io.py", "direct_read_plan", "1", "2",
     "checks = np.ascontiguousarray(checks, dtype=np.int64).reshape(-1, PAIR_WORDS)"):
        RESHAPE,
    ("engram_store/kernels/raw_io.py", "direct_read_plan", "1", "2",
     "return np.concatenate(([order.size, checks.shape[0]], order, bases, limits, "
     "checks.reshape(-1))).astype(np.int64)"):
        RESHAPE,
    # the host's hot-row cache
    ("engram_store/disk/_host_cache.py", "HostRowCache.new_tag", "1", "2",
     "reg = self._header[H_REGISTRY:H_REGISTRY + 2 * REGISTRY_ENTRIES].reshape(-1, 2)"):
        RESHAPE,
    ("engram_store/disk/_host_cache.py", "HostRowCache.new_tag", "identity and free.size", "free.size"):
        "an entry of identity 0 reads as free: no lookup asks for identity 0, and the next identity takes the slot",
    ("engram_store/disk/_host_cache.py", "HostRowCache._repair", "1", "2", "self.journal[0] = -1"):
        "the journal reads any negative as no set being written",
    # the hot-row cache's kernels
    ("engram_store/disk/_cache_kernels.py", "_find", "1", "2", "empty = -1"):
        "callers take any negative as no empty way",
    ("engram_store/disk/_cache_kernels.py", "_find", "1", "2", "return -1, empty"):
        "callers take any negative as not found",
    ("engram_store/disk/_cache_kernels.py", "_clock_victim", "1", "2", "return -1"):
        "callers take any negative as no victim",
    ("engram_store/disk/_cache_kernels.py", "_clock_victim", "pins == REF_MASK", "False"):
        ONE_UNPINNED,
    ("engram_store/disk/_cache_kernels.py", "_clock_victim", "2 * WAYS + 1", "2 * WAYS"):
        "the longest sweep (one unpinned way, marked used, just behind the hand) stops on its 2 * WAYS-th step",
    ("engram_store/disk/_cache_kernels.py", "_cache_pin", "way < 0", "False", "if way < 0:"):
        "redundant (see the comment beside it): fewer than max_pinned <= WAYS - 1 ways are pinned here, so CLOCK "
        "finds a victim",
    ("engram_store/disk/_cache_kernels.py", "_cache_fill", "way < 0", "False", "if way < 0:"):
        ONE_UNPINNED,
    ("engram_store/disk/_cache_kernels.py", "_cache_pin", "empty >= 0", "empty > 0"):
        "only where way 0 is empty, and then the whole set is (ways fill in order and empty all at once): the row "
        "lands in the way CLOCK's hand points at, unreferenced and unpinned, instead of way 0",
    ("engram_store/disk/_cache_kernels.py", "_replace",
     "memcpy(rows, (s * WAYS + way) * slot_bytes, src, src_at, row_bytes // 2)", "pass"):
        "a test hook's half row: the set is left busy either way, so no reader serves the way and the repair "
        "empties it",
    # the disk tier's read planning
    **{("engram_store/disk/_kernels.py", "_probe_all", f"_prefetch({a})", "pass"):
       "a prefetch is a hint: it changes when bytes reach the CPU's cache, never which bytes are read"
       for a in ("meta, base", "rows, line")},
    **{("engram_store/disk/_kernels.py", "_probe_all", old, new):
       "the lines a hit's row is prefetched from: a hint, whatever lines it names (a prefetch never faults)"
       for old, new in (("at - (at & 63)", "at + (at & 63)"), ("line < at + row_bytes", "line <= at + row_bytes"),
                        ("at + row_bytes", "at - row_bytes"))},
    **{("engram_store/disk/_kernels.py", "_probe_all", old, new, line):
       "a burst at or past the last holds no row: its loop's range starts at or past n and is empty, so a burst "
       "more, or a test that lets one more through, does nothing"
       for old, new, line in (("n + BURST - 1", "n + BURST", "bursts = (n + BURST - 1) // BURST"),
                              ("b + 2 < bursts", "b + 2 <= bursts", "if b + 2 < bursts:"),
                              ("b + 2", "b - 2", "if b + 2 < bursts:"),
                              ("0 <= b + 1 < bursts", "0 <= b + 1 <= bursts", "if 0 <= b + 1 < bursts:"))},
    ("engram_store/disk/_kernels.py", "_probe_all", "fence_acquire()", "pass"):
        "on x86-64 an acquire fence emits no instruction: the kernel's machine code is the same without it (only "
        "LLVM's #MEMBARRIER markers differ); it orders the copy before the version's re-read on weaker memory "
        "models (aarch64), which no test machine here runs",
    ("engram_store/disk/_kernels.py", "_probe_all", "1", "2", "at = -1"):
        "the row's place is read only when it is not negative",
    ("engram_store/disk/_kernels.py", "_plan_read", "1", "2", "s = np.int64((np.uint64(s) + np.uint64(1)) & mask)"):
        "probing by twos in a table of at least 2K slots (a power of two) still finds a free slot: each parity "
        "class has K or more, and at most K - 1 blocks are placed before the last",
    ("engram_store/disk/_kernels.py", "_first_bad", "False", "True"):
        "every position of the row is then compared one by one, and only one outside its head is returned",
    ("engram_store/disk/_kernels.py", "_first_bad", "1", "2"): "_serve_hits takes any negative as none",
    ("engram_store/disk/_kernels.py", "_plan_read", "size < 2 * K", "size <= 2 * K"):
        "a larger block table: still a power of two with a free slot for every block",
    ("engram_store/disk/_kernels.py", "_plan_read", "20", "21"):
        "where the probe for a block starts: from any slot it finds the block or a free slot",
    ("engram_store/disk/_kernels.py", "_plan_read", "np.uint64(s) + np.uint64(1)", "np.uint64(s) - np.uint64(1)"):
        "probing down the table visits every slot as probing up does",
    ("engram_store/kernels/_planning.py", "_pairs_total", "0", "1", "return i, 0"):
        "the total of a refused read is never read",
    ("engram_store/kernels/_planning.py", "plan_pieces", "1", "2", "sizes = np.empty(max(most, 1), dtype=np.int64)"):
        "scratch room: only the pieces found are returned",
    # V4.1's ragged decode state
    ("engram_model/v41/_hasher.py", "V41Hasher.commit", "False", "True"):
        "a commit that hashes its tokens too moves the state the same way (only each request's last max_n - 1 "
        "tokens reach it) and returns nothing either way",
    ("engram_model/v41/_hasher.py", "V41Hasher._ragged", "0", "1",
     "out = np.empty((T if emit else 0, nl, cols), dtype=np.int64)"):
        "a commit's output is neither written nor returned",
    ("engram_model/_ngram_kernels.py", "ragged_refusal", "S <= MARK_SLOTS", "S < MARK_SLOTS"):
        "at exactly MARK_SLOTS slots the sorted search finds a repeated slot as the marks do",
    ("engram_model/_ngram_kernels.py", "ragged_refusal", "1", "2", "seen[slots[r]] = 1"): "any non-zero mark is a mark",
    ("engram_model/_ngram_kernels.py", "ragged_refusal", "R > 1", "R >= 1"):
        "a lone request has no slot to repeat: the sorted search finds none",
    ("engram_model/v41/_kernels.py", "hash_ragged", "False", "True", "small = False"):
        "the general modulo loop gives what one correction gives, for every prime (only slower)",
    ("engram_model/v41/_kernels.py", "hash_ragged", "primes[layer, col] <= 4096", "primes[layer, col] < 4096"):
        "4096 is no prime",
    ("engram_model/v41/_kernels.py", "hash_ragged", "0", "1", "lanes = HASH_BLOCK if emit else 0"):
        "a commit hashes nothing: its lanes are allocated and never read",
    ("engram_model/v41/_kernels.py", "hash_ragged", "0", "1", "t0 = 0"):
        "t0 is set at the first token of each block, before it is read",
    ("engram_model/v41/_kernels.py", "hash_ragged", "lo == hi", "False"):
        "a request without tokens loads its slot's history and, on a commit, writes it back unchanged",
    ("engram_model/v41/_kernels.py", "hash_ragged", "nb == HASH_BLOCK", "nb != HASH_BLOCK"):
        "hashing a token at a time gives the rows a block at a time gives (only slower)",
    ("engram_model/v41/_kernels.py", "hash_ragged", "1", "2", "return 0, -1"):
        "the position of a problem is read only with a problem",
    # the client's remote reads
    ("engram_store/client/_reads.py", "reply_bytes", "pairs[0, 0] < 0", "pairs[0, 0] <= 0"):
        "a first pair at offset 0 is a range, and every range's offset is >= 0: both branches sum the same lengths",
    ("engram_store/client/_reads.py", "with_checks", "not named", "False"):
        "every request names the objects of its items, at least one: the guard only spares an empty zip",
    ("engram_store/client/_reads.py", "ReadPath._read_remote", "0", "1", "batch, offs, lens, total, named = [], [], [], 0, set()"):
        "a request split a little sooner or later, still within the reply limit: the same bytes land (speed only)",
    ("engram_store/client/_reads.py", "ReadPath._read_remote", "batch and total + nbytes > CHUNK_BYTES", "batch or total + nbytes > CHUNK_BYTES"):
        "one request per item: more requests, the same bytes (speed only)",
    ("engram_store/client/_reads.py", "ReadPath._read_remote", "batch and total + nbytes > CHUNK_BYTES", "batch"):
        "one request per item: more requests, the same bytes (speed only)",
    ("engram_store/client/_reads.py", "ReadPath._read_remote", "total + nbytes > CHUNK_BYTES", "total + nbytes >= CHUNK_BYTES"):
        "a request split a little sooner or later, still within the reply limit: the same bytes land (speed only)",
    ("engram_store/client/_reads.py", "ReadPath._read_remote", "len(items) == 1 and lens.size == 1", "lens.size == 1"):
        "each item has at least one range: a request of one range is a request of one item",
    ("engram_store/client/_reads.py", "ReadPath._read_remote", "len(items) == 1", "len(items) != 1"):
        "each item has at least one range: a request of one range has one item, so the fast path is never taken "
        "and the reply is scattered into the same place (speed only)",
    ("engram_store/client/_reads.py", "ReadPath._read_remote", "out is not None", "False"):
        "a reply read in place is scattered onto itself: the same bytes (speed only)",
    # read planning
    ("engram_store/kernels/_planning.py", "_plan_unique_rows", "8", "9",
     "counts = np.empty((1 << (8 if M < 2048 else 11)) + 1, dtype=np.int64)"):
        "a larger counts array than the radix needs: the sort takes its radix's width from M, not from counts",
    ("engram_store/kernels/_planning.py", "_plan_unique_rows", "11", "12",
     "counts = np.empty((1 << (8 if M < 2048 else 11)) + 1, dtype=np.int64)"):
        "a larger counts array than the radix needs: the sort takes its radix's width from M, not from counts",
    # the host's row cache
    ("engram_store/disk/_host_cache.py", "HostRowCache.fill", "time.sleep(60)", "pass"):
        "the test hook's process sent itself SIGKILL on the line before: the sleep only waits for the signal",
    ("engram_store/disk/_host_cache.py", "HostRowCache.fill", "60", "61"):
        "the test hook's process sent itself SIGKILL on the line before: the sleep only waits for the signal",
    ("engram_store/disk/_cache_kernels.py", "_replace", "fence_release()", "pass"):
        "a store-store barrier for machines that reorder stores (ARM); x86 keeps stores in order, so no test on "
        "this machine can see it gone (kept: the seqlock needs it there)",
    # the read planner's sort
    ("engram_store/kernels/_sort.py", "_sort_positions", "M < 64", "False"): "the insertion sort for short columns is a speed choice: the radix sort orders them the same (stable)",
    ("engram_store/kernels/_sort.py", "_sort_positions", "M < 64", "M <= 64"): "the insertion sort for short columns is a speed choice: the radix sort orders them the same (stable)",
    ("engram_store/kernels/_sort.py", "_sort_positions", "M < 2048", "M <= 2048"): "the radix's width is a speed choice: every caller's counts hold 2**11 + 1 entries from 2048 rows",
    ("engram_store/kernels/_sort.py", "_sort_positions", "shift < 64 and (span >> shift) > 0", "shift < 64"):
        "more passes of the radix sort over bits that are all zero leave the order as it is (a speed loss)",
    ("engram_store/kernels/_sort.py", "_sort_positions", "(span >> shift) > 0", "span >> shift >= 0"):
        "more passes of the radix sort over bits that are all zero leave the order as it is (a speed loss)",
    # reads of mapped memory
    ("engram_store/tables/_source_store.py", "_RowCache.clear", "1", "2"):
        "a cache key is never negative (head << 40 | row): a fill of -2 empties the cache as -1 does",
    **{("engram_model/_rows_gather.py", "RowGather.in_memory", old, new): CONTIGUOUS for old, new in (
        (SPAN_GUARD, "False"), (SPAN_GUARD, "not all((t.flags.c_contiguous for t in tables))"),
        ("tables is not self._span_of", "tables is self._span_of"))},
}
