"""`--responses-store-dir DIR`: a server's stored responses and conversations outlive its
process. They are read from DIR when the HTTP port opens and written there when it closes
(SIGTERM, Ctrl-C: a rolling restart, an upgrade), background responses still running
ending first, as "cancelled". A process killed outright loses what it stored since it
started.

- One JSON file, replaced whole (written beside it, then renamed): a stop midway leaves
  the last one. A file that cannot be read is moved aside (`.unreadable`), logged, and the
  server starts with none; a restart into a smaller `--responses-store-mb` keeps the most
  recently used.
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

FILE, VERSION = "stored.json", 1


def keep(app: web.Application, directory: str | None, stored, conversations) -> None:
    """Restore `stored` (responses_http.StoredResponses) and `conversations` from
    `directory` now, and write them there when `app` is cleaned up; nothing without one."""
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

    async def write(_: web.Application) -> None:
        await stored.close()
        tmp = path / (FILE + ".tmp")
        tmp.write_text(json.dumps({"version": VERSION, "responses": stored.store.snapshot(),
                                   "conversations": conversations.snapshot()}))
        os.replace(tmp, path / FILE)
        lock.close()
        log.info("stored responses and conversations written to %s", path / FILE)

    app.on_cleanup.append(write)


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
