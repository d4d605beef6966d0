"""The console scripts as a user meets them: help in one style, quiet pipes, waits that say what they wait for,
and errors in the words of the command line."""
from __future__ import annotations

import logging
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from engram_store.testing import Cluster, free_port, spawn_segment

pytestmark = pytest.mark.timeout(180)

ROOT = Path(__file__).resolve().parent.parent
#: [project.scripts] of pyproject.toml: console script -> "module:function".
SCRIPTS = dict(re.findall(r'^(engram-[\w-]+) = "([\w.:]+)"$',
                          (ROOT / "pyproject.toml").read_text().split("[project.scripts]")[1].split("\n[")[0], re.M))
#: Every help page a user can ask for: (script, arguments before --help).
PAGES = [(name, []) for name in SCRIPTS] + [("engram-master", ["status"]), ("engram-master", ["keygen"])] + \
        [("engram-layers", [command]) for command in ("list", "verify", "remove")]


def _entry(name: str):
    module, _, function = SCRIPTS[name].partition(":")
    return getattr(__import__(module, fromlist=[function]), function)


def _run(name: str, *argv: str, **kwargs) -> subprocess.CompletedProcess:
    module = SCRIPTS[name].partition(":")[0]
    code = f"import sys; from {module} import main; sys.exit(main())"
    kwargs.setdefault("stdout", subprocess.PIPE)
    return subprocess.run([sys.executable, "-c", code, *argv], stderr=subprocess.PIPE, text=True, timeout=120,
                          **kwargs)


def _options(help_text: str) -> list[str]:
    """Each option's entry in a help page: its line and the lines of its help under it."""
    entries: list[str] = []
    for line in help_text.splitlines():
        if re.match(r"^  -", line):
            entries.append(line)
        elif entries and entries[-1] and re.match(r"^ {4,}\S", line):
            entries[-1] += " " + line.strip()
        elif not line.startswith("    "):
            entries.append("")  # a section ends the entry
    return [e for e in entries if e]


@pytest.mark.parametrize("name, before", PAGES, ids=[" ".join([n, *b]) for n, b in PAGES])
def test_help_is_plain_and_gives_every_default(name, before, capsys):
    assert _entry(name)([*before, "--help"]) == 0
    text = capsys.readouterr().out
    assert text.startswith("usage: ")
    assert "``" not in text and ":class:" not in text and ":func:" not in text  # no RST markup
    for entry in _options(text):
        if entry.lstrip().startswith("-h, --help"):
            continue
        words = " ".join(entry.split())
        assert "default" in words or "required" in words, f"{name} {' '.join(before)}: no default in {entry!r}"
    if (not before) != (name == "engram-layers"):  # engram-layers takes its options after the command
        assert re.search(r"--log-level LEVEL .*DEBUG, INFO, WARNING, ERROR", " ".join(text.split())), text


def test_usage_lists_the_subcommands(capsys):
    assert _entry("engram-master")(["--help"]) == 0
    usage = capsys.readouterr().out.split("\n\n")[0]
    assert "engram-master status" in usage and "engram-master keygen" in usage and "--wait-segments" in usage
    assert _entry("engram-layers")(["--help"]) == 0
    assert "{list,verify,remove}" in capsys.readouterr().out.split("\n\n")[0]


def test_log_levels_are_the_same_everywhere_and_any_case(capsys):
    for name in SCRIPTS:
        argv = ["list", "--disk-dir", "."] if name == "engram-layers" else []
        code = _entry(name)([*argv, "--log-level", "verbose", "--help"])
        assert code == 2 and "invalid choice: 'VERBOSE'" in capsys.readouterr().err, name
    assert _entry("engram-warmup")(["--log-level", "warning", "--help"]) == 0


def _closed_pipe(name: str, *argv: str) -> subprocess.CompletedProcess:
    read, write = os.pipe()
    os.close(read)  # the reader is gone before the first byte, as `| head -1` is after its line
    try:
        return _run(name, *argv, stdout=write)
    finally:
        os.close(write)


@pytest.mark.parametrize("name", sorted(SCRIPTS))
def test_help_into_a_closed_pipe_ends_quietly(name):
    result = _closed_pipe(name, "--help")
    assert result.returncode in (0, 141) and "Traceback" not in result.stderr, result.stderr


def test_output_into_a_closed_pipe_ends_quietly(tmp_path):
    (tmp_path / "layer-1.tmp").mkdir()  # something to list
    result = _closed_pipe("engram-layers", "list", "--disk-dir", str(tmp_path))
    assert result.returncode == 141 and "Traceback" not in result.stderr and not result.stderr, result.stderr
    with Cluster(segments=0) as c:
        result = _closed_pipe("engram-master", "status", "--master", c.address)
    assert result.returncode == 141 and not result.stderr, result.stderr


def test_status_of_a_port_where_nothing_listens_answers_at_once():
    start = time.monotonic()
    result = _run("engram-master", "status", "--master", f"127.0.0.1:{free_port()}")
    assert time.monotonic() - start < 5
    assert result.returncode == 1 and "nothing listens there" in result.stderr and "no reply" in result.stderr
    assert "status: status:" not in result.stderr


def test_status_of_a_port_that_does_not_answer_says_so_after_a_second():
    with socket.socket() as silent:  # accepts connections, never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        address = "127.0.0.1:%d" % silent.getsockname()[1]
        proc = subprocess.Popen([sys.executable, "-m", "engram_store.master", "status", "--master", address, "--timeout", "3"],
                                stderr=subprocess.PIPE, text=True)
        try:
            start = time.monotonic()
            first = proc.stderr.readline()
            assert time.monotonic() - start < 2.5 + 1.0  # start-up, then one second
            assert "accepts connections but has not answered" in first and "--auth DIR" in first
            rest = proc.stderr.read()
            assert proc.wait(30) == 1
        finally:
            proc.kill()
            proc.wait()
            proc.stderr.close()
    assert "did not answer as an engram master" in rest and "status: status:" not in rest


def test_status_waits_for_segments_started_in_the_background():
    with Cluster(segments=0) as c:
        spawned = [spawn_segment(c.address, "16MiB") for _ in range(2)]
        try:
            result = _run("engram-master", "status", "--master", c.address, "--wait-segments", "2", "--timeout", "60")
            assert result.returncode == 0, result.stderr
            assert "2 segment(s)" in result.stdout
            start = time.monotonic()
            result = _run("engram-master", "status", "--master", c.address, "--wait-segments", "3", "--timeout", "2")
            assert result.returncode == 1 and "2 of 3 segment(s) registered" in result.stderr
            assert "waiting up to 2 s for 3 segment(s)" in result.stderr
            assert time.monotonic() - start < 30
        finally:
            for proc in spawned:
                proc.close()


def test_status_waits_for_a_master_that_is_still_starting():
    port = free_port()
    status = subprocess.Popen([sys.executable, "-m", "engram_store.master", "status", "--master", f"127.0.0.1:{port}",
                               "--wait-segments", "1", "--timeout", "90"], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
    try:
        with Cluster(segments=1, port=port):
            out, err = status.communicate(timeout=120)
    finally:
        status.kill()
        status.wait()
    assert status.returncode == 0, err
    assert "1 segment(s)" in out


def test_warmup_says_what_it_compiles(capsys):
    assert _entry("engram-warmup")([]) == 0
    out = capsys.readouterr().out
    assert "compiling 5 kernel groups" in out
    for i in range(1, 6):
        assert f"[{i}/5]" in out
    assert "every kernel ready" in out


def test_loader_and_demo_name_the_flags_on_a_wrong_port(capsys):
    address = f"127.0.0.1:{free_port()}"
    assert _entry("engram-load-v41")([str(_toy_config().parent), "--master", address]) == 1
    err = capsys.readouterr().err
    assert f"--master {address}" in err and "--auth DIR" in err and "auth_dir=" not in err
    assert _entry("engram-demo")(["--master", address]) == 1
    err = capsys.readouterr().err
    assert f"--master {address}" in err and "auth_dir=" not in err


_TOY: list[Path] = []


def _toy_config() -> Path:
    if not _TOY:
        import tempfile

        from engram_model.v41 import V41Config, write_toy_checkpoint

        directory = Path(tempfile.mkdtemp(prefix="engram-test-toy-"))
        write_toy_checkpoint(str(directory), V41Config(layer_ids=[1, 14], n_heads=2, head_dim=64,
                                                       engram_vocab_size=300, compressed_vocab_size=100,
                                                       hidden_size=64))
        _TOY.append(directory)
    return _TOY[0] / "config.json"


@pytest.fixture(scope="module", autouse=True)
def _remove_the_toy():
    yield
    import shutil

    for directory in _TOY:
        shutil.rmtree(directory, ignore_errors=True)
    _TOY.clear()  # a worker given more of this module's tests later makes the toy again


def test_loader_errors_name_the_argument_the_user_gave(tmp_path, capsys, caplog):
    load = _entry("engram-load-v41")
    assert load([str(tmp_path / "nowhere"), "--disk-dir", str(tmp_path / "ssd")]) == 2
    assert "CHECKPOINT_DIR: no such file or directory" in capsys.readouterr().err
    assert load([str(tmp_path), "--config", str(tmp_path / "nope.json"), "--disk-dir", str(tmp_path / "ssd")]) == 2
    assert "--config: no such file or directory" in capsys.readouterr().err
    assert load([str(tmp_path), "--disk-dir", str(tmp_path / "ssd")]) == 2  # a directory without config.json
    assert "CHECKPOINT_DIR: no config.json in" in capsys.readouterr().err
    assert load([str(tmp_path), "--config", str(_toy_config()), "--disk-dir", str(tmp_path / "ssd")]) == 2
    err = capsys.readouterr().err
    assert "CHECKPOINT_DIR: " in err and "safetensors" in err and "path:" not in err
    checkpoint = str(_toy_config().parent)
    ssd = str(tmp_path / "ssd")
    with caplog.at_level(logging.WARNING):
        assert load([checkpoint, "--disk-dir", ssd, "--layers", "1", "--no-progress"]) == 0
    assert "did not exist" not in caplog.text + capsys.readouterr().err  # a loader makes its disk_dir: no warning
    assert load([checkpoint, "--disk-dir", ssd, "--layers", "1", "--no-progress"]) == 1
    err = capsys.readouterr().err
    assert f"engram-layers remove --disk-dir {ssd} 1" in err and "path_or_dict" not in err


def test_from_hf_config_says_which_config_is_missing(tmp_path):
    from engram_model.v41 import V41Config
    from engram_store import ConfigError

    with pytest.raises(ConfigError, match="no config.json in the directory") as caught:
        V41Config.from_hf_config(str(tmp_path))
    assert "path_or_dict" not in str(caught.value)


def test_stats_names_tokens_and_config(tmp_path, capsys):
    stats = _entry("engram-stats")
    assert stats([str(tmp_path / "ids.npy")]) == 2
    assert "TOKENS: cannot read" in capsys.readouterr().err
    (tmp_path / "ids.txt").write_text("1 2 3\n")
    assert stats([str(tmp_path / "ids.txt"), "--config", str(tmp_path / "none.json")]) == 2
    assert "--config: cannot read" in capsys.readouterr().err


def test_a_new_disk_dir_is_created_and_a_reader_of_it_is_told_to_check_the_path(tmp_path, caplog):
    import numpy as np

    from engram_store import EngramStore, EngramStoreConfig, ObjectNotFound

    config = EngramStoreConfig(table_vocab_sizes=[10], embedding_dim=8)
    with caplog.at_level(logging.WARNING):
        with EngramStore(1, config, disk_dir=str(tmp_path / "typo")) as store:
            with pytest.raises(ObjectNotFound, match=r"disk_dir did not exist: .*created it.*check the path"):
                store.lookup(np.zeros((1, 1, 1), np.int64))
        with EngramStore(1, config, disk_dir=str(tmp_path / "typo")) as store:  # there now: a plain not-published
            with pytest.raises(ObjectNotFound) as caught:
                store.lookup(np.zeros((1, 1, 1), np.int64))
            assert "did not exist" not in str(caught.value)
        with EngramStore(1, config, disk_dir=str(tmp_path / "new")) as writer:  # made to be written: no warning
            writer.populate([np.zeros((10, 8), np.float32)])
    assert not any("did not exist" in r.getMessage() for r in caplog.records), caplog.text


def test_a_read_only_disk_dir_names_the_directory(tmp_path, monkeypatch):
    import errno

    import numpy as np

    from engram_store import EngramStore, EngramStoreConfig, StoreError

    directory = tmp_path / "ro"
    directory.mkdir()
    config = EngramStoreConfig(table_vocab_sizes=[10], embedding_dim=8)
    layer = EngramStore(1, config, disk_dir=str(directory))
    directory.chmod(0o555)
    if os.geteuid() == 0:  # root writes anywhere: refuse the way a read-only directory does
        from engram_store.disk import _files

        real_open = os.open

        def refusing_open(path, flags, *args, dir_fd=None):
            where = str(path) if dir_fd is None else os.path.join(os.readlink(f"/proc/self/fd/{dir_fd}"), path)
            if where.startswith(str(directory)) and flags & os.O_CREAT:
                raise PermissionError(errno.EACCES, "Permission denied", path)
            return real_open(path, flags, *args, dir_fd=dir_fd)

        monkeypatch.setattr(_files.os, "open", refusing_open)
    try:
        with pytest.raises(StoreError) as caught:
            layer.populate([np.zeros((10, 8), np.float32)])
    finally:
        directory.chmod(0o755)
        layer.close()
    message = str(caught.value)
    assert f"cannot write under disk_dir {directory}" in message and "layer-1.lock" in message
    assert "layer-1.tmp" not in message


def test_a_segment_file_in_a_missing_directory_is_named(tmp_path):
    result = _run("engram-segment", "--file", str(tmp_path / "no" / "seg.bin"), "--size", "16MiB")
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert f"--file {tmp_path / 'no' / 'seg.bin'}: no directory {tmp_path / 'no'}" in result.stderr
