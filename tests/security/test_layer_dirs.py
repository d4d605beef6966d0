"""Directories of layers (``disk_dir``, ``local_dir``) on a host with another local user.

The intruder (a second, unprivileged user, see ``security_helpers.py``) cannot write in the victim's directories, so
it works on what the victim resolves: a link of its own named as the directory, swapped after the victim's checks
(the victim served the intruder's rows, and published into the intruder's directory), or files and directories
under a layer that someone left to it (it filled a data file with its own rows, and swapped two head files). The
victim (this process, root) must refuse each before it reads or writes anything there, naming what it found.
"""
import os

import numpy as np
import pytest

from engram_store import EngramStore, EngramStoreConfig, UnsafeFile
from security_helpers import intruder

pytestmark = pytest.mark.timeout(120)

# 8-byte rows fill their pages: no page checksum stands between a forged file and the rows served
CONFIG = EngramStoreConfig([40, 40], 8, row_format="bytes")
IDS = np.stack(np.meshgrid(np.arange(40), np.arange(40), indexing="ij"), axis=-1).reshape(1, -1, 2)
FORGED = 0x66


def _tables() -> list[np.ndarray]:
    rng = np.random.default_rng(48)
    return [rng.integers(0, FORGED, (n, 8), dtype=np.uint8) for n in CONFIG.table_vocab_sizes]


def _expected(tables: list[np.ndarray]) -> np.ndarray:
    return np.stack([tables[h][IDS[..., h]] for h in range(2)], axis=-2)


def _owned_by_intruder(path: str) -> None:
    for where, dirs, files in os.walk(path):
        for name in [where] + [os.path.join(where, f) for f in dirs + files]:
            os.chown(name, 65534, 65534)


def _forged_disk_dir(path: str) -> None:
    """A disk_dir of the intruder's whose layer 1 holds its own rows (every byte FORGED)."""
    os.mkdir(path)
    with EngramStore(1, CONFIG, disk_dir=path) as store:
        store.populate([np.full((n, 8), FORGED, np.uint8) for n in CONFIG.table_vocab_sizes])
    _owned_by_intruder(path)


def test_a_link_of_another_user_to_a_disk_dir_is_refused_before_it_is_swapped(shared):
    """The intruder's link names the victim's directory while the victim opens it, and the intruder's own once it
    has: the victim's next layer came from there, rows 0x66 ("666.0" as float16). The link is refused at once."""
    victim, link = os.path.join(shared, "victim-ssd"), os.path.join(shared, "engram-ssd")
    os.mkdir(victim)
    _forged_disk_dir(os.path.join(shared, "intruder-ssd"))
    intruder("symlink", victim, link)
    with pytest.raises(UnsafeFile, match=rf"disk_dir: {link} is a symbolic link of uid 65534, who may point it "
                                         r"elsewhere at any time; .* pass the directory's own path"):
        with EngramStore(1, CONFIG, disk_dir=link) as store:
            assert intruder("relink", os.path.join(shared, "intruder-ssd"), link) == "relinked"
            rows = store.lookup(IDS)
            assert not (rows == FORGED).all(), "the victim served the intruder's rows"


def test_a_link_of_another_user_to_a_local_dir_is_refused_before_the_victim_publishes_through_it(shared):
    """Swapped after the victim's checks, the link made the victim publish its tables into the intruder's directory
    (where the intruder then swapped layer-1 and layer-2 under later readers)."""
    victim, theirs, link = (os.path.join(shared, name) for name in ("victim-tables", "intruder-tables", "tables"))
    os.mkdir(victim)
    intruder("mkdir", theirs)
    intruder("symlink", victim, link)
    with pytest.raises(UnsafeFile, match=rf"local_dir: {link} is a symbolic link of uid 65534"):
        with EngramStore(1, CONFIG, local_dir=link) as store:
            assert intruder("relink", theirs, link) == "relinked"
            store.populate(_tables())
    assert os.listdir(theirs) == [], "the victim published into the intruder's directory"


def test_a_disk_dir_data_file_another_user_owns_is_refused_and_never_read(shared):
    """A layer's data file handed to the intruder (a copy that kept its owner): it writes its own rows into it, and
    the victim served them; files under a disk_dir were never checked for their owner."""
    disk = os.path.join(shared, "ssd")
    os.mkdir(disk)
    with EngramStore(1, CONFIG, disk_dir=disk) as store:
        store.populate(_tables())
    rows = os.path.join(disk, "layer-1", "rows.bin")
    os.chown(rows, 65534, 65534)
    os.chmod(rows, 0o644)
    assert intruder("fill", rows, FORGED) == "filled"
    with pytest.raises(UnsafeFile, match=rf"disk layer: {rows} \(uid 65534, mode 0644\) is not a file of this user"):
        with EngramStore(1, CONFIG, disk_dir=disk) as store:
            assert not (store.lookup(IDS) == FORGED).all(), "the victim served the intruder's rows"


def test_a_local_dir_layer_directory_another_user_owns_is_refused(shared):
    """The intruder owns a published layer's directory (not its files, which are the victim's and read-only): it
    swaps head-0.bin and head-1.bin, and the victim served head 1's rows as head 0's."""
    tables = os.path.join(shared, "tables")
    os.mkdir(tables)
    published = _tables()
    with EngramStore(1, CONFIG, local_dir=tables) as store:
        store.populate(published)
    layer = os.path.join(tables, "layer-1")
    os.chown(layer, 65534, 65534)
    assert intruder("swap", os.path.join(layer, "head-0.bin"), os.path.join(layer, "head-1.bin")) == "swapped"
    with pytest.raises(UnsafeFile, match=rf"local_dir: {layer} \(uid 65534, mode \d{{4}}\) is not a directory of this "
                                         "user"):
        with EngramStore(1, CONFIG, local_dir=tables) as store:
            np.testing.assert_array_equal(store.lookup(IDS), _expected(published),
                                          err_msg="the victim served head 1's rows as head 0's")
