"""The journal's file: every record read back is the one written, or the master refuses to start naming the line;
a record cut short by a crash is dropped with a warning; an append the disk refuses leaves the file as it was."""

import json
import logging
import os
import re
from pathlib import Path

import pytest

from engram_store import JournalError
from engram_store.master._journal import Journal, parse
from engram_store.master._journal_format import encode
from suite_helpers import fill_up

RECORDS = [
    {"op": "segment", "segment_id": "s1", "address": "127.0.0.1:1", "size": 4096, "shm_path": "", "host_id": "h",
     "public_key": "", "read_addresses": []},
    {"op": "object", "key": "k\u00e9", "size": 100, "replica_num": 1, "replicas": [["s1", 0, 7]], "checksum": "cc"},
    {"op": "batch", "records": [{"op": "remove", "key": "k\u00e9"}, {"op": "removed", "key": "x", "generation": 3}]},
]


def _journal(tmp_path, records=RECORDS, name="journal") -> str:
    journal = Journal(str(tmp_path / name))
    journal.rewrite(records[:1])
    for record in records[1:]:
        journal.append(record)
    journal.release()
    return str(tmp_path / name)


def _read(path: str) -> list[dict]:
    journal = Journal(path)
    try:
        return journal.read()
    finally:
        journal.release()


def test_records_come_back_as_they_were_written(tmp_path):
    path = _journal(tmp_path)
    assert _read(path) == RECORDS
    lines = Path(path).read_bytes().splitlines()
    assert [json.loads(line)["seq"] for line in lines] == [0, 1, 2, 3]  # a header, then one number per record


def test_every_flipped_bit_is_refused_naming_its_line(tmp_path):
    """Any one bit of the file flipped: the master refuses, naming the line, never replays a changed record. The
    last newline is the exception: a last line without it is a torn record (below)."""
    path = _journal(tmp_path)
    data = Path(path).read_bytes()
    starts = [0] + [i + 1 for i, b in enumerate(data) if b == 0x0A]
    for at in range(len(data) - 1):
        for bit in (0, 5):
            damaged = bytearray(data)
            damaged[at] ^= 1 << bit
            line = sum(1 for s in starts if s <= at)
            with pytest.raises(JournalError, match=r"line \d+ .*refusing to start") as caught:
                parse(bytes(damaged), path)
            named = int(str(caught.value).split("line ")[1].split()[0])
            assert named <= line, (at, bit, str(caught.value))  # a merged or split line is named where it starts


@pytest.mark.parametrize("line, why", [
    (b'[1,2]', "is not a record"),
    (b'{"op":"object","key":"k","replicas":[]}', "field 'size': expected an integer >= 0, got nothing"),
    (b'{"op":"object","key":"k","size":"12","replicas":[]}', "field 'size': expected an integer >= 0, got str"),
    (b'{"op":"object","key":"k","size":1,"replicas":[["s1"]]}', "field 'replicas': expected a list of replicas"),
    (b'{"op":"remove"}', "field 'key': expected a string, got nothing"),
    (b'{"op":"frobnicate"}', "unknown op 'frobnicate'"),
    (b'{"op":"batch","records":[{"op":"remove","key":1}]}', "field 'key': expected a string, got int"),
    (b'{"key":"k"', "is not valid JSON"),
])
def test_a_malformed_record_is_refused_naming_the_line_in_either_format(tmp_path, line, why):
    """The checksum proves the bytes are what was written; the schema that what was written is a record."""
    legacy = tmp_path / "legacy"
    legacy.write_bytes(b'{"op":"forget_lost"}\n' + line + b'\n{"op":"forget_lost"}\n')
    versioned = tmp_path / "versioned"
    record = json.loads(line) if line.startswith(b"{") and line.endswith(b"}") else None
    if record is not None:
        versioned.write_bytes(encode({"op": "journal", "format": 2}, 0) + encode(record, 1))
    for path, number in [(legacy, 2)] + ([(versioned, 2)] if record is not None else []):
        with pytest.raises(JournalError, match=rf"journal .*: line {number} .*{re.escape(why)}"):
            _read(str(path))


def test_a_record_lost_or_repeated_in_the_middle_is_refused(tmp_path):
    path = _journal(tmp_path)
    lines = Path(path).read_bytes().splitlines(keepends=True)
    Path(path).write_bytes(b"".join(lines[:2] + lines[3:]))
    with pytest.raises(JournalError, match="line 3 has sequence number 3 where 2 comes next"):
        _read(path)
    Path(path).write_bytes(b"".join(lines[:3] + lines[2:]))
    with pytest.raises(JournalError, match="line 4 has sequence number 2 where 3 comes next"):
        _read(path)


def test_a_journal_of_the_earlier_format_is_read_and_one_of_two_formats_refused(tmp_path):
    path = tmp_path / "old"
    path.write_bytes(b"".join(json.dumps(r, separators=(",", ":")).encode() + b"\n" for r in RECORDS))
    assert _read(str(path)) == RECORDS
    path.write_bytes(path.read_bytes() + encode({"op": "forget_lost"}, 4))
    with pytest.raises(JournalError, match="line 4 carries a checksum, but the journal's first line has none"):
        _read(str(path))


def test_a_torn_last_record_is_dropped_with_a_warning_and_a_cut_at_a_boundary_reads_shorter(tmp_path, caplog):
    path = _journal(tmp_path)
    data = Path(path).read_bytes()
    last = data.rindex(b"\n", 0, len(data) - 1) + 1
    for cut in range(last + 1, len(data)):
        Path(path).write_bytes(data[:cut])
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="engram_store.master._journal"):
            assert _read(path) == RECORDS[:-1]
        assert "line 4" in caplog.text and "cut short by a crash" in caplog.text
    Path(path).write_bytes(data[:last])  # whole records: nothing here can tell (segments do, at registration)
    assert _read(path) == RECORDS[:-1]


def test_appends_to_a_full_disk_fail_whole_and_leave_every_acknowledged_record(tmpfs):
    """Until the disk is full every append that returned is read back; the one that failed left nothing (not even
    part of its line, which would have made the journal unreadable); once there is room appends go on."""
    where = tmpfs("256k")
    journal = Journal(str(where / "journal"))
    journal.rewrite([])
    fill_up(str(where / "filler"))
    written = []
    with pytest.raises(JournalError, match="cannot write a record: No space left on device; the change was not "
                                           "made"):
        for n in range(100_000):
            record = {"op": "removed", "key": f"key-{n}-" + "x" * (n % 300), "generation": n}
            journal.append(record)
            written.append(record)
    size = os.path.getsize(journal.path)
    with pytest.raises(JournalError):
        journal.append(record)  # again: refused again, the file as it was
    assert os.path.getsize(journal.path) == size
    os.unlink(str(where / "filler"))
    journal.append({"op": "forget_lost"})
    journal.release()
    assert _read(str(where / "journal")) == written + [{"op": "forget_lost"}]


def test_a_record_that_contradicts_the_ones_before_it_is_refused_not_replayed():
    from engram_store.master import MasterState

    records = [RECORDS[0], {**RECORDS[0], "size": 8192}]
    with pytest.raises(JournalError, match=r"record 2 \(segment\) cannot be replayed: segment s1: registered with "
                                           "size 4096, now claims 8192; refusing to start"):
        MasterState().replay(records)
