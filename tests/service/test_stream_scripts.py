"""Score jobs' streams ended by one script call (`stream_scripts.py`) against real Redis, compared with
what `StreamWriter.open` and `finish_streams` write for the same jobs: the same entries, result keys,
TTLs and attempt counts; a `restart` where an earlier attempt wrote; nothing twice when sent again."""

from __future__ import annotations

import json
from typing import Any

import redis
from rq import Queue
from rq.job import Job
from rq.serializers import JSONSerializer

from mlxq.jobs import keys
from mlxq.jobs.schema import DoneEvent, ErrorEvent, ScoreResult
from mlxq.worker.job_results import ATTEMPT_META, JobResults
from mlxq.worker.stream_scripts import finish_score_streams
from mlxq.worker.stream_writer import StreamOptions, StreamWriter, finish_streams

ROW = {"rows": [{"prompt": "a", "candidates": ["b", "c"]}]}
RESULT = ScoreResult.model_validate(
    {
        "rows": [{"logits": [1.5, 2.5], "logprobs": [-0.3, -1.2], "input_tokens": 3, "cached_tokens": 1}],
        "input_tokens": 3,
        "cached_tokens": 1,
    }
)
DONE = DoneEvent(finish_reason="stop", prompt_tokens=3, completion_tokens=0, cached_tokens=1)


def _jobs(conn: redis.Redis, n: int) -> list[Job]:
    q = Queue("streams", connection=conn, serializer=JSONSerializer)
    return [q.enqueue_call(keys.SCORE_FUNC, args=(ROW,)) for _ in range(n)]


def _written(conn: redis.Redis, job: Job) -> dict[str, Any]:
    """What a job's end leaves, without entry ids: its entries' fields, result, TTLs, attempt."""
    stream = keys.stream_key(job.id)
    meta = JSONSerializer.loads(conn.hget(job.key, "meta") or b"{}")
    return {
        "entries": [{k.decode(): v.decode() for k, v in f.items()} for _, f in conn.xrange(stream)],
        "result": json.loads(conn.get(keys.result_key(job.id)) or b"null"),
        "result ttl": 0 < conn.ttl(keys.result_key(job.id)) <= StreamOptions().result_ttl_s,
        "stream ttl": 0 < conn.ttl(stream) <= StreamOptions().ttl_s,
        "attempt": meta.get(ATTEMPT_META),
    }


def _by_writer(conn: redis.Redis, job: Job, attempt: int) -> None:
    """The same end through `StreamWriter` (what score jobs used before the script)."""
    job.meta[ATTEMPT_META] = attempt
    conn.hset(job.key, "meta", job.serializer.dumps(job.meta))
    writer = StreamWriter(conn, job.id, StreamOptions())
    writer.open(attempt)
    finish_streams(conn, [(writer, RESULT, DONE)], StreamOptions())


def test_a_batch_ends_its_streams_as_the_stream_writer_does_in_one_command(redis_conn: redis.Redis) -> None:
    reference, fresh, retried = _jobs(redis_conn, 3)
    _by_writer(redis_conn, reference, 1)
    StreamWriter(redis_conn, retried.id, StreamOptions()).error_once("the worker died")  # an earlier try
    retried.meta[ATTEMPT_META] = 1
    before = int(redis_conn.info("commandstats").get("cmdstat_evalsha", {"calls": 0})["calls"])
    JobResults(redis_conn, StreamOptions()).finish_scores([(fresh, RESULT), (retried, RESULT)])
    assert int(redis_conn.info("commandstats")["cmdstat_evalsha"]["calls"]) - before in (1, 2)  # 2: loaded
    assert _written(redis_conn, fresh) == _written(redis_conn, reference)
    assert _written(redis_conn, reference)["entries"] == [DONE.fields()]
    retried_now = _written(redis_conn, retried)
    assert retried_now["entries"] == [
        ErrorEvent(message="the worker died").fields(),
        {"event": "restart", "attempt": "2"},
        DONE.fields(),
    ]
    assert retried_now["attempt"] == 2 and retried_now["result"] == RESULT.model_dump(mode="json")
    ids = [i.decode() for i, _ in redis_conn.xrange(keys.stream_key(retried.id))]
    assert [tuple(map(int, i.split("-"))) for i in ids] == sorted(tuple(map(int, i.split("-"))) for i in ids)
    assert len(set(ids)) == 3


def test_a_call_sent_again_writes_nothing_twice(redis_conn: redis.Redis) -> None:
    (job,) = _jobs(redis_conn, 1)
    finals = [(job, 1, RESULT.model_dump(mode="json"), DONE.fields())]
    job.meta[ATTEMPT_META] = 1
    finish_score_streams(redis_conn, finals, StreamOptions())
    once = _written(redis_conn, job)
    finish_score_streams(redis_conn, finals, StreamOptions())  # its reply lost: sent again
    assert _written(redis_conn, job) == once and once["entries"] == [DONE.fields()]


def test_a_jobs_meta_is_written_as_rq_saves_it(redis_conn: redis.Redis) -> None:
    """The meta a batch's end writes is the text RQ's `save_meta` writes, byte for byte: an attempt
    count alone (made from a memory of that text) or beside a producer's own keys; and values
    returned by the call are the results' JSON texts as stored."""
    jobs = _jobs(redis_conn, 3)
    jobs[1].meta["producer"] = {"tag": "x", "n": 1}
    jobs[2].meta["mlxq_attempt"] = True  # not a count: dumped as it is
    finals = [(job, 1, RESULT.model_dump(mode="json"), DONE.fields()) for job in jobs]
    for job in jobs[:2]:
        job.meta[ATTEMPT_META] = 1
    texts = finish_score_streams(redis_conn, finals, StreamOptions())
    for job, text in zip(jobs, texts, strict=True):
        assert redis_conn.hget(job.key, "meta") == job.serializer.dumps(job.meta)
        assert redis_conn.get(keys.result_key(job.id)) == text.encode()
