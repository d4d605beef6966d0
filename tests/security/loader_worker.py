"""The victim of a checkpoint truncated mid-load: loads a V4.1 layer's table from CHECKPOINT_DIR onto DISK_DIR and,
as it packs its second run of rows, prints ``paused`` and waits for a line on stdin (the test truncates the shard
meanwhile). Prints ``loaded``, or ``refused: <error class>: <message>`` for an engram error, and exits 0; a process
killed by a signal (SIGBUS from a mapping of the shard) exits with it.

    python loader_worker.py CHECKPOINT_DIR DISK_DIR
"""
import os
import sys

from engram_model.v41 import V41Config, _kernels, load_v41_table
from engram_store import EngramError


def main(checkpoint: str, disk_dir: str) -> int:
    config = V41Config.from_hf_config(os.path.join(checkpoint, "config.json"))
    pack, calls = _kernels.pack_rows, []

    def pack_after_a_pause(*args):
        calls.append(1)
        if len(calls) == 2:
            print("paused", flush=True)
            sys.stdin.readline()
        return pack(*args)

    _kernels.pack_rows = pack_after_a_pause
    try:
        load_v41_table(checkpoint, config, config.layer_ids[0], disk_dir=disk_dir, progress=False).close()
        print("loaded", flush=True)
    except EngramError as exc:
        print(f"refused: {type(exc).__name__}: {exc}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:3]))
