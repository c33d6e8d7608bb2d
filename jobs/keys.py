"""Every Redis key name mlxq uses, in one place. Part of the public wire contract."""

from __future__ import annotations

PREFIX = "mlxq"

GENERATE_FUNC = "jobs.generate"
SCORE_FUNC = "jobs.score"
JOB_FUNCS = frozenset({GENERATE_FUNC, SCORE_FUNC})


def stream_key(job_id: str) -> str:
    """Redis stream of token/done/error/restart events for a generation job."""
    return f"{PREFIX}:stream:{job_id}"


def result_key(job_id: str) -> str:
    """JSON result of a finished job (also stored as RQ's own job result)."""
    return f"{PREFIX}:result:{job_id}"


def cancel_key(job_id: str) -> str:
    """Set by a producer to ask the worker running `job_id` to stop it."""
    return f"{PREFIX}:cancel:{job_id}"


def worker_stats_key(worker_name: str) -> str:
    """Hash of a worker's live statistics (model, device, jobs done, cache)."""
    return f"{PREFIX}:worker:{worker_name}"


# The phases of a score batch, in order; the worker stats hash holds `score_<phase>_s` for each.
# `score` is the engine's whole time; `tree`, `forward`, `unembed` and `device_wait` are its parts
# (`worker/score_phases.py` says what each holds).
SCORE_PHASES = (
    "claim",
    "start",
    "tokenize",
    "tree",
    "forward",
    "unembed",
    "device_wait",
    "score",
    "write",
    "end",
)


def rq_queue_key(queue: str) -> str:
    """RQ's list of queued job ids for `queue` (RQ's own naming)."""
    return f"rq:queue:{queue}"


def rq_job_key(job_id: str) -> str:
    """RQ's hash for one job (RQ's own naming)."""
    return f"rq:job:{job_id}"


RQ_QUEUES_SET = "rq:queues"

REPLICATION_MARK = f"{PREFIX}:replicated"
"""Written just before WAIT (never read; `jobs.replication`): WAIT then counts the replicas that hold
all that was written before the mark, whichever connection wrote it."""


def dead_letter_key(queue: str) -> str:
    """Capped stream of the jobs taken from `queue` that could not be read (a malformed RQ hash, a key
    of another type), each with the job id and the reason: put aside, never run."""
    return f"{PREFIX}:dead:{queue}"
