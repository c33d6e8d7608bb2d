"""The stream writer against real Redis: batching, exactly-once ids, restart and error events."""

from __future__ import annotations

import json
import time

import pytest
import redis

from mlxq.jobs import keys
from mlxq.jobs.schema import DoneEvent, GenerateResult, Timings, TokenEvent, Usage, parse_event
from mlxq.worker.stream_writer import StreamOptions, StreamWriter, finish_streams, opened

REDIS_DB = 10


@pytest.fixture
def conn(redis_conn: redis.Redis) -> redis.Redis:
    return redis_conn


def _events(conn: redis.Redis, job_id: str) -> list:
    return [
        parse_event({k.decode(): v.decode() for k, v in f.items()})
        for _, f in conn.xrange(keys.stream_key(job_id))
    ]


def _result(text: str) -> GenerateResult:
    return GenerateResult(
        text=text,
        finish_reason="stop",
        token_ids=[1, 2, 3],
        usage=Usage(prompt_tokens=4, completion_tokens=3),
        timings=Timings(),
    )


def test_tokens_are_batched_and_flushed_in_order(conn: redis.Redis) -> None:
    w = StreamWriter(conn, "j1", StreamOptions(flush_tokens=3, flush_ms=1e9))
    w.open(attempt=1)
    for i, t in enumerate(["a", "b", "c", "d", "e"]):
        w(t, [i])
    # The first token at once, then one flush per 3 tokens: "a" | "bcd" | "e" still buffered.
    assert len(conn.xrange(keys.stream_key("j1"))) == 2
    w.finish(
        _result("abcde"),
        DoneEvent(finish_reason="stop", prompt_tokens=4, completion_tokens=5, cached_tokens=0),
    )
    events = _events(conn, "j1")
    tokens = [e for e in events if isinstance(e, TokenEvent)]
    assert "".join(e.text for e in tokens) == "abcde"
    assert [e.index for e in tokens] == [0, 1, 4]
    assert [i for e in tokens for i in e.ids] == [0, 1, 2, 3, 4]
    assert events[-1].event == "done"
    assert json.loads(conn.get(keys.result_key("j1")))["text"] == "abcde"
    assert 0 < conn.ttl(keys.stream_key("j1")) <= 3600
    assert conn.ttl(keys.result_key("j1")) > 3600


def test_a_retried_write_is_not_appended_twice(conn: redis.Redis) -> None:
    w = StreamWriter(conn, "j2", StreamOptions(flush_tokens=1e9, flush_ms=1e9), deferred=True)
    w.open(attempt=1)
    w("x", [1])
    entry = w._take()
    assert entry is not None
    entry_id, fields = entry
    w._pipeline([fields], [entry_id])
    # Replay the same entry (same id) as a retry after a lost reply would: Redis refuses it, the writer
    # takes the refusal as "already written".
    w._pipeline([fields], [entry_id])
    assert [e.text for e in _events(conn, "j2")] == ["x"]


def test_entry_ids_say_when_each_entry_was_written_and_keep_increasing(conn: redis.Redis) -> None:
    w = StreamWriter(conn, "j2t", StreamOptions(flush_tokens=1))
    w.open(attempt=1)
    stamps = []
    for i in range(3):
        before = int(time.time() * 1000)
        w(f"t{i}", [i])
        stamps.append((before, int(time.time() * 1000)))
        time.sleep(0.02)
    ids = [entry_id.decode() for entry_id, _ in conn.xrange(keys.stream_key("j2t"))]
    ms = [int(i.split("-")[0]) for i in ids]
    for (before, after), written in zip(stamps, ms, strict=True):
        assert before <= written <= after  # each entry carries its own time, not the stream's opening
    assert ms[0] < ms[1] < ms[2]
    # A clock that steps back (or many entries in one millisecond) still gives increasing ids.
    w._ms += 10_000
    w("late", [9])
    w("later", [10])
    last_two = [entry_id.decode() for entry_id, _ in conn.xrange(keys.stream_key("j2t"))][-2:]
    assert last_two == [f"{w._ms}-{w._seq - 1}", f"{w._ms}-{w._seq}"]


def test_retried_job_announces_restart_and_ids_keep_increasing(conn: redis.Redis) -> None:
    first = StreamWriter(conn, "j3", StreamOptions(flush_tokens=1))
    first.open(attempt=1)
    first("old", [1])
    second = StreamWriter(conn, "j3", StreamOptions(flush_tokens=1))
    second.open(attempt=2)
    second("new", [2])
    events = _events(conn, "j3")
    assert [e.event for e in events] == ["token", "restart", "token"]
    assert events[1].attempt == 2


def test_error_once_ends_an_open_stream_but_not_a_finished_one(conn: redis.Redis) -> None:
    w = StreamWriter(conn, "j4", StreamOptions(flush_tokens=1))
    w.open(attempt=1)
    w("partial", [1])
    StreamWriter(conn, "j4", StreamOptions()).error_once("boom")
    StreamWriter(conn, "j4", StreamOptions()).error_once("again")
    assert [e.event for e in _events(conn, "j4")] == ["token", "error"]


def test_stream_is_capped(conn: redis.Redis) -> None:
    w = StreamWriter(conn, "j5", StreamOptions(flush_tokens=1, maxlen=10))
    w.open(attempt=1)
    for i in range(500):
        w("t", [i])
    assert conn.xlen(keys.stream_key("j5")) < 200  # MAXLEN ~ trims whole nodes, approximately


def test_deferred_writers_are_flushed_together(conn: redis.Redis) -> None:
    from mlxq.worker.stream_writer import flush_streams

    opts = StreamOptions(flush_tokens=2, flush_ms=1e9)
    writers = [StreamWriter(conn, f"d{i}", opts, deferred=True) for i in range(3)]
    for w in writers:
        w.open(attempt=1)
        w("a", [1])
    assert all(conn.xlen(keys.stream_key(f"d{i}")) == 0 for i in range(3))  # deferred: nothing yet
    flush_streams(conn, writers, opts)  # first tokens are due at once
    writers[0]("b", [2])
    flush_streams(conn, writers, opts)  # 1 token < flush_tokens: not due
    assert [conn.xlen(keys.stream_key(f"d{i}")) for i in range(3)] == [1, 1, 1]
    writers[0]("c", [3])
    flush_streams(conn, writers, opts)
    writers[0].finish(
        _result("abc"), DoneEvent(finish_reason="stop", prompt_tokens=1, completion_tokens=3, cached_tokens=0)
    )
    events = _events(conn, "d0")
    assert [e.event for e in events] == ["token", "token", "done"]
    assert "".join(e.text for e in events if isinstance(e, TokenEvent)) == "abc"


def test_a_stream_has_its_ttl_from_the_first_token_on_without_an_expire_per_flush(
    conn: redis.Redis,
) -> None:
    def calls(command: str) -> int:  # a difference, so other clients of this server do not matter much
        return int(conn.info("commandstats").get(f"cmdstat_{command}", {}).get("calls", 0))

    before = {c: calls(c) for c in ("xadd", "expire")}
    w = StreamWriter(conn, "j9", StreamOptions(flush_tokens=1, ttl_s=600))
    w.open(attempt=1)
    w("a", [1])
    assert 0 < conn.ttl(keys.stream_key("j9")) <= 600  # readers' keys never outlive their TTL
    conn.expire(keys.stream_key("j9"), 5)  # as if a while passed since then
    for i in range(20):
        w("b", [2 + i])
    assert 0 < conn.ttl(keys.stream_key("j9")) <= 5  # no refresh before a quarter of the TTL
    assert calls("xadd") - before["xadd"] == 21
    assert calls("expire") - before["expire"] == 2  # the first flush's, and the test's own
    w._expired_at = -1e9  # long ago: the next flush refreshes it
    w("c", [30])
    assert conn.ttl(keys.stream_key("j9")) > 5


def test_many_streams_open_and_finish_together(conn: redis.Redis) -> None:
    old = StreamWriter(conn, "m2", StreamOptions(flush_tokens=1))
    old.open(attempt=1)
    old("before a crash", [5])
    writers = [StreamWriter(conn, job, StreamOptions()) for job in ("m1", "m2")]
    # The seeks ride in a round trip of the caller's (a worker starts the jobs in it).
    pipe = conn.pipeline(transaction=False)
    pipe.set("also-1", "a")
    for w in writers:
        w.seek(pipe)
    opened([(writers[0], 1), (writers[1], 2)], pipe.execute()[1:])
    writers[1]("again", [6])  # buffered: finish writes it before `done`
    finish_streams(
        conn,
        [
            (
                w,
                _result(text),
                DoneEvent(finish_reason="stop", prompt_tokens=4, completion_tokens=3, cached_tokens=0),
            )
            for w, text in zip(writers, ("first", "again"), strict=True)
        ],
        StreamOptions(),
    )
    assert [e.event for e in _events(conn, "m1")] == ["done"]
    assert [e.event for e in _events(conn, "m2")] == ["token", "restart", "token", "done"]
    assert _events(conn, "m2")[1].attempt == 2
    for job, text in (("m1", "first"), ("m2", "again")):
        assert json.loads(conn.get(keys.result_key(job)))["text"] == text
        assert 0 < conn.ttl(keys.stream_key(job)) <= 3600
