"""Redis servers of a test's own: a private `redis-server` that can be restarted, and a TCP proxy in
front of one that can cut the network for a while (imported by test modules, like worker_process.py)."""

from __future__ import annotations

import contextlib
import os
import random
import socket
import subprocess
import threading
import time
from pathlib import Path

import redis


def free_port() -> int:
    """A loopback port nobody listens on: from `MLXQ_TEST_PORTS` (`first-last`) where it is set (a
    machine shared by several test runs gives each its own range), else one below the kernel's range
    for outgoing connections. A port from that range (what binding to port 0 gives) can be taken by
    any client's outgoing connection while its server is down, and a restarted server then fails to
    bind it: seen as a Redis that "did not start" after a restart, once in a full run."""
    span = os.environ.get("MLXQ_TEST_PORTS")
    if span:
        first, last = (int(p) for p in span.split("-"))
    else:
        first, last = 20000, _ephemeral_first() - 1
    ports = list(range(first, last + 1))
    random.shuffle(ports)  # two test runs on one machine rarely try the same ports in the same order
    for port in ports:
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as redis-server binds
            try:
                s.bind(("127.0.0.1", port))
                s.listen()
            except OSError:
                continue
        return port
    raise RuntimeError(f"no free port in {first}-{last}")


def _ephemeral_first() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):  # not Linux: IANA's dynamic range starts here
        return 49152


class PrivateRedis:
    """`redis-server` on a free loopback port, append-only file fsynced always, so a restart keeps all.
    `extra` options are appended (`--maxmemory 4mb`, `--replicaof 127.0.0.1 6379`, ...)."""

    def __init__(self, folder: Path, *extra: str) -> None:
        self.folder = folder
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.cmd = [
            "redis-server",
            "--port",
            str(self.port),
            "--bind",
            "127.0.0.1",
            "--dir",
            str(folder),
            "--appendonly",
            "yes",
            "--appendfsync",
            "always",
            "--save",
            "",
            *extra,
        ]
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout_s: float = 30.0) -> None:
        """Start the server and wait until it answers (it may first load its append-only file). A
        server that exits instead (its port taken, a bad option) is reported with what it said."""
        log = self.folder / f"redis-{self.port}.log"
        with log.open("ab") as out:  # the child keeps its own copy of the descriptor
            self.proc = subprocess.Popen(self.cmd, stdout=out, stderr=subprocess.STDOUT)
        conn = redis.Redis.from_url(self.url, socket_timeout=5)
        try:
            deadline = time.monotonic() + timeout_s
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    tail = log.read_text(errors="replace")[-2000:]
                    code = self.proc.returncode
                    raise RuntimeError(f"redis-server on port {self.port} exited ({code}):\n{tail}")
                with contextlib.suppress(redis.ConnectionError, redis.TimeoutError):
                    conn.ping()
                    return
                time.sleep(0.05)
            raise RuntimeError(f"redis-server on port {self.port} did not answer within {timeout_s} s")
        finally:
            conn.close()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()  # SIGTERM: Redis flushes the append-only file and exits
            self.proc.wait(10)

    def restart(self, down_s: float = 1.0) -> None:
        self.stop()
        time.sleep(down_s)
        self.start()


class CuttableProxy:
    """A loopback TCP proxy to a Redis port. `cut(seconds)` drops every connection and refuses new ones
    for that long: Redis itself keeps running, but nobody can reach it."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self._open = threading.Event()
        self._open.set()
        self._conns: list[socket.socket] = []
        self._lock = threading.Lock()
        self._server = socket.create_server(("127.0.0.1", self.port))
        self._server.settimeout(0.1)
        self._stop = threading.Event()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                client, _ = self._server.accept()
            except TimeoutError:
                continue
            except OSError:  # closed
                return
            if not self._open.is_set():
                client.close()
                continue
            try:
                upstream = socket.create_connection(("127.0.0.1", self.target_port))
            except OSError:
                client.close()
                continue
            with self._lock:
                self._conns += [client, upstream]
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    @staticmethod
    def _pipe(src: socket.socket, dst: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while data := src.recv(65536):
                dst.sendall(data)
        for s in (src, dst):
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            s.close()

    def cut(self, seconds: float) -> None:
        self._drop()
        time.sleep(seconds)
        self._open.set()

    def cut_for(self, seconds: float) -> None:
        """`cut` that returns at once, every connection already dropped; it reopens `seconds` later."""
        self._drop()
        threading.Timer(seconds, self._open.set).start()

    def _drop(self) -> None:
        self._open.clear()
        with self._lock:
            conns, self._conns = self._conns, []
        for s in conns:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
                s.close()

    def close(self) -> None:
        self._stop.set()
        self._server.close()
        with self._lock:
            conns, self._conns = self._conns, []
        for s in conns:
            s.close()


def fill_memory(conn: redis.Redis) -> int:
    """Fill a `noeviction` Redis with `filler:*` keys until it refuses one (OOM); returns how many went
    in. Redis's own use moves by a few KB (client buffers), so the limit is then set 512 KB under what
    it uses: full for sure until `free_memory`."""
    n = 0
    while True:
        try:
            conn.set(f"filler:{n}", b"x" * 65536)
        except redis.exceptions.OutOfMemoryError:
            break
        n += 1
    conn.config_set("maxmemory", int(conn.info("memory")["used_memory"]) - (512 << 10))
    return n


def free_memory(conn: redis.Redis) -> None:
    """Delete what `fill_memory` wrote: megabytes under the limit again."""
    fillers = conn.keys("filler:*")
    if fillers:
        conn.delete(*fillers)


class SentinelSet:
    """A primary, two replicas and three sentinels (quorum 2) on loopback ports, each server in a folder
    of its own, watching the service `name`: the set Sentinel's documentation recommends, and a
    failover as production sees one, in a few seconds."""

    def __init__(self, folder: Path, name: str = "mlxq", down_after_ms: int = 1000) -> None:
        self.name = name
        self.folder = folder
        (folder / "primary").mkdir(parents=True)
        self.primary = PrivateRedis(folder / "primary", "--enable-debug-command", "local")
        self.primary.start()
        self.replicas = []
        for i in range(2):
            (folder / f"replica-{i}").mkdir()
            replica = PrivateRedis(
                folder / f"replica-{i}", "--replicaof", "127.0.0.1", str(self.primary.port)
            )
            replica.start()
            self.replicas.append(replica)
        self.sentinels: list[subprocess.Popen[bytes]] = []
        self.sentinel_ports: list[int] = []
        for i in range(3):
            port = free_port()
            conf = folder / f"sentinel-{i}.conf"
            conf.write_text(
                f"port {port}\nbind 127.0.0.1\ndir {folder}\n"
                f"sentinel monitor {name} 127.0.0.1 {self.primary.port} 2\n"
                f"sentinel down-after-milliseconds {name} {down_after_ms}\n"
                f"sentinel failover-timeout {name} 10000\n"
                f"sentinel parallel-syncs {name} 1\n"
            )
            self.sentinels.append(
                subprocess.Popen(["redis-server", str(conf), "--sentinel"], stdout=subprocess.DEVNULL)
            )
            self.sentinel_ports.append(port)
            _wait_ping(port)
        self.url = f"redis+sentinel://{','.join(f'127.0.0.1:{p}' for p in self.sentinel_ports)}/{name}/0"
        self._wait_settled()

    def sentinel(self, i: int = 0) -> redis.Redis:
        return redis.Redis(port=self.sentinel_ports[i], decode_responses=True)

    def primary_port(self) -> int:
        """The port the sentinels name as the primary now."""
        _host, port = self.sentinel().sentinel_get_master_addr_by_name(self.name)
        return int(port)

    def _wait_settled(self, timeout: float = 30.0) -> None:
        """Until every sentinel knows the replica and the other sentinels, and the replica is in sync."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            ready = True
            for i in range(3):
                master = self.sentinel(i).sentinel_master(self.name)
                if int(master.get("num-slaves", 0)) < 2 or int(master.get("num-other-sentinels", 0)) < 2:
                    ready = False
            links = [
                redis.Redis(port=r.port).info("replication").get("master_link_status") for r in self.replicas
            ]
            if ready and links == ["up", "up"]:
                return
            time.sleep(0.2)
        raise RuntimeError("sentinels did not settle")

    def stop(self) -> None:
        for proc in self.sentinels:
            if proc.poll() is None:
                proc.terminate()
                proc.wait(10)
        for replica in self.replicas:
            replica.stop()
        self.primary.stop()


def _wait_ping(port: int) -> None:
    conn = redis.Redis(port=port)
    for _ in range(200):
        with contextlib.suppress(redis.ConnectionError):
            conn.ping()
            return
        time.sleep(0.05)
    raise RuntimeError(f"nothing answers on port {port}")
