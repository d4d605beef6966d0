"""One script of MooncakeDistributedStore calls, run on Mooncake's wheel and on engram_store.compat: same results.

The script is a user's: only its import line differs between the runs. It prints what each call returned
(codes, bytes, shapes), and the two runs must print the same. Mooncake's run uses a ``mooncake_master`` from the
wheel, this project's an ``engram-master``; both are separate processes, killed and reaped when the test ends.
Skipped, with the reason, where the wheel cannot load.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

try:
    import mooncake.store  # noqa: F401  (fails without the wheel, or without libibverbs.so.1)
except ImportError as exc:
    pytest.skip(f"mooncake.store does not load ({exc}); install Mooncake's wheel with `pip install -e "
                "\".[mooncake]\"` and `apt-get install libibverbs1` to run these tests", allow_module_level=True)

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "mooncake"))

from compat_helpers import REPO, script_env  # noqa: E402
from mooncake_procs import MooncakeMaster  # noqa: E402

from engram_store.testing import Cluster  # noqa: E402

pytestmark = pytest.mark.timeout(240)

SCRIPT = textwrap.dedent('''
    import ctypes, json, sys
    {imports}

    master = sys.argv[1]
    out = {{}}
    store = MooncakeDistributedStore()
    out["setup_dict"] = store.setup({{"local_hostname": "localhost", "metadata_server": "P2PHANDSHAKE",
                                     "global_segment_size": "64MB", "local_buffer_size": "16 MB",
                                     "master_server_addr": master}})
    host, port = store.get_hostname().split(":")
    out["hostname"] = [host, 12300 <= int(port) <= 14300]
    out["setup_refused"] = [MooncakeDistributedStore().setup({{"local_hostname": "localhost"}}),
                            MooncakeDistributedStore().setup({{"local_hostname": "localhost",
                                                              "metadata_server": "P2PHANDSHAKE",
                                                              "global_segment_size": "50%"}})]

    out["put"] = [store.put("k1", b"first"), store.put("k1", b"second"), store.get("k1").decode(),
                  store.put("empty", b""), store.put("big", b"x" * (17 << 20))]
    def config(**fields):
        c = ReplicateConfig()
        for name, value in fields.items():
            setattr(c, name, value)
        return c
    out["config_codes"] = [store.put("c1", b"x", config(replica_num=0)),
                           store.put("c2", b"x", config(nof_replica_num=1)),
                           store.put("c3", b"x", config(dfs_replica_num=1)),
                           store.put("c4", b"x", config(group_ids=["a", "b"])),
                           store.put("c5", b"x", config(prefer_alloc_in_same_node=True)),
                           store.put("c6", b"x", config(soft_pin_ttl_ms=5)),
                           store.put("k1", b"x", config(soft_pin_ttl_ms=5)),
                           store.put("c7", b"x", config(soft_pin_action=SoftPinAction.ENABLE,
                                                         soft_pin_ttl_ms=25 * 3600 * 1000)),
                           store.put("c8", b"x", config(soft_pin_action=SoftPinAction.ENABLE, soft_pin_ttl_ms=1000)),
                           store.upsert("c8", b"y", config(soft_pin_action=SoftPinAction.DISABLE, soft_pin_ttl_ms=1)),
                           store.upsert("c8", b"y", config(soft_pin_action=SoftPinAction.DISABLE)),
                           store.upsert("c8", b"longer", config())]
    ttl_errors = []
    for bad in (-1, 1 << 64, 1.5, "1"):
        try:
            ReplicateConfig().soft_pin_ttl_ms = bad
        except TypeError:
            ttl_errors.append("TypeError")
    out["ttl_errors"] = ttl_errors
    out["upsert"] = [store.upsert("k1", b"replaced"), store.get("k1").decode(), store.get("c8").decode()]

    data1, data2 = b"0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZ", b"abcdefghijklmnopqrstuvwxyz0123456789"
    store.put("key1", data1)
    store.put("key2", data2)
    b0, b1 = (ctypes.c_ubyte * 32)(), (ctypes.c_ubyte * 32)()
    p0, p1 = ctypes.addressof(b0), ctypes.addressof(b1)
    store.register_buffer(p0, 32)
    store.register_buffer(p1, 32)
    out["ranges"] = store.get_into_ranges([p0, p1], [["key1", "key2"], ["key2", "key1"]],
                                          [[[0, 20], [8]], [[4], [16]]], [[[1, 30], [2]], [[0], [10]]],
                                          [[[4, 3], [5]], [[6], [4]]])
    out["ranges_bytes"] = [bytes(b0).hex(), bytes(b1).hex()]
    out["ranges_failures"] = [
        store.get_into_ranges([p0], [["key1", "key2"]], [[[0], []]], [[[0, 1], []]], [[[], []]]),
        store.get_into_ranges([p0, p1], [["key1"]], [[[0]]], [[[0]]], [[[4]]]),
        [[[c < 0 for c in frags] for frags in keys] for keys in
         store.get_into_ranges([p0], [["key1", "missing", "key2"]], [[[0, 4, 31], [0], [8]]],
                               [[[35, 0, 0], [0], [0]]], [[[4, 2, 4], [4], [4]]])],
    ]
    region = (ctypes.c_ubyte * 192)()
    base = ctypes.addressof(region)
    store.register_buffer(base, 192)
    out["batch_get_into"] = [store.batch_get_into(["key1", "missing", "key2"], [base, base + 64, base + 128],
                                                  [64, 64, 10]),
                             store.batch_get_into(["key1"], [base, base], [64, 64]),
                             store.batch_get_into([], [], [])]
    buffers = store.batch_get_buffer(["key1", "missing"])
    out["batch_get_buffer"] = [buffers[1] is None, buffers[0].size(), bytes(buffers[0]).decode(), len(buffers[0]),
                               store.batch_get_buffer([]), store.get_buffer("missing") is None]
    out["get_batch"] = [v.decode() for v in store.get_batch(["key2", "missing"])]
    out["exist"] = [store.is_exist("key1"), store.is_exist("missing"), store.batch_is_exist(["key1", "missing"]),
                    store.get_size("key1"), store.get_size("missing")]

    zero = MooncakeDistributedStore()
    out["zero_setup"] = zero.setup("localhost", "P2PHANDSHAKE", 16 << 20, 0, "tcp", "", master)
    data = (ctypes.c_ubyte * 4)(*b"abcd")
    out["zero"] = [zero.put("z", b"abc"), zero.is_exist("z"), zero.get("key1"), zero.upsert("key1", b"a"),
                   zero.put_from("z2", ctypes.addressof(data), 4)]
    zero.close()
    store.close()
    print(json.dumps(out, default=repr))
''')


def _run(imports: str, master: str, tmp_path, name: str) -> dict:
    path = tmp_path / f"{name}.py"
    path.write_text(SCRIPT.format(imports=imports))
    proc = subprocess.run([sys.executable, str(path), master], capture_output=True, text=True, timeout=180,
                          cwd=REPO, env=script_env())
    assert proc.returncode == 0, f"{name} failed:\n{proc.stdout}\n{proc.stderr[-4000:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_the_same_calls_answer_the_same_on_mooncake_and_on_compat(tmp_path):
    names = "MooncakeDistributedStore, ReplicateConfig, SoftPinAction"
    with MooncakeMaster() as master:
        real = _run(f"from mooncake.store import {names}", master.address, tmp_path, "on_mooncake")
    with Cluster(segments=0) as cluster:
        compat = _run(f"from engram_store.compat import {names}", cluster.address, tmp_path, "on_compat")
    differ = {k: (real[k], compat.get(k)) for k in real if real[k] != compat.get(k)}
    assert not differ, "mooncake vs compat:\n" + "\n".join(f"{k}: {a!r} vs {b!r}" for k, (a, b) in differ.items())
    assert real["setup_dict"] == 0 and real["config_codes"][:3] == [-600, -600, -1601]  # the script ran its calls
