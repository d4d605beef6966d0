"""The Engram quick start: build a layer, upload its tables to the store, run a forward pass, clean up.

Run ``engram-demo`` or ``python -m engram_model.demo.demo``; by default the store runs inside this process
(``DistributedStore.embedded()``); ``--master HOST:PORT`` uses a running ``engram-master`` instead.
"""

from __future__ import annotations

import argparse
import sys
import time
from contextlib import contextmanager
from typing import Iterator, Sequence

import numpy as np

from engram_store import DistributedStore, MasterUnavailable, ObjectExists
from engram_store import cli

from ._config import BackboneConfig, EngramConfig
from ._layer import Engram


@contextmanager
def _step(name: str) -> Iterator[None]:
    start = time.perf_counter()
    yield
    print(f"  {name:<28s} {1e3 * (time.perf_counter() - start):9.2f} ms")


def quick_start_configs(num_layers: int = 6) -> tuple[EngramConfig, BackboneConfig]:
    """The seed quick start's configuration, set attribute by attribute as the seed script does.

    ``num_layers`` is the backbone's depth: 6 in the quick start (layer 15 of ``layer_ids`` then only shapes the
    prime tables; only layer 1 is built); pass 16 or more to build layer 15 too.
    """
    cfg = EngramConfig()
    cfg.engram_vocab_size = [1000, 1000]
    cfg.max_ngram_size = 3
    cfg.n_embed_per_ngram = 64
    cfg.n_head_per_ngram = 4
    cfg.layer_ids = [1, 15]
    cfg.pad_id = 2
    cfg.seed = 0
    cfg.kernel_size = 4
    bb = BackboneConfig()
    bb.hidden_size = 256
    bb.hc_mult = 4
    bb.vocab_size = 128000
    bb.num_layers = num_layers
    return cfg, bb


PROG = "engram-demo"


def main(argv: Sequence[str] | None = None) -> int:
    return cli.run(_main, argv)


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = cli.parser(PROG, "The Engram quick start: build a layer, upload its tables to the store, run a forward "
                               "pass, clean up.\nThe store runs inside this process unless --master names a running "
                               "engram-master.")
    parser.add_argument("--master", metavar="HOST:PORT",
                        help="use this running master (default: none, a master and a segment inside this process)")
    parser.add_argument("--segment-size", default="256MiB", metavar="SIZE",
                        help="segment mounted by this process (embedded store, or with --master; 0 = none)")
    parser.add_argument("--batch", type=int, default=2, metavar="B", help="batch size B")
    parser.add_argument("--seq-len", type=int, default=8, metavar="L", help="sequence length L")
    parser.add_argument("--seed", type=int, default=0, metavar="N", help="seed of the random tables, ids and hidden states")
    cli.add_log_level(parser, "WARNING")
    args = parser.parse_args(argv)
    for flag, value in (("--batch", args.batch), ("--seq-len", args.seq_len)):
        if value < 1:
            parser.error(f"{flag}: expected an integer >= 1, got {value}")
    return args


def _open_store(args: argparse.Namespace) -> DistributedStore | None:
    """The running master's store (None, said why, when none answers), else one inside this process."""
    if not args.master:
        return DistributedStore.embedded(segment_size=args.segment_size)
    try:
        with cli.announce_after(f"connecting to the master at {args.master} (up to 3 s)", PROG):
            return DistributedStore.connect(args.master, segment_size=args.segment_size)
    except MasterUnavailable:
        print(f"{PROG}: no engram master answered at --master {args.master} within 3 s; is engram-master "
              "running there? (a master started with --auth needs ENGRAM_AUTH_DIR set to its key "
              "directory)", file=sys.stderr)
        return None


def _main(argv: Sequence[str] | None) -> int:
    args = _parse(argv)
    cli.setup_logging(args.log_level)

    cfg, bb = quick_start_configs()

    rng = np.random.default_rng(args.seed)
    print("Engram quick start")
    with _step("store setup"):
        store = _open_store(args)
    if store is None:
        return 1
    try:
        with _step("Engram(layer_id=1)"):
            engram = Engram(layer_id=1, config=cfg, backbone_cfg=bb, store=store)
        sizes = engram.get_table_vocab_sizes()
        embed_D = engram.get_embedding_dim()
        print(f"  tables: {len(sizes)} heads x D_head={embed_D}, rows {sizes}")
        # Size every table from get_table_vocab_sizes(): head h hashes into [0, sizes[h]).
        embedding_buffers = [rng.standard_normal((n, embed_D), dtype=np.float32) for n in sizes]
        buffer_sizes = [t.nbytes for t in embedding_buffers]
        populated = False
        try:
            with _step("populate_store_from_buffers"):
                try:
                    engram.populate_store_from_buffers(embedding_buffers, buffer_sizes)
                except ObjectExists as exc:
                    print(f"{PROG}: layer 1 is already in the store ({exc}); the demo leaves it as it is. "
                          "Remove it first, or run the demo on its own embedded store (no --master).",
                          file=sys.stderr)
                    return 1
            populated = True
            B, L = args.batch, args.seq_len
            hidden_states = rng.standard_normal((B, L, bb.hc_mult, bb.hidden_size), dtype=np.float32)
            input_ids = rng.integers(0, bb.vocab_size, size=(B, L)).tolist()
            with _step("hash_input_ids"):
                engram.hash_input_ids(input_ids)
            with _step("query_embeddings"):
                engram.query_embeddings(input_ids)
            with _step("forward"):
                output = engram.forward(hidden_states, input_ids)
            with _step("forward (prefetched)"):
                handle = engram.prefetch(input_ids)
                prefetched = engram.forward(hidden_states, input_ids, prefetched=handle)
            assert np.array_equal(output, prefetched)
            print(f"Output shape: {output.shape}")
        finally:
            if populated:  # only what this run wrote: never a layer someone else populated
                with _step("remove_from_store"):
                    engram.remove_from_store()
            engram.close()
    finally:
        with _step("store close"):
            store.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
