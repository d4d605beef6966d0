"""A serving thread's short scheduling slice (``engram_store._sched``): the kernel gets the slice, the thread
keeps its policy and nice value, real-time threads are left alone; a segment's raw-channel serving threads ask
for it."""
from __future__ import annotations

import os
import sys
import threading

import numpy as np
import pytest

from engram_store import DistributedStore
from engram_store._sched import prefer_short_slice
from engram_store.raw import limits
from engram_store.testing import Cluster

pytestmark = [pytest.mark.timeout(120),
              pytest.mark.skipif(not sys.platform.startswith("linux"), reason="scheduling slices are Linux's")]


def _slice_ns(path: str) -> int | None:
    """A thread's slice from its /proc sched file (kernels that show it), else None."""
    try:
        with open(path) as f:
            for line in f:
                if line.startswith("se.slice"):
                    return int(line.split(":")[1])
    except OSError:
        return None
    return None


def _kernel_keeps_custom_slices() -> bool:
    major, minor = (int(x) for x in os.uname().release.split(".")[:2])
    return (major, minor) >= (6, 12) and _slice_ns("/proc/thread-self/sched") is not None


def _in_thread(fn):
    out = {}

    def run():
        try:
            out["value"] = fn()
        except BaseException as exc:  # raised in the test's thread below
            out["error"] = exc

    t = threading.Thread(target=run)
    t.start()
    t.join()
    if "error" in out:
        raise out["error"]
    return out["value"]


def test_a_thread_gets_the_slice_and_keeps_its_policy_and_nice_value():
    def check():
        os.setpriority(os.PRIO_PROCESS, 0, 7)  # this thread only, on Linux
        before = os.sched_getscheduler(0)
        took = prefer_short_slice(200e-6)
        return took, os.sched_getscheduler(0), before, os.getpriority(os.PRIO_PROCESS, 0), \
            _slice_ns("/proc/thread-self/sched")

    took, policy, before, nice, slice_ns = _in_thread(check)
    assert took is True
    assert policy == before and nice == 7
    if _kernel_keeps_custom_slices():
        assert slice_ns == 200_000


def test_no_slice_asked_is_nothing_done():
    def check():
        start = _slice_ns("/proc/thread-self/sched")
        return prefer_short_slice(0), prefer_short_slice(-1.0), start, _slice_ns("/proc/thread-self/sched")

    zero, negative, start, end = _in_thread(check)
    assert zero is False and negative is False and start == end


@pytest.mark.skipif(os.geteuid() != 0, reason="a real-time policy needs CAP_SYS_NICE")
def test_a_real_time_thread_is_left_alone():
    def check():
        os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(1))
        took = prefer_short_slice(100e-6)
        return took, os.sched_getscheduler(0), os.sched_getparam(0).sched_priority

    took, policy, priority = _in_thread(check)
    assert took is False and policy == os.SCHED_FIFO and priority == 1


@pytest.mark.skipif(not _kernel_keeps_custom_slices(), reason="kernels before 6.12 ignore a thread's slice")
def test_a_segments_serving_threads_ask_for_the_short_slice():
    wanted = int(limits.SERVING_SLICE_S * 1e9)
    with Cluster(segments=1, segment_size="8MiB", heartbeat_timeout_s=10.0) as cluster, \
            DistributedStore.connect(cluster.address, local_direct=False) as store:
        pid = cluster.segments[0].pid
        tasks = f"/proc/{pid}/task"

        def slices() -> list[int | None]:
            return [_slice_ns(f"{tasks}/{tid}/sched") for tid in os.listdir(tasks)]

        assert wanted not in slices()  # no serving thread yet: every thread has the kernel's default
        payload = np.arange(4096, dtype=np.uint32).view(np.uint8)
        store.put("sliced", payload)
        replica = store.locate(["sliced"])[0].replicas[0]
        pairs = np.array([[replica.offset + 64, 128]], dtype=np.int64)
        assert bytes(store.read_pairs(replica.address, pairs, 128)) == payload[64:192].tobytes()
        assert wanted in slices()  # the thread that served it
