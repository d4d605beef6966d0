"""Network partitions between real processes, each in a network namespace of its own (root only: elsewhere these
skip and say why). The hole they pin: a client cut off from the master, while others remove a layer and reuse its
space, must never read the new object's bytes as the old layer's rows."""
from __future__ import annotations

import json
import os
import random
import sys
import time

import pytest

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, HERE)

from engram_store.segment import reap_orphans  # noqa: E402
from engram_store.testing import free_port, start_master, start_segment  # noqa: E402
from nemesis import Op, Worker  # noqa: E402
from nemesis_net import Network  # noqa: E402

pytestmark = pytest.mark.timeout(240)


def _call(worker: Worker, cmd: dict, timeout_s: float = 60.0) -> dict:
    worker.send(Op(0, worker.name, cmd, 0.0))
    line = worker.read_line(time.monotonic() + timeout_s)
    assert line is not None, f"client {worker.name} did not answer {cmd}"
    worker.op = None
    return json.loads(line)


@pytest.fixture
def network():
    net = Network.maybe(random.randrange(1 << 30))
    if net is None:
        pytest.skip("network namespaces need root and iproute2 ('ip'); partitions are not tested here")
    try:
        yield net
    finally:
        net.close()


@pytest.mark.parametrize("local_direct", [False, True], ids=["remote", "local-direct"])
def test_a_client_cut_off_from_the_master_never_reads_a_reused_space(network, local_direct, tmp_path):
    procs, workers = [], []
    tmp = str(tmp_path)
    try:
        port = free_port()
        master = start_master(port=port, host=network.address("master"), prefix=network.prefix("master"),
                              heartbeat_timeout_s=5.0, extra=["--reuse-delay", "0.3"])
        procs.append(master)
        procs.append(start_segment(master.address, "4MiB", host=network.address("segment0"),
                                   prefix=network.prefix("segment0")))
        args = [master.address, os.path.join(tmp, "local"), os.path.join(tmp, "disk"), "1" if local_direct else "0",
                "1000"]
        cut_off = Worker("a", args, network.prefix("client0"))
        other = Worker("b", args, network.prefix("client1"))
        workers += [cut_off, other]
        assert _call(cut_off, {"op": "populate", "kind": "store", "layer": 1, "gen": 1}).get("ok")
        assert _call(cut_off, {"op": "lookup", "kind": "store", "layer": 1, "seed": 1})["gens"] == [1]
        network.block("client0", "master")
        network.block("master", "client0")
        # Elsewhere: the layer is removed, and once the reuse delay is over its space holds other layers.
        assert _call(other, {"op": "remove", "kind": "store", "layer": 1, "force": True}).get("ok")
        time.sleep(0.5)
        for layer in (2, 3):
            assert _call(other, {"op": "populate", "kind": "store", "layer": layer, "gen": layer}).get("ok")
        reads = refused = 0
        deadline = time.monotonic() + 4.0  # well past the placement's age limits
        while time.monotonic() < deadline:
            reply = _call(cut_off, {"op": "lookup", "kind": "store", "layer": 1, "seed": reads, "prefetch": reads % 2})
            if reply.get("ok"):
                assert not reply["bad"], f"the cut-off client read another layer's rows: {reply['bad']}"
                assert reply["gens"] == [1]
                reads += 1
            else:
                assert reply["error"] in ("StalePlacement", "MasterUnavailable", "SegmentUnavailable"), reply
                refused += 1
        assert refused, "every read succeeded: the layer's space was never reused under the cut-off client"
    finally:
        for w in workers:
            w.proc.close()
        for p in procs:
            p.close()
        reap_orphans()
