"""A serving process's Prometheus text (``metrics_text``, ``serve_metrics``): its values are stats()'s, its format
one family once with no repeated series, every family in docs/operating.md, and the endpoint serves what it
renders and stops."""
from __future__ import annotations

import re
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest

from engram_model.v41 import order_labels
from engram_store import EngramStore, EngramStoreConfig, InvalidArgument, InvalidType, metrics_text, serve_metrics
from engram_store.testing import free_port

pytestmark = pytest.mark.timeout(120)

SIZES = [300, 200]
CONFIG = EngramStoreConfig(table_vocab_sizes=SIZES, embedding_dim=16, row_format="bytes")
OPERATING = Path(__file__).resolve().parents[2] / "docs" / "operating.md"
SAMPLE = re.compile(r'^([a-z_]+)(?:\{(.*)\})? (\S+)$')


def _parse(text: str) -> tuple[dict[str, str], dict[tuple[str, str], float]]:
    """(family -> type, (name, labels) -> value), failing on what the text format does not allow."""
    types, samples, helps = {}, {}, set()
    for line in text.splitlines():
        if line.startswith("# HELP "):
            name = line.split()[2]
            assert name not in helps, f"a second HELP for {name}"
            helps.add(name)
        elif line.startswith("# TYPE "):
            _, _, name, kind = line.split()
            assert name not in types, f"a second TYPE for {name}"
            types[name] = kind
        else:
            m = SAMPLE.match(line)
            assert m, f"not a sample: {line!r}"
            key = (m.group(1), m.group(2) or "")
            assert key not in samples, f"a series twice: {line}"
            samples[key] = float(m.group(3))
    assert helps == set(types)
    return types, samples


@pytest.fixture(scope="module")
def published(tmp_path_factory):
    path = tmp_path_factory.mktemp("disk")
    with EngramStore({1: CONFIG, 14: CONFIG}, disk_dir=path) as writer:
        for layer in (1, 14):
            writer.populate([np.zeros((n, 16), np.uint8) for n in SIZES], layer=layer)
    return path


def _read(store, seed: int, layers=(1, 14)):
    rng = np.random.default_rng(seed)
    for _ in range(5):
        store.lookup_layers({lid: np.stack([rng.integers(0, 30, (2, 4)) for _ in SIZES], axis=-1) for lid in layers})


def test_values_are_stats_and_every_family_is_documented(published, tmp_path, monkeypatch):
    monkeypatch.setenv("ENGRAM_SHM_DIR", str(tmp_path / "shm"))
    with EngramStore({1: CONFIG, 14: CONFIG}, disk_dir=published, row_cache_bytes=1 << 16,
                     cache_scope="host") as host, \
            EngramStore({1: CONFIG, 14: CONFIG}, disk_dir=published, row_cache_bytes=1 << 16) as private, \
            EngramStore(3, CONFIG) as memory:
        memory.bind_local([np.zeros((n, 16), np.uint8) for n in SIZES])
        metrics_text([host, private, memory])  # from here on, disk reads are timed
        _read(host, 1)
        _read(private, 2)
        memory.lookup(np.zeros((1, 2, 2), np.int64))
        types, samples = _parse(metrics_text([host, private, memory], head_labels=order_labels(1)))
        st = host.stats(layer=14)
        assert samples[("engram_store_lookups_total", 'store="0",layer="14"')] == st["lookups"] == 5
        assert samples[("engram_store_rows_total", 'store="2",layer="3"')] == 4
        assert samples[("engram_store_pages_read_total", 'store="1",layer="1"')] == private.stats(layer=1)["pages_read"]
        assert samples[("engram_store_cache_misses_by_head_total", 'store="0",layer="14",head="1",order="3"')] \
            == st["cache_misses_per_head"][1]
        assert samples[("engram_store_host_cache_attaches_total", 'store="0",row_bytes="16"')] == 1
        assert samples[("engram_store_row_cache_capacity_rows", 'store="1",row_bytes="16"')] \
            == private._source.caches[16].capacity_rows
        ladder = st["hit_rate_by_size"]
        assert samples[("engram_store_predicted_hit_rate", f'store="0",layer="14",share="1.0",bytes="{ladder[-1]["bytes"]}"')] \
            == pytest.approx(ladder[-1]["hit_rate"])
        reads = samples[("engram_store_disk_requests_total", 'op="read",store="0"')]
        assert reads == 5 and samples[("engram_store_disk_request_seconds_count", 'op="read",store="0"')] == reads
        assert samples[("engram_store_disk_request_seconds_bucket", 'op="read",store="1",le="+Inf"')] == 5
        assert types["engram_store_disk_request_seconds"] == "histogram"
        documented = set(re.findall(r"`(engram_store_[a-z_]+)`", OPERATING.read_text()))
        missing = sorted(set(types) - documented)
        assert not missing, f"metrics docs/operating.md does not list: {missing}"
        assert host.stats(layer=14)["lookups"] == 5  # rendering resets nothing


def test_the_endpoint_serves_the_text_rendered_at_each_request(published):
    with EngramStore(1, CONFIG, disk_dir=published) as store:
        port = free_port()
        with serve_metrics(store, port=port) as endpoint:
            assert endpoint.port == port
            url = f"http://127.0.0.1:{port}/metrics"
            before = _parse(urllib.request.urlopen(url, timeout=10).read().decode())[1]
            _read(store, 3, layers=(1,))
            after = _parse(urllib.request.urlopen(url, timeout=10).read().decode())[1]
            key = ("engram_store_lookups_total", 'layer="1"')
            assert after[key] == before[key] + 5
            with pytest.raises(urllib.error.HTTPError, match="404"):
                urllib.request.urlopen(f"http://127.0.0.1:{port}/other", timeout=10)
            with pytest.raises(InvalidArgument, match=f"port: cannot serve metrics on 127.0.0.1:{port}"):
                serve_metrics(store, port=port)
        endpoint.close()  # idempotent
        with pytest.raises(urllib.error.URLError):
            urllib.request.urlopen(url, timeout=10)


@pytest.mark.parametrize("stores, port, error, message", [
    ([], 0, InvalidType, "stores: expected an EngramStore"),
    ("store", 0, InvalidType, "stores: expected an EngramStore"),
    (None, -1, InvalidArgument, "port: expected a port number"),
    (None, True, InvalidArgument, "port: expected a port number"),
])
def test_bad_arguments_are_refused(published, stores, port, error, message):
    with EngramStore(1, CONFIG, disk_dir=published) as store:
        with pytest.raises(error, match=message):
            serve_metrics(store if stores is None else stores, port=port)
