"""The fault explorer's command line (``python tests/nemesis.py``, see there): replay one seed and print its history,
or explore a range of seeds and write each history that broke the contract in full."""

from __future__ import annotations

import argparse
import os
import signal
import tempfile
import time


def _stop(signum: int, frame) -> None:
    """The first SIGINT or SIGTERM stops the explorer (KeyboardInterrupt); later ones are ignored while it cleans up."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    raise KeyboardInterrupt


def _seed_range(text: str) -> range:
    lo, _, hi = text.partition("-")
    return range(int(lo), int(hi or lo) + 1)


def _parser(doc: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python tests/nemesis.py", description=doc.split("\n\n")[0])
    p.add_argument("--seed", type=int, help="replay one history and print it")
    p.add_argument("--seeds", type=_seed_range, metavar="A-B", help="explore these seeds")
    p.add_argument("--minutes", type=float, default=None, help="stop exploring after this long (default: all)")
    p.add_argument("--no-partitions", action="store_true", help="never partition the network")
    p.add_argument("--no-undo", action="store_true",
                   help="no undo_populate in the schedule (how seeds found before it existed replay)")
    p.add_argument("--no-journal-faults", action="store_true",
                   help="no faults of the master's journal (how seeds found before they existed replay)")
    p.add_argument("--no-rest", action="store_true",
                   help="no faults at rest or forks (nemesis_rest: how seeds found before them replay)")
    p.add_argument("--no-churn", action="store_true",
                   help="no churn stream (nemesis_churn: how seeds found before it replay)")
    p.add_argument("--tour", action="store_true",
                   help="a short history: the churn stream's tour of every operation and fault (what CI runs), and "
                        "the main schedule's operations without its faults")
    p.add_argument("--record", metavar="DIR", default=os.path.join(tempfile.gettempdir(), "engram-nemesis"),
                   help="where a history that broke the contract is written in full, as seed-S.log (a replay "
                        "repeats the schedule, not the timing; default: %(default)s)")
    return p


def main(argv: list[str] | None, run_seed, doc: str) -> int:
    """Replay one seed (``--seed``) or explore a range (``--seeds``) with ``run_seed``; ``doc``: the explorer's."""
    p = _parser(doc)
    args = p.parse_args(argv)
    streams = {"partitions": False if args.no_partitions else None, "undo": not args.no_undo,
               "journal": not args.no_journal_faults, "rest": not args.no_rest, "churn": not args.no_churn,
               "tour": args.tour}
    # SIGTERM stops like Ctrl-C: the history in progress tears down its processes, namespaces and file system,
    # and a second signal (``timeout`` passes one on to its child as the shell sends another) does not cut that short.
    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    if args.seed is not None:
        history = run_seed(args.seed, verbose=True, **streams)
        print(f"seed {args.seed}: " + ("held" if not history.violations else
                                       f"{len(history.violations)} violation(s)"))
        for v in history.violations:
            print(f"  - {v}")
        return 0 if not history.violations else 1
    if args.seeds is None:
        p.error("give --seed S or --seeds A-B")
    return _explore(args, run_seed, streams)


def _explore(args: argparse.Namespace, run_seed, streams: dict) -> int:
    deadline = time.monotonic() + args.minutes * 60 if args.minutes else float("inf")
    failed, ran, start = [], 0, time.monotonic()
    for seed in args.seeds:
        if time.monotonic() > deadline:
            break
        try:
            history = run_seed(seed, **streams)
        except KeyboardInterrupt:
            print(f"stopped during seed {seed} (not counted)", flush=True)
            break
        except Exception as exc:
            import traceback
            ran += 1
            failed.append(seed)
            told = traceback.format_exc()
            history = getattr(exc, "nemesis_history", None)
            if history is not None:
                os.makedirs(args.record, exist_ok=True)
                record = os.path.join(args.record, f"seed-{seed}.log")
                with open(record, "w", encoding="utf-8") as f:
                    f.write(history.transcript() + "\n\nthe explorer itself failed:\n" + told)
                told += f"(the history up to then is in {record})\n"
            print(f"seed {seed}: the explorer itself failed:\n{told}", flush=True)
            continue
        ran += 1
        if history.violations:
            failed.append(seed)
            os.makedirs(args.record, exist_ok=True)
            record = os.path.join(args.record, f"seed-{seed}.log")
            with open(record, "w", encoding="utf-8") as f:
                f.write(history.transcript())
            print(f"seed {seed}: {len(history.violations)} violation(s), history in {record}: "
                  f"{history.violations[0][:300]}", flush=True)
        elif ran % 10 == 0:
            print(f"... {ran} seeds, {len(failed)} failed", flush=True)
    per_seed = (time.monotonic() - start) / ran if ran else 0.0
    print(f"{ran} seed(s) explored in {per_seed:.1f} s each, {len(failed)} broke the contract"
          + (f": {failed}" if failed else ""))
    return 0 if not failed else 1
