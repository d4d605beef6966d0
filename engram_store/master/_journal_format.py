"""The journal's lines: how a record is written (its sequence number and checksum) and what a record must hold.

A journal lives on a disk for as long as the cluster does, and bytes at rest rot: a record read back is trusted
only once it has proved it is the one written. Version 2 of the format (the first line is a header,
``{"seq":0,"op":"journal","format":2,"sum":...}``) gives every line

- ``seq``, one more than the line before: a line lost or repeated in the middle is a gap;
- ``sum``, the xxh3_64 of the line's bytes up to ``,"sum":`` (the raw bytes, so any flipped bit shows);

and every record must match its schema (:data:`SCHEMA`): a field missing or of the wrong type, a line that is not
an object (``[1,2]``), an unknown ``op``. Each is refused naming the line, never replayed part-way nor skipped.
Journals written before version 2 (no header) are read with the same schema, without sums and sequence numbers.
"""

from __future__ import annotations

import json

import xxhash

from engram_store.errors import JournalError

#: The journal format this master writes.
FORMAT = 2
_SUM = b',"sum":"'
_SUM_HEX = 16
#: Field kinds: a str, an int >= 0, a replica (``[segment_id, offset]`` or ``[segment_id, offset, generation]``),
#: a list of them, or a list of nested records (a batch: one change that touches several objects).
STR, INT, STRS, REPLICAS, RECORDS = "a string", "an integer >= 0", "a list of strings", "a list of replicas", \
    "a list of records"
#: op -> {field: (kind, required)}; a field that is not required may also be absent or null (older journals).
SCHEMA: dict[str, dict[str, tuple[str, bool]]] = {
    "journal": {"format": (INT, True)},
    "segment": {"segment_id": (STR, True), "address": (STR, True), "size": (INT, True), "shm_path": (STR, True),
                "host_id": (STR, True), "public_key": (STR, False), "read_addresses": (STRS, False)},
    "drop_segment": {"segment_id": (STR, True), "reason": (STR, False)},
    "object": {"key": (STR, True), "size": (INT, True), "replica_num": (INT, False), "replicas": (REPLICAS, True),
               "checksum": (STR, False)},
    "remove": {"key": (STR, True)},
    "lost": {"key": (STR, True), "message": (STR, False), "size": (INT, True), "replica_num": (INT, False),
             "checksum": (STR, False), "places": (REPLICAS, False)},
    "removed": {"key": (STR, True), "generation": (INT, True)},
    "forget_lost": {},
    "put_ids": {"below": (INT, True)},
    "batch": {"records": (RECORDS, True)},
}


def encode(record: dict, seq: int) -> bytes:
    """One line of the journal: ``record`` with its sequence number and checksum, newline last."""
    prefix = json.dumps({"seq": seq, **record}, separators=(",", ":")).encode()[:-1]
    return prefix + _SUM + b"%016x" % xxhash.xxh3_64_intdigest(prefix) + b'"}\n'


def header() -> dict:
    return {"op": "journal", "format": FORMAT}


class Reader:
    """Decodes a journal's lines in order, refusing the first that is not what was written (see the module)."""

    def __init__(self, path: str):
        self.path = path
        self.versioned: bool | None = None  # None until the first line says which format the journal has
        self.seq = 0

    def refuse(self, number: int, what: str) -> JournalError:
        return JournalError(f"journal {self.path}: line {number} {what}; refusing to start (restore the journal from "
                            "a copy, or move it away: a master started without it takes back what segments offer)")

    def decode(self, line: bytes, number: int) -> dict:
        """The record of line ``number`` (1-based), checked; raises JournalError naming the line."""
        if self.versioned is None:
            self.versioned = _SUM in line
        if self.versioned:
            record = self._checked(line, number)
        else:
            record = self._parsed(line, number)
            if "sum" in record or "seq" in record:
                raise self.refuse(number, "carries a checksum, but the journal's first line has none (a journal "
                                          "of two formats)")
        self.check(record, number)
        return record

    def _parsed(self, line: bytes, number: int) -> dict:
        try:
            record = json.loads(line)
        except ValueError:
            raise self.refuse(number, f"is not valid JSON ({_show(line)})") from None
        if not isinstance(record, dict):
            raise self.refuse(number, f"is not a record (a JSON object): {_show(line)}")
        return record

    def _checked(self, line: bytes, number: int) -> dict:
        cut = line.rfind(_SUM)
        if cut < 0 or len(line) != cut + len(_SUM) + _SUM_HEX + 2 or not line.endswith(b'"}'):
            raise self.refuse(number, f"has no checksum ({_show(line)})")
        if line[cut + len(_SUM):-2] != b"%016x" % xxhash.xxh3_64_intdigest(line[:cut]):
            raise self.refuse(number, f"does not match its checksum: its bytes changed since they were written "
                                      f"({_show(line)})")
        record = self._parsed(line, number)
        record.pop("sum", None)
        seq = record.pop("seq", None)
        if number == 1 and record.get("op") != "journal":
            raise self.refuse(number, "is not the journal's header")
        if type(seq) is not int or seq != self.seq:
            raise self.refuse(number, f"has sequence number {seq!r} where {self.seq} comes next: records are "
                                      "missing or repeated before it")
        self.seq += 1
        return record

    def check(self, record: dict, number: int, nested: bool = False) -> None:
        """Every field the record's op needs, of its kind (a batch's records too, one level deep)."""
        op = record.get("op")
        schema = SCHEMA.get(op) if isinstance(op, str) else None
        if schema is None or (op == "journal") != (number == 1 and self.versioned is True and not nested):
            raise self.refuse(number, f"has an unknown op {op!r}" if schema is None
                              else f"has a {op!r} record where it does not belong")
        if op == "journal" and record.get("format") != FORMAT:
            raise self.refuse(number, f"says the journal has format {record.get('format')!r}; this master reads "
                                      f"format {FORMAT} (a newer engram wrote it)")
        for name, (kind, required) in schema.items():
            value = record.get(name)
            if value is None and not required:
                continue
            if not _is(kind, value):
                got = "nothing" if name not in record else f"{type(value).__name__} {_show(value)}"
                raise self.refuse(number, f"({op} record): field {name!r}: expected {kind}, got {got}")
        if op == "batch":
            for inner in record["records"]:
                if inner.get("op") == "batch":
                    raise self.refuse(number, "(batch record): a batch inside a batch")
                self.check(inner, number, nested=True)


def _is(kind: str, value: object) -> bool:
    if kind == STR:
        return isinstance(value, str)
    if kind == INT:
        return type(value) is int and value >= 0
    if kind == STRS:
        return isinstance(value, list) and all(isinstance(v, str) for v in value)
    if kind == REPLICAS:
        return isinstance(value, list) and all(
            isinstance(r, list) and len(r) in (2, 3) and isinstance(r[0], str) and all(_is(INT, v) for v in r[1:])
            for r in value)
    return isinstance(value, list) and all(isinstance(r, dict) for r in value)  # RECORDS


def _show(value: object, limit: int = 80) -> str:
    text = value.decode("utf-8", "replace") if isinstance(value, bytes) else repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."
