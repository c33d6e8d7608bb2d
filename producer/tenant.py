"""A producer's own key space in a shared Redis: what makes tenants separable by Redis ACLs.

RQ names every key after a job id or a queue name (`rq:job:<id>`, `rq:queue:<queue>`,
`mlxq:result:<id>`, ...), so a producer's keys can be told apart by a prefix of those names alone.
A producer given a tenant name (`MLXQ_TENANT=acme`) makes every job id `acme_<uuid>` and every queue
name `acme_<queue>`; an ACL user for that tenant (`acl_rules`) may then write only its own job hashes
and queues, set only its own cancel keys, and read only its own results and streams. Results and
streams are written by workers alone. What the ACL cannot stop (a tenant pushing another tenant's job
id onto its own queue) the worker refuses: it runs a job only from the queue the job names as its
origin (`worker/rq_worker.py`).

Tenant names are lowercase letters and digits only, so that the `_` after one ends it: the pattern
`rq:job:acme_*` matches no key of tenant `acme2` (`rq:job:acme2_...`), and no tenant name holds a `_`.
"""

from __future__ import annotations

import re
import uuid
from dataclasses import dataclass

from mlxq.jobs import keys

TENANT_NAME = re.compile(r"[a-z0-9]{1,32}")
SEPARATOR = "_"


def check_name(name: str) -> str:
    """`name` if it can name a tenant (1-32 lowercase letters and digits), else ValueError saying why."""
    if not TENANT_NAME.fullmatch(name):
        raise ValueError(
            f"tenant {name!r} must be 1-32 lowercase letters and digits (no '_', '-', ':' or '*'): "
            "its keys are told apart by the name and the '_' after it"
        )
    return name


@dataclass(frozen=True)
class Tenant:
    """The names a producer writes under: none (the shared key space) or one tenant's prefix."""

    name: str | None = None

    def __post_init__(self) -> None:
        if self.name is not None:
            check_name(self.name)

    @property
    def prefix(self) -> str:
        return "" if self.name is None else self.name + SEPARATOR

    def queue(self, name: str) -> str:
        """The queue `name` inside this tenant: `acme_<name>`, or `name` itself if it is already there."""
        if not self.prefix or name.startswith(self.prefix):
            return name
        return self.prefix + name

    def job_id(self, given: str | None = None) -> str:
        """A fresh job id in this tenant's space (uuid4 hex: made by the client, so a retried submission
        can see it already landed), or `given` if it is in it (ValueError if not)."""
        if given is None:
            return self.prefix + uuid.uuid4().hex
        if not given.startswith(self.prefix):
            raise ValueError(
                f"job id {given!r} is outside tenant {self.name!r}: it must start {self.prefix!r}"
            )
        return given


SHARED = Tenant()
"""No tenant: job ids and queue names as given (or a bare uuid4 hex), in the key space all share."""


def acl_rules(tenant: str) -> str:
    """The Redis ACL rules (Redis 7 and later: they use a selector) of tenant `tenant`'s producer user.

    Commands are those the producers (`Client`, `AsyncClient`, bulk runs, `mlxq` submit/tail/cancel) send;
    keys are the tenant's own: it writes its job hashes and queues (enqueue, and RQ's cancel of a
    waiting job, which takes it off the queue into the queue's canceled registry), sets its cancel keys,
    reads its results, RQ's results and its streams, and deletes a result and stream it has read (bulk
    runs do, to keep Redis small). It cannot write a result or stream entry, touch another tenant's
    keys, read a worker's keys, or delete anything else. `SADD rq:queues` (RQ's list of queue names)
    and the mark written before a `WAIT` for replicas (through Sentinel) are the shared writes; `INFO`
    tells it Redis's memory policy, and RQ's sets of the workers serving its queues whether anyone does.
    """
    p = check_name(tenant) + SEPARATOR
    commands = (
        "+info +wait +multi +exec +discard +watch +unwatch +exists +get +set +hget +hmget +hgetall +hset "
        "+scard +rpush +lpush +lrem +zadd +xread +xrevrange +xlen"
    )
    own = (
        f"%RW~{keys.rq_job_key(p)}* %RW~{keys.rq_queue_key(p)}* %W~rq:canceled:{p}* "
        f"%W~{keys.cancel_key(p)}* %R~rq:results:{p}* %R~{keys.result_key(p)}* %R~{keys.stream_key(p)}* "
        f"%R~rq:workers:{p}* %W~{keys.REPLICATION_MARK}"
    )
    return (
        f"resetchannels -@all +@connection -@dangerous {commands} resetkeys {own} "
        f"(+sadd ~{keys.RQ_QUEUES_SET}) (+del ~{keys.result_key(p)}* ~{keys.stream_key(p)}*)"
    )
