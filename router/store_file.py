"""`--responses-store-dir DIR`: a server's stored responses and conversations outlive its
process. They are read from DIR when the HTTP port opens, each change is appended to a
journal there as it is made, and the whole is written there when the port closes
(SIGTERM, Ctrl-C: a rolling restart, an upgrade), background responses still running
ending first, as "cancelled".

- A process killed outright (SIGKILL, the OOM killer) loses nothing it stored: the next
  one reads the last whole file, then the journal's changes after it. The journal is
  flushed to the kernel at each change, not synced to the disk: a host that loses power
  may lose its last changes. A background response the killed process left running reads
  "failed", naming why. Replayed, the store keeps what the writes left, the oldest written
  going first past its bound (a lookup's recency is not journaled).
- One JSON file, replaced whole (written beside it, then renamed): a stop midway leaves
  the last one. The journal is folded into it at start, at a clean stop, and when it
  grows past twice what the stores hold. A file that cannot be read is moved aside
  (`.unreadable`), logged, and the server starts with none; a journal line that cannot be
  read (a process killed mid-write leaves half a line) is skipped and logged. A restart
  into a smaller `--responses-store-mb` keeps the most recently used.
- One process keeps a directory: it holds DIR/lock while it runs, and another naming the
  same directory is refused at start (several routers: a directory each).
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
from pathlib import Path

from aiohttp import web

log = logging.getLogger("pdserve.router")

FILE, JOURNAL, VERSION = "stored.json", "journal.jsonl", 1
MIN_FOLD_CHARS = 2**20  # a running server folds its journal past twice the stores, never below this


def keep(app: web.Application, directory: str | None, stored, conversations) -> None:
    """Restore `stored` (responses_http.StoredResponses) and `conversations` from
    `directory` now, journal their changes there, and write them whole when `app` is
    cleaned up; nothing without one."""
    if directory is None:
        return
    path = Path(directory)
    try:
        path.mkdir(parents=True, exist_ok=True)
        lock = open(path / "lock", "w")
    except OSError as err:
        raise SystemExit(f"pdserve: --responses-store-dir {directory}: {err.strerror}") from None
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        lock.close()
        raise SystemExit(f"pdserve: --responses-store-dir {directory} is kept by another running server: "
                         "give each server a directory of its own") from None
    responses, kept_conversations = _load(path / FILE)
    stored.store.restore(responses)
    conversations.restore(kept_conversations)
    _replay(path / JOURNAL, stored.store, conversations)
    _fail_unfinished(stored.store)
    journal = Journal(path, stored.store, conversations)
    journal.fold()
    stored.store.journal = conversations.journal = journal.add

    async def write(_: web.Application) -> None:
        await stored.close()
        journal.fold()
        journal.close()
        lock.close()
        log.info("stored responses and conversations written to %s", path / FILE)

    app.on_cleanup.append(write)


class Journal:
    """The changes since the file was last written, a JSON line each, flushed as made."""

    def __init__(self, path: Path, store, conversations) -> None:
        self.path, self.store, self.conversations = path, store, conversations
        self.file = open(path / JOURNAL, "a", encoding="utf-8")
        self.chars = 0

    def add(self, change: list) -> None:
        line = json.dumps(change)
        self.file.write(line + "\n")
        self.file.flush()
        self.chars += len(line) + 1
        if self.chars > max(MIN_FOLD_CHARS, 2 * (self.store.chars + self.conversations.chars)):
            self.fold()

    def fold(self) -> None:
        """Write the stores whole, then empty the journal. Killed between the two, the next
        start replays changes the file holds already: each sets or deletes an entry whole,
        so twice is as once."""
        tmp = self.path / (FILE + ".tmp")
        tmp.write_text(json.dumps({"version": VERSION, "responses": self.store.snapshot(),
                                   "conversations": self.conversations.snapshot()}))
        os.replace(tmp, self.path / FILE)
        self.file.truncate(0)
        self.chars = 0

    def close(self) -> None:
        self.file.close()


def _replay(file: Path, store, conversations) -> None:
    """Apply the journal's changes (Journal.add's lines) in order."""
    if not file.exists():
        return
    applied = skipped = 0
    with open(file, encoding="utf-8") as lines:
        for number, line in enumerate(lines, 1):
            try:
                kind, tenant, *rest = json.loads(line)
                if kind == "response" and _entry([tenant, *rest]):
                    store.put(tenant, *rest)
                elif kind == "response_deleted":
                    store.delete(tenant, *rest)
                elif kind == "conversation" and _entry([tenant, *rest]):
                    conversations.restore([[tenant, *rest]])
                elif kind == "conversation_deleted":
                    conversations.forget(tenant, *rest)
                else:
                    raise ValueError(f"not a change: {line[:80]!r}")
                applied += 1
            except (ValueError, TypeError) as err:
                skipped += 1
                log.warning("%s line %d could not be read (%s): skipped", file, number, err)
    log.info("%d changes replayed from %s (%d skipped)", applied, file, skipped)


def _fail_unfinished(store) -> None:
    """Background responses a killed process left queued or running: failed, saying so."""
    for tenant, response, inputs in store.snapshot():
        if response.get("status") in ("queued", "in_progress"):
            response["status"] = "failed"
            response["error"] = {"code": "server_error", "message": "the server stopped while this response ran "
                                 "(killed, not shut down); send the request again"}
            store.put(tenant, response, inputs)


def _load(file: Path) -> tuple[list, list]:
    """(responses, conversations) entries as last written: each [tenant, object, items]."""
    if not file.exists():
        return [], []
    try:
        data = json.loads(file.read_text())
        if not isinstance(data, dict) or data.get("version") != VERSION:
            raise ValueError(f"not a version {VERSION} store")
        kept = data["responses"], data["conversations"]
        if not all(isinstance(entries, list) and all(_entry(e) for e in entries) for entries in kept):
            raise ValueError("an entry is not [tenant, object with an id, items]")
    except (OSError, ValueError, KeyError) as err:
        aside = file.with_name(file.name + ".unreadable")
        os.replace(file, aside)
        log.warning("%s could not be read (%s): starting with no stored responses or conversations; "
                    "the file is now %s", file, err, aside)
        return [], []
    log.info("%d stored responses and %d conversations read from %s", len(kept[0]), len(kept[1]), file)
    return kept


def _entry(entry) -> bool:
    return (isinstance(entry, list) and len(entry) == 3 and isinstance(entry[0], str)
            and isinstance(entry[1], dict) and isinstance(entry[1].get("id"), str) and isinstance(entry[2], list))
