"""``engram-stats``: how well an Engram configuration's tables fit a token corpus.

    engram-stats TOKENS [--config CONFIG.json] [--engram-vocab-size N N] [--max-ngram-size 3]
                 [--n-head-per-ngram 8] [--layer-ids 1 15] [--vocab-size 129280] [--tokenizer tokenizer.json]

``TOKENS`` is a ``.npy`` file of token ids (1-D: one sequence; 2-D: one sequence per row) or a text file of
whitespace-separated ids (one sequence per line). For every head of every layer it reports:

* the distinct n-grams of the head's order in the corpus, and the distinct table rows they hash to;
* the collision rate: the share of distinct n-grams that share their row with another n-gram (what a
  larger ``engram_vocab_size`` reduces), next to the rate a uniform hash would give;
* the occupancy: the share of the table's rows the corpus touches.

With a tokenizer it also reports the compression ratio of :class:`CompressedTokenizer` (original vocabulary /
compressed vocabulary), which shrinks the space of n-grams before hashing.

``--profile PATH`` also writes the corpus's row frequencies as a warm-start profile of the hot-row cache
(``EngramStore.warm_cache(PATH)``; format in :mod:`engram_store.disk._profile`): per layer, every looked-up row
of every head with its count, most frequent first.

``--v41`` answers the sizing question of DeepSeek-V4.1's tables on SSD before serving: how large must
``row_cache_bytes`` be? It hashes TOKENS as V4.1 does (``--tokenizer``: a ``tokenizer.json``, or a token map saved
with ``save_token_map``) and replays the rows into the miss-ratio curve a serving process keeps, or reads a saved
profile (``--from-profile``, no TOKENS), and reports per layer and n-gram order the working set, the first-touch
bound, the hit rate at caches of 0.1% to 100% of the rows, and with ``--hit-rate R`` the smallest cache reaching R
(:mod:`engram_model.v41._sizing`). The config is the released one, or ``--config config.json`` (a V4.1
``config.json``), then the flags ``--layer-ids``, ``--engram-vocab-size N``, ``--max-ngram-size``,
``--n-head-per-ngram`` (V4.1's ``n_heads``) and ``--pad-id``::

    engram-stats corpus.npy --v41 --tokenizer tokenizer.json --hit-rate 0.6 --profile v41-profile.npz
    engram-stats --v41 --from-profile v41-profile.npz --layer-ids 1 14 --hit-rate 0.6

``--ple`` asks the same of Qwen4-Exp's PLE tables (:mod:`engram_model.ple._sizing`): TOKENS are raw ids of the
model's own tokenizer (no token map), hashed as its PLE layers hash them; the config is the release's (layer 2,
bf16 rows) or ``--config config.json``, then ``--layer-ids``, ``--engram-vocab-size`` (``ngram_vocab_size_base``),
``--max-ngram-size`` (``ngram_size``), ``--n-head-per-ngram`` (``heads_per_ngram``) and ``--seed``::

    engram-stats corpus.npy --ple --hit-rate 0.6 --profile ple-profile.npz
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from typing import Any

import numpy as np

from engram_store import cli
from engram_store.errors import EngramError, InvalidArgument
from engram_store.units import format_size
from engram_store.disk import LayerProfile, load_profile, save_profile

from .demo import BackboneConfig, EngramConfig, NgramHashMapping
from ._tokenizer import compressed_tokenizer_from_path


def load_tokens(path: str) -> np.ndarray:
    """Token ids from a .npy file or a text file of integers, as int64 ``[B, L]`` (rows padded with -1)."""
    try:
        return _load_tokens(path)
    except OSError as exc:
        raise InvalidArgument(f"TOKENS: cannot read {path}: {exc.strerror or exc}") from None


def _load_tokens(path: str) -> np.ndarray:
    if path.endswith(".npy"):
        arr = np.load(path, allow_pickle=False)
        if arr.dtype.kind not in "iu" or arr.ndim not in (1, 2) or arr.size == 0:
            raise InvalidArgument(f"TOKENS: expected a non-empty 1-D or 2-D integer array in {path}, "
                                  f"got {arr.dtype} {arr.shape}")
        return np.atleast_2d(arr.astype(np.int64))
    with open(path, encoding="utf-8") as f:
        try:
            rows = [[int(t) for t in line.split()] for line in f if line.strip()]
        except ValueError as exc:
            raise InvalidArgument(f"TOKENS: {path} must hold whitespace-separated integers ({exc})") from None
    if not rows:
        raise InvalidArgument(f"TOKENS: {path} holds no token ids")
    out = np.full((len(rows), max(map(len, rows))), -1, dtype=np.int64)
    for i, row in enumerate(rows):
        out[i, :len(row)] = row
    return out


def _ngrams(ids: np.ndarray, n: int, pad: int, valid: np.ndarray) -> np.ndarray:
    """Every position's n-gram (the token and the n-1 before it, left-padded) as rows of an int64 matrix."""
    B, L = ids.shape
    cols = [np.concatenate([np.full((B, k), pad, dtype=np.int64), ids[:, :L - k]], axis=1) for k in range(n)]
    return np.stack(cols, axis=-1)[valid]


def head_stats(mapping: NgramHashMapping, ids: np.ndarray) -> list[dict[str, Any]]:
    """Per layer and head: order, table size, distinct n-grams and rows, collision rate and occupancy."""
    valid = ids >= 0
    prepared = mapping.prepare_ids(np.where(valid, ids, 0))
    rows = mapping.hash_prepared(prepared, mapping.layer_ids)
    out = []
    for layer_id in mapping.layer_ids:
        sizes = mapping.get_table_vocab_sizes(layer_id)
        for h, prime in enumerate(sizes):
            n = mapping.min_ngram_size + h // mapping.n_head_per_ngram
            grams = _ngrams(prepared, n, mapping.pad_id, valid)
            head_rows = rows[layer_id][..., h][valid]
            distinct, first = np.unique(grams, axis=0, return_index=True)
            rows_of_distinct = head_rows[first]
            row_ids, counts = np.unique(rows_of_distinct, return_counts=True)
            k = distinct.shape[0]
            shared = int(counts[counts > 1].sum())
            # A uniform hash of k keys into p rows: expected share of keys whose row holds another key.
            expected = 1.0 - (1.0 - 1.0 / prime) ** (k - 1) if k > 1 else 0.0
            out.append({"layer_id": layer_id, "head": h, "order": n, "rows": prime, "distinct_ngrams": k,
                        "distinct_rows": int(row_ids.size), "collision_rate": shared / k if k else 0.0,
                        "uniform_collision_rate": expected, "occupancy": row_ids.size / prime})
    return out


def profile_rows(ids: np.ndarray, valid: np.ndarray | None = None) -> LayerProfile:
    """The frequency profile of one layer's lookups: ``ids`` int ``[N, H]`` (row of head h at each of N
    positions; ``valid`` bool ``[N]`` drops positions) -> every distinct (head, row) with its count."""
    ids = np.asarray(ids)
    if ids.ndim != 2 or ids.dtype.kind not in "iu":
        raise InvalidArgument(f"ids: expected integer row ids [N, H], got {ids.dtype} {ids.shape}")
    if valid is not None:
        ids = ids[np.asarray(valid, dtype=bool)]
    H = ids.shape[1]
    keys = ids.astype(np.int64) * H + np.arange(H, dtype=np.int64)  # head in the low digits: one sort for all
    distinct, counts = np.unique(keys.reshape(-1), return_counts=True)
    return LayerProfile.from_counts(distinct % H, distinct // H, counts)


def _v41_profiles(ids: np.ndarray, hasher: Any) -> dict[int, LayerProfile]:
    config = hasher.config
    valid = ids >= 0
    rows = hasher(np.where(valid, ids, config.pad_id))                      # [B, L, n_layers, cols]
    return _profiles(rows, valid, config.layer_ids, [config.offsets(lid) for lid in config.layer_ids])


def _ple_profiles(ids: np.ndarray, hasher: Any) -> dict[int, LayerProfile]:
    valid = ids >= 0
    rows = hasher(np.where(valid, ids, hasher.eos))    # [B, L, n_layers, heads]; what follows a row's end is dropped
    return _profiles(rows, valid, hasher.config.ple_layer_ids, list(hasher.offsets))


def _profiles(rows: np.ndarray, valid: np.ndarray, layer_ids: Any, offsets: list) -> dict[int, LayerProfile]:
    """Each layer's profile from a hasher's rows ``[B, L, n_layers, cols]`` (global rows; ``offsets`` per layer)."""
    cols = rows.shape[-1]
    return {lid: profile_rows((rows[:, :, j, :] - offsets[j]).reshape(-1, cols), valid.reshape(-1))
            for j, lid in enumerate(layer_ids)}


def _v41_config(args: Any, token_map: np.ndarray | None) -> Any:
    """V4.1's released config, or ``--config``'s, then the flags (and the token map's compressed vocabulary)."""
    from .v41 import V41Config

    base = V41Config.from_hf_config(args.config) if args.config else V41Config(layer_ids=(1, 14))
    fields = dataclasses.asdict(base)
    if len(args.engram_vocab_size or [0]) != 1:
        raise InvalidArgument(f"--engram-vocab-size: V4.1 takes one size for every order, got {args.engram_vocab_size}")
    for flag, name in (("layer_ids", "layer_ids"), ("engram_vocab_size", "engram_vocab_size"),
                       ("max_ngram_size", "max_ngram_size"), ("n_head_per_ngram", "n_heads"), ("pad_id", "pad_id")):
        value = getattr(args, flag)
        if value is not None:
            fields[name] = value[0] if flag == "engram_vocab_size" else tuple(value) if flag == "layer_ids" else value
    if token_map is not None and not args.config:  # the hash's multipliers are drawn against the map's size
        fields["compressed_vocab_size"] = int(token_map.max()) + 1
    return V41Config(**fields)


def _ple_config(args: Any) -> Any:
    """Qwen3.8-Flash-Next's PLE config (layer 2), or ``--config``'s, then the flags."""
    from .ple import PLEConfig

    base = PLEConfig.from_hf(args.config) if args.config else PLEConfig(ple_layer_ids=(2,))
    fields = dataclasses.asdict(base)
    if len(args.engram_vocab_size or [0]) != 1:
        raise InvalidArgument(f"--engram-vocab-size: PLE takes one base for every head "
                              f"(ngram_vocab_size_base), got {args.engram_vocab_size}")
    for flag, name in (("layer_ids", "ple_layer_ids"), ("engram_vocab_size", "ngram_vocab_size_base"),
                       ("max_ngram_size", "ngram_size"), ("n_head_per_ngram", "heads_per_ngram"), ("seed", "seed")):
        value = getattr(args, flag)
        if value is not None:
            fields[name] = value[0] if flag == "engram_vocab_size" else tuple(value) if flag == "layer_ids" else value
    return PLEConfig(**fields)


def _token_map(path: str) -> np.ndarray:
    from .v41 import build_token_map, load_token_map

    try:
        return load_token_map(path) if path.endswith(".npy") else build_token_map(path)
    except (EngramError, OSError, ValueError) as exc:
        raise InvalidArgument(f"--tokenizer {path}: {exc}") from None


def _sizing_source(args: Any, family: str) -> tuple[Any, Any, Any]:
    """``(config, geometry, curve source)`` of a --v41 or --ple sizing; writes --profile."""
    from ._replay import ProfileCurve
    from .v41 import V41Hasher, replay_tokens

    if args.from_profile is not None:
        if args.profile:
            raise InvalidArgument("--profile: a profile is written from TOKENS, not from --from-profile")
        config = _v41_config(args, None) if family == "v41" else _ple_config(args)
        geometry = config if family == "v41" else _ple_geometry(config)
        return config, geometry, ProfileCurve(geometry, load_profile(args.from_profile))
    ids = None
    if family == "v41":
        if not args.tokenizer:
            raise InvalidArgument("--v41: TOKENS need --tokenizer (tokenizer.json, or a saved token map .npy)")
        token_map = _token_map(args.tokenizer)
        config = _v41_config(args, token_map)
        ids = load_tokens(args.tokens)
        source = replay_tokens(config, token_map, ids)
        if args.profile:
            save_profile(args.profile, _v41_profiles(ids, V41Hasher(config, token_map)))
        return config, config, source
    from .ple import PLEHasher
    from .ple import replay_tokens as replay_ple

    if args.tokenizer:
        raise InvalidArgument("--tokenizer: --ple hashes raw token ids (TOKENS from the model's own tokenizer); "
                              "there is no token map")
    config, ids = _ple_config(args), load_tokens(args.tokens)
    source = replay_ple(config, ids)
    if args.profile:
        save_profile(args.profile, _ple_profiles(ids, PLEHasher(config)))
    return config, _ple_geometry(config), source


def _ple_geometry(config: Any) -> Any:
    from .ple import sizing_geometry

    return sizing_geometry(config)


def _main_sizing(args: Any, family: str) -> int:
    """engram-stats --v41 / --ple: the sizing report of TOKENS or --from-profile."""
    from ._replay import sizing_report

    try:
        if (args.tokens is None) == (args.from_profile is None):
            with_map = " (with --tokenizer)" if family == "v41" else ""
            raise InvalidArgument(f"--{family}: expected TOKENS{with_map} or --from-profile PATH, one of them")
        if args.hit_rate is not None and not 0 < args.hit_rate <= 1:
            raise InvalidArgument(f"--hit-rate: expected a hit rate in (0, 1], got {args.hit_rate}")
        config, geometry, source = _sizing_source(args, family)
        report = sizing_report(source, args.hit_rate)
    except (EngramError, OSError, ValueError) as exc:
        print(f"{PROG}: {exc}", file=sys.stderr)
        return 2
    report["source"] = "profile" if args.from_profile else "tokens"
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    _print_sizing(report, geometry, "V4.1" if family == "v41" else "PLE")
    if args.profile:
        print(f"profile of every looked-up row -> {args.profile}")
    return 0


def _print_sizing(report: dict[str, Any], config: Any, family: str = "V4.1") -> None:
    lids = list(report["layers"])
    how = "a cache holding the profile's most frequent rows; an LRU on traffic with locality hits more" \
        if report["source"] == "profile" else "an LRU, the corpus replayed"
    print(f"{family} layers {lids}: {report['rows']:,} rows of {report['row_bytes']} bytes; {report['lookups']:,} "
          f"lookups of {report['working_set_rows']:,} distinct rows (working set: row_cache_bytes "
          f"{format_size(report['working_set_bytes'])})")
    print(f"first-touch bound (a cache of unbounded size still misses every first touch): "
          f"{report['first_touch_bound']:.1%}")
    orders = range(2, config.max_ngram_size + 1)
    print(f"hit rate by row_cache_bytes ({how}):")
    print(f"{'row_cache_bytes':>15} {'rows':>13} {'all':>6} " + " ".join(f"{'layer ' + str(lid):>9}" for lid in lids)
          + " " + " ".join(f"{'order ' + str(n):>8}" for n in orders))
    for i, entry in enumerate(report["hit_rate_by_size"]):
        layers = [report["layers"][lid]["hit_rate_by_size"][i]["hit_rate"] for lid in lids]
        by_order = [float(np.mean([report["layers"][lid]["hit_rate_by_order"][n][i] for lid in lids])) for n in orders]
        print(f"{format_size(entry['bytes']):>15} {entry['rows']:>13,} {entry['hit_rate']:>6.1%} "
              + " ".join(f"{x:>9.1%}" for x in layers) + " " + " ".join(f"{x:>8.1%}" for x in by_order))
    target = report.get("target")
    if target is not None:
        if target["rows"] is None:
            print(f"a hit rate of {target['hit_rate']:.1%} is out of reach: the first-touch bound is "
                  f"{report['first_touch_bound']:.1%}")
        else:
            print(f"a hit rate of {target['hit_rate']:.1%} needs row_cache_bytes >= {target['bytes']:,} "
                  f"({format_size(target['bytes'])}, {target['rows']:,} rows)")


PROG = "engram-stats"
DESCRIPTION = """\
How well an Engram configuration's tables fit a token corpus. For every head of every layer:
the distinct n-grams of the head's order in TOKENS and the distinct table rows they hash to; the
collision rate (the share of distinct n-grams that share their row with another, which a larger
--engram-vocab-size reduces) next to the rate a uniform hash would give; and the occupancy (the
share of the table's rows the corpus touches). With --tokenizer, also the compression ratio of
the compressed tokenizer (original vocabulary / compressed vocabulary).

With --v41: how large a DeepSeek-V4.1 hot-row cache (row_cache_bytes) must be, from TOKENS or a
saved profile: the working set, the first-touch bound, the hit rate at every cache size per layer
and n-gram order, and with --hit-rate the smallest cache that reaches it. With --ple, the same for
the PLE tables of Qwen4-Exp (Qwen/Qwen3.8-Flash-Next), from raw ids of the model's own tokenizer."""


def _parser():
    defaults = EngramConfig()
    p = cli.parser(PROG, DESCRIPTION, epilog="Fields come from EngramConfig's defaults, then --config, then the flags.")
    p.add_argument("tokens", metavar="TOKENS", nargs="?", help=".npy array of token ids (1-D: one sequence; 2-D: one "
                   "per row) or a text file of whitespace-separated ids, one sequence per line")
    p.add_argument("--config", metavar="JSON", help="a JSON object of EngramConfig fields; with --v41, a V4.1 "
                   "config.json; with --ple, a Qwen4-Exp config.json (default: none)")
    p.add_argument("--engram-vocab-size", type=int, nargs="+", metavar="N",
                   help=f"table size per n-gram order before rounding to primes (default: {defaults.engram_vocab_size})")
    p.add_argument("--max-ngram-size", type=int, metavar="N",
                   help=f"largest n-gram order (default: {defaults.max_ngram_size})")
    p.add_argument("--n-head-per-ngram", type=int, metavar="N",
                   help=f"hash heads per order (default: {defaults.n_head_per_ngram})")
    p.add_argument("--layer-ids", type=int, nargs="+", metavar="L",
                   help=f"layers that have an Engram (default: {defaults.layer_ids})")
    p.add_argument("--pad-id", type=int, metavar="ID", help=f"token id of padding (default: {defaults.pad_id})")
    p.add_argument("--seed", type=int, metavar="N", help=f"seed of the hash multipliers (default: {defaults.seed})")
    p.add_argument("--vocab-size", type=int, default=None, metavar="N",
                   help="backbone vocabulary, without --tokenizer (default: the largest id in TOKENS + 1)")
    p.add_argument("--tokenizer", metavar="PATH",
                   help="tokenizer.json: compress ids as the model does (default: none, raw ids)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--profile", metavar="PATH",
                   help="also write a warm-start profile of the row cache, .npz (default: none)")
    p.add_argument("--v41", action="store_true",
                   help="size a V4.1 hot-row cache: hash TOKENS with --tokenizer as DeepSeek-V4.1 does (its released "
                        "config, layers 1 14, unless --config or the flags say otherwise), or read --from-profile; "
                        "report the working set, the first-touch bound and the hit rate at every cache size")
    p.add_argument("--ple", action="store_true",
                   help="size a PLE hot-row cache (Qwen4-Exp, Qwen/Qwen3.8-Flash-Next): hash TOKENS, raw ids of the "
                        "model's own tokenizer, as its PLE layers do (the release's config, layer 2, unless --config "
                        "or --layer-ids, --engram-vocab-size, --max-ngram-size, --n-head-per-ngram, --seed say "
                        "otherwise), or read --from-profile; the same report as --v41")
    p.add_argument("--from-profile", metavar="PATH",
                   help="with --v41 or --ple, in place of TOKENS: a profile written by --profile (counts, no order: "
                        "the hit rate of a cache holding the most frequent rows) (default: none)")
    p.add_argument("--hit-rate", type=float, metavar="R",
                   help="with --v41 or --ple: also the smallest row_cache_bytes reaching this hit rate, 0 < R <= 1 "
                        "(default: none)")
    cli.add_log_level(p, "WARNING")
    return p


def _config(args: argparse.Namespace) -> EngramConfig:
    """The EngramConfig the command line names: its defaults, then --config's fields, then the flags."""
    fields: dict[str, Any] = {}
    if args.config:
        try:
            with open(args.config, encoding="utf-8") as f:
                fields = json.load(f)
        except OSError as exc:
            raise InvalidArgument(f"--config: cannot read {args.config}: {exc.strerror}") from None
        except ValueError as exc:
            raise InvalidArgument(f"--config: {args.config} is not JSON ({exc})") from None
        if not isinstance(fields, dict):
            raise InvalidArgument(f"--config: expected a JSON object of EngramConfig fields in {args.config}, "
                                  f"got {type(fields).__name__}")
        known = {f.name for f in dataclasses.fields(EngramConfig)}
        unknown = sorted(set(fields) - known)
        if unknown:
            raise InvalidArgument(f"--config: unknown EngramConfig field(s) {unknown}; known: {sorted(known)}")
    for name in ("engram_vocab_size", "max_ngram_size", "n_head_per_ngram", "layer_ids", "pad_id", "seed"):
        value = getattr(args, name)
        if value is not None:
            fields[name] = value
    fields.setdefault("n_embed_per_ngram", fields.get("n_head_per_ngram", EngramConfig().n_head_per_ngram))
    return EngramConfig(**fields).validate()


def main(argv: list[str] | None = None) -> int:
    return cli.run(_main, argv)


def _main(argv: list[str] | None) -> int:
    args = _parser().parse_args(argv)
    cli.setup_logging(args.log_level)
    if args.v41 and args.ple:
        print(f"{PROG}: --v41, --ple: expected one model family, got both", file=sys.stderr)
        return 2
    if args.v41 or args.ple:
        return _main_sizing(args, "v41" if args.v41 else "ple")
    if args.tokens is None:
        print(f"{PROG}: TOKENS: expected a token file (or --v41 / --ple --from-profile PATH)", file=sys.stderr)
        return 2
    try:
        config = _config(args)
        ids = load_tokens(args.tokens)
        try:
            tokenizer = compressed_tokenizer_from_path(args.tokenizer) if args.tokenizer else None
        except (EngramError, OSError, ValueError) as exc:
            raise InvalidArgument(f"--tokenizer {args.tokenizer}: {exc}") from None
        vocab = args.vocab_size or max(int(ids.max()) + 1, config.pad_id + 1)
        mapping = NgramHashMapping.from_config(config, BackboneConfig(vocab_size=vocab), tokenizer)
        if args.profile:
            valid = ids >= 0
            rows = mapping.hash_prepared(mapping.prepare_ids(np.where(valid, ids, 0)), mapping.layer_ids)
            save_profile(args.profile, {lid: profile_rows(rows[lid].reshape(-1, rows[lid].shape[-1]),
                                                          valid.reshape(-1)) for lid in mapping.layer_ids})
        report = {"tokens": int((ids >= 0).sum()), "sequences": int(ids.shape[0]),
                  "compression_ratio": tokenizer.compression_ratio if tokenizer else None,
                  "heads": head_stats(mapping, ids)}
    except (EngramError, OSError, ValueError) as exc:
        print(f"{PROG}: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    print(f"{report['tokens']} tokens in {report['sequences']} sequence(s)"
          + (f"; tokenizer compression ratio {report['compression_ratio']:.3f}" if tokenizer else ""))
    print(f"{'layer':>5} {'head':>4} {'n':>2} {'rows':>10} {'n-grams':>9} {'used rows':>9} {'collide':>8} "
          f"{'uniform':>8} {'occupancy':>9}")
    for s in report["heads"]:
        print(f"{s['layer_id']:>5} {s['head']:>4} {s['order']:>2} {s['rows']:>10} {s['distinct_ngrams']:>9} "
              f"{s['distinct_rows']:>9} {s['collision_rate']:>8.2%} {s['uniform_collision_rate']:>8.2%} "
              f"{s['occupancy']:>9.2%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
