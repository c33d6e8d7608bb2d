"""A job's stream as Server-Sent Events, for web backends that relay it to browsers.

SSE is line-based: an event's data ends at the first line break, so text sent as `data: <text>` loses
every newline a model writes (a delta "\\n" arrives as an empty event). `frame` writes each line of the
data as its own `data:` line, which every SSE client joins back with "\\n"; `item_frame` sends a job's
stream entry as one event named after it (`token`, `restart`, `done`, `error`) whose data is the event's
JSON (lossless: carriage returns, which SSE also reads as line breaks, survive in JSON) and whose id is
the stream entry's id. A browser that reconnects sends that id back as `Last-Event-ID`; passing it to
`stream(from_id=...)` resumes the job's stream right after it.
"""

from __future__ import annotations

import json
import re

from .tail import StreamItem

_LINE_BREAK = re.compile(r"\r\n|\r|\n")


def frame(data: str, *, event: str | None = None, event_id: str | None = None) -> str:
    """One SSE event carrying `data` (any text; a CR or CRLF in it reaches the client as LF)."""
    head = ""
    if event is not None:
        head += f"event: {_one_line(event)}\n"
    if event_id is not None:
        head += f"id: {_one_line(event_id)}\n"
    return head + "".join(f"data: {line}\n" for line in _LINE_BREAK.split(data)) + "\n"


def item_frame(item: StreamItem) -> str:
    """A job's stream entry as an SSE event: `event:` its kind, `data:` its JSON, `id:` its stream id."""
    body = item.event.model_dump(mode="json")
    return frame(json.dumps(body, ensure_ascii=False), event=item.event.event, event_id=item.stream_id)


def _one_line(value: str) -> str:
    if _LINE_BREAK.search(value):
        raise ValueError(f"an SSE event name or id cannot hold a line break: {value!r}")
    return value
