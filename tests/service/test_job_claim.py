"""Claiming queued jobs beside RQ's dequeue: choice in queue order, what is left, what is read."""

from __future__ import annotations

import redis
from rq import Queue
from rq.job import Job
from rq.serializers import JSONSerializer

from mlxq.jobs import keys
from mlxq.worker.dead_letters import DeadLetters
from mlxq.worker.job_claim import JobClaimer, QueuedJob
from mlxq.worker.stream_writer import StreamOptions

REDIS_DB = 9


def _hgets(conn: redis.Redis) -> int:
    """Reads of hashes so far (the claim's look at queued jobs, RQ's fetch of claimed ones)."""
    stats = conn.info("commandstats")
    return sum(int(stats.get(f"cmdstat_{c}", {"calls": 0})["calls"]) for c in ("hmget", "hgetall"))


def test_chosen_jobs_move_in_queue_order_and_the_rest_stay(redis_conn: redis.Redis) -> None:
    queue = Queue("claims", connection=redis_conn, serializer=JSONSerializer)
    gen = [queue.enqueue_call(keys.GENERATE_FUNC, args=({"prompt": f"p{i}"},)) for i in range(3)]
    other = queue.enqueue_call("os.system", args=("echo",))  # not an mlxq job: left for RQ's dequeue
    score = queue.enqueue_call(keys.SCORE_FUNC, args=({"rows": []},))
    seen: list[QueuedJob] = []

    def pick(queued: QueuedJob) -> bool:
        seen.append(queued)
        return queued.func == keys.SCORE_FUNC or queued.payload["prompt"] != "p1"

    claimer = JobClaimer(redis_conn, JSONSerializer)
    claimed = claimer.claim(queue, pick, limit=3)
    assert [j.id for j in claimed] == [gen[0].id, gen[2].id, score.id]
    assert [q.id for q in seen] == [gen[0].id, gen[1].id, gen[2].id, score.id]  # never the other one
    assert queue.get_job_ids() == [gen[1].id, other.id]
    assert [i.decode() for i in redis_conn.lrange(queue.intermediate_queue_key, 0, -1)] == [
        j.id for j in claimed
    ]
    assert list(claimed[0].args) == [{"prompt": "p0"}]  # fetched whole, as RQ's dequeue would


def test_each_queued_job_is_read_once_however_often_the_queue_is_looked_at(redis_conn: redis.Redis) -> None:
    """A generation batch looks at the queue every few steps; a backlog's head is mostly the same."""
    queue = Queue("claims", connection=redis_conn, serializer=JSONSerializer)
    jobs = [queue.enqueue_call(keys.GENERATE_FUNC, args=({"prompt": f"p{i}"},)) for i in range(40)]
    claimer = JobClaimer(redis_conn, JSONSerializer, scan=16)
    before = _hgets(redis_conn)
    claimed = [claimer.claim(queue, lambda q: True, limit=2) for _ in range(5)]
    assert [j.id for batch in claimed for j in batch] == [j.id for j in jobs[:10]]
    # The first part read (16 ids at least), then the 2 new ids per look; and the 2 ids each later
    # look claims, read by an earlier look, read again as RQ's dequeue reads a job it takes.
    assert _hgets(redis_conn) - before == 16 + 4 * 2 + 4 * 2


def test_a_job_whose_hash_an_earlier_look_read_is_read_again(redis_conn: redis.Redis) -> None:
    """A queued job's hash may be written after a look read it (a producer's `save_meta`, the job run
    and queued again): one read by an earlier look is fetched again, with what was written meanwhile."""
    queue = Queue("claims", connection=redis_conn, serializer=JSONSerializer)
    jobs = [queue.enqueue_call(keys.GENERATE_FUNC, args=({"prompt": f"p{i}"},)) for i in range(4)]
    claimer = JobClaimer(redis_conn, JSONSerializer, scan=4)
    assert [j.id for j in claimer.claim(queue, lambda q: True, limit=1)] == [jobs[0].id]  # read all 4
    jobs[1].meta["note"] = "written after the look"
    jobs[1].save_meta()
    before = _hgets(redis_conn)
    claimed = claimer.claim(queue, lambda q: True, limit=1)
    assert _hgets(redis_conn) - before == 1
    assert claimed[0].id == jobs[1].id and claimed[0].meta == {"note": "written after the look"}


def test_jobs_claimed_in_the_look_that_first_read_them_are_read_once(redis_conn: redis.Redis) -> None:
    """A score batch claims jobs it has not seen: the look reads as far as it needs, each job's hash
    once, and the job is restored from it whole."""
    queue = Queue("claims", connection=redis_conn, serializer=JSONSerializer)
    jobs = [queue.enqueue_call(keys.SCORE_FUNC, args=({"rows": [{"prompt": f"p{i}"}]},)) for i in range(40)]
    claimer = JobClaimer(redis_conn, JSONSerializer, scan=64)
    before = _hgets(redis_conn)
    claimed = claimer.claim(queue, lambda q: True, limit=30)
    assert _hgets(redis_conn) - before == 30
    assert [j.id for j in claimed] == [j.id for j in jobs[:30]]
    for job in claimed:  # as RQ's own fetch reads it
        fetched = Job.fetch(job.id, connection=redis_conn, serializer=JSONSerializer)
        assert job.to_dict() == fetched.to_dict() and job.args == fetched.args and job.meta == fetched.meta


def test_a_job_of_another_queue_is_never_claimed_from_this_one(redis_conn: redis.Redis) -> None:
    """Its id pushed onto this queue (by a tenant allowed to push only here): left for RQ's dequeue to
    drop, even right after the same job was looked at in its own queue."""
    own = Queue("acme_q", connection=redis_conn, serializer=JSONSerializer)
    here = Queue("beta_q", connection=redis_conn, serializer=JSONSerializer)
    victim = own.enqueue_call(keys.SCORE_FUNC, args=({"rows": []},))
    mine = here.enqueue_call(keys.SCORE_FUNC, args=({"rows": []},))
    redis_conn.rpush(here.key, victim.id)
    claimer = JobClaimer(redis_conn, JSONSerializer)
    assert claimer.claim(own, lambda q: False, limit=4) == []  # looked at in its own queue first
    assert [j.id for j in claimer.claim(here, lambda q: True, limit=4)] == [mine.id]
    assert here.get_job_ids() == [victim.id] and own.get_job_ids() == [victim.id]


def test_a_claimed_job_rq_cannot_read_is_put_aside_and_the_others_are_claimed(
    redis_conn: redis.Redis,
) -> None:
    """Its `data` is a well-formed mlxq request, another field is not (a date in another format)."""
    queue = Queue("claims", connection=redis_conn, serializer=JSONSerializer)
    before = queue.enqueue_call(keys.SCORE_FUNC, args=({"rows": []},))
    bad = queue.enqueue_call(keys.SCORE_FUNC, args=({"rows": []},))
    redis_conn.hset(bad.key, "created_at", "2026-01-01T12:00:00+00:00")
    after = queue.enqueue_call(keys.SCORE_FUNC, args=({"rows": []},))
    claimer = JobClaimer(redis_conn, JSONSerializer, dead_letters=DeadLetters(redis_conn, StreamOptions()))
    claimed = claimer.claim(queue, lambda _queued: True, limit=8)
    assert [j.id for j in claimed] == [before.id, after.id]
    (_, entry), *_ = redis_conn.xrange(keys.dead_letter_key("claims"))
    assert entry[b"job_id"].decode() == bad.id and b"field 'created_at'" in entry[b"reason"]
    assert [i.decode() for i in redis_conn.lrange(queue.intermediate_queue_key, 0, -1)] == [
        before.id,
        after.id,
    ]
    assert redis_conn.xrange(keys.stream_key(bad.id))[-1][1][b"event"] == b"error"


def test_a_queued_id_whose_key_is_no_hash_is_left_for_rqs_dequeue(redis_conn: redis.Redis) -> None:
    """A claim between two steps of a running batch meets a key of another type (WRONGTYPE): the other
    jobs are claimed, the id stays queued for RQ's dequeue, which puts it aside (the worker goes on)."""
    queue = Queue("claims", connection=redis_conn, serializer=JSONSerializer)
    before = queue.enqueue_call(keys.SCORE_FUNC, args=({"rows": []},))
    redis_conn.set(keys.rq_job_key("a-string"), "x")
    redis_conn.rpush(queue.key, "a-string")
    after = queue.enqueue_call(keys.SCORE_FUNC, args=({"rows": []},))
    claimer = JobClaimer(redis_conn, JSONSerializer, dead_letters=DeadLetters(redis_conn, StreamOptions()))
    claimed = claimer.claim(queue, lambda _queued: True, limit=8)
    assert [j.id for j in claimed] == [before.id, after.id]
    assert [i.decode() for i in redis_conn.lrange(queue.key, 0, -1)] == ["a-string"]


def test_a_look_given_the_queues_head_as_read_in_another_round_trip_claims_from_it(
    redis_conn: redis.Redis,
) -> None:
    """A generation batch's first look at its queues rides in its first job's start (`QueueHeads`, a
    rider of `RqBatches.start`): the claim chooses from the ids read there, in queue order, and an empty
    head claims nothing without reading the queue again."""
    queue = Queue("claims", connection=redis_conn, serializer=JSONSerializer)
    jobs = [queue.enqueue_call(keys.GENERATE_FUNC, args=({"prompt": f"p{i}"},)) for i in range(3)]
    claimer = JobClaimer(redis_conn, JSONSerializer)
    heads = claimer.heads([queue])
    pipe = redis_conn.pipeline(transaction=False)
    heads.queue(pipe, [])
    heads.replied(pipe.execute())
    assert heads.ids == {queue.name: [j.id for j in jobs]}
    late = queue.enqueue_call(keys.GENERATE_FUNC, args=({"prompt": "late"},))  # pushed after the read
    claimed = claimer.claim(queue, lambda q: True, limit=8, head=heads.ids[queue.name])
    assert [j.id for j in claimed] == [j.id for j in jobs]
    assert queue.get_job_ids() == [late.id]  # the next look's
    assert claimer.claim(queue, lambda q: True, limit=8, head=[]) == []
    assert queue.get_job_ids() == [late.id]
