"""What has been verified of a feature cache (shards, and the data check), so that it is done once.

Every process used to hash the whole cache at every start (a 27B cache of 800K sequences is
terabytes, read once per GPU) and to read the prompts again. `Stamp` records each verification
with the state of the files it covered; `dflash.data.cache.FeatureCache.verify_all` and
`dflash.train.sources.check_data` skip what a stamp vouches for.
"""

from __future__ import annotations

import logging
from pathlib import Path

from dflash.io import read_json, write_json
from dflash.layout import CacheLayout

log = logging.getLogger(__name__)

STAMP_VERSION = 1


def file_state(path: Path) -> dict[str, int]:
    """What changes whenever a file's bytes can have changed through the file system: its size, mtime,
    ctime (which no tool sets back: a write, os.utime, `cp -p` and `rsync -a` all leave a new one) and
    inode (a copy is another file)."""
    st = Path(path).stat()
    return {"bytes": st.st_size, "mtime_ns": st.st_mtime_ns, "ctime_ns": st.st_ctime_ns, "inode": st.st_ino}


def _read_stamp(path: Path) -> dict:
    try:
        stamp = read_json(path)
    except (OSError, ValueError):  # missing, half-copied or unreadable: it vouches for nothing
        return {}
    return stamp if isinstance(stamp, dict) and stamp.get("version") == STAMP_VERSION else {}


class Stamp:
    """What has been verified of a cache, so that a shard is hashed once: not by every process at every
    start (a 27B cache of 800K sequences is terabytes).

    Process r keeps `verified/rank-<r>.json` (CacheLayout.stamp): only it writes that file, every
    process reads them all. It holds
    - shards: file name -> digest and file state (`file_state`) when it was hashed, by the writer at
      extraction or by the process that verified it. A record vouches for a shard while the shard's
      state is the same and the digest is the manifest's; any change through the file system (a
      rewrite, a copy, bytes flipped and the mtime set back) gives a new state, and the shard is hashed
      again. Corruption below the file system (failing media under an unchanged inode) is caught only
      by the first check.
    - corrupt: the shards this process found corrupt at its last verification, with their state and the
      error, so that every process refuses them.
    - data: the last data check (dflash.train.sources.check_data): its key (the prompts files' states
      and the data.* settings that pick prompts) and what reading the prompts gave.
    A stamp that cannot be written (a read-only cache folder) is skipped with a warning: the next start
    hashes again.
    """

    def __init__(self, root: Path, rank: int = 0):
        self.layout, self.rank = CacheLayout(Path(root)), rank
        own = self.read(rank)
        self.shards: dict[str, dict] = own.get("shards", {})
        self.corrupt: dict[str, dict] = {}
        self.data: dict | None = own.get("data")
        self.refresh()

    def read(self, rank: int) -> dict:
        """Process `rank`'s stamp as last saved."""
        return _read_stamp(self.layout.stamp(rank))

    def refresh(self) -> None:
        """Read the other processes' stamps again (after waiting for them: what they verified meanwhile)."""
        own = self.layout.stamp(self.rank)
        self._others = [_read_stamp(p) for p in self.layout.stamps() if p != own]

    def vouches(self, name: str, sha256: str, state: dict) -> bool:
        record = {**state, "sha256": sha256}
        return self.shards.get(name) == record or any(s.get("shards", {}).get(name) == record for s in self._others)

    def still_corrupt(self, rank: int) -> dict[str, dict]:
        """The shards process `rank` found corrupt at its last verification, where their files are unchanged."""
        def unchanged(name: str, record: dict) -> bool:
            path = self.layout.path / name
            return path.exists() and {**file_state(path), "error": record.get("error")} == record

        return {name: r for name, r in self.read(rank).get("corrupt", {}).items() if unchanged(name, r)}

    def add(self, name: str, sha256: str, state: dict) -> None:
        self.shards[name] = {**state, "sha256": sha256}
        self.corrupt.pop(name, None)

    def data_result(self, key: dict) -> dict | None:
        """What a data check with this key found, in this or another process (None: never checked)."""
        for data in (self.data, *(s.get("data") for s in self._others)):
            if isinstance(data, dict) and data.get("key") == key and isinstance(data.get("result"), dict):
                return data["result"]
        return None

    def save(self) -> None:
        path = self.layout.stamp(self.rank)
        try:
            path.parent.mkdir(exist_ok=True)
            write_json(path, {"version": STAMP_VERSION, "shards": self.shards, "corrupt": self.corrupt,
                              "data": self.data}, indent=None)
        except OSError as e:
            log.warning("could not record what was verified of %s in %s (%s): the next start verifies it again",
                        self.layout.path, path, e)
