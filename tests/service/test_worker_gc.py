"""A working worker leaves what its start-up made out of the collector's passes (`gc.freeze`: the
model's modules, the tokenizer, imported code live as long as it does), and gives it back when it
stops, for a process that goes on without it."""

from __future__ import annotations

import gc
import signal
from pathlib import Path
from typing import Any

from mlxq.producer import Client
from mlxq.worker.engine import Engine, EngineOptions
from mlxq.worker.service import WorkerService
from mlxq.worker.settings import WorkerSettings


def test_start_up_objects_are_frozen_while_the_worker_works_and_given_back_after(
    model_dir: Path, redis_url: str, client: Client
) -> None:
    jobs = [
        client.submit_score([{"prompt": "The capital of France is", "candidates": [" the"]}])
        for _ in range(3)
    ]
    settings = WorkerSettings(  # type: ignore[call-arg]
        model=str(model_dir), redis_url=redis_url, queues=["default"], warm_up=False, _env_file=None
    )
    frozen: list[int] = []  # start-up's objects left out, at each pass of the collector

    def note(phase: str, _info: dict[str, Any]) -> None:
        if phase == "start":
            frozen.append(gc.get_freeze_count())

    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    before, thresholds = gc.get_freeze_count(), gc.get_threshold()
    gc.set_threshold(50)  # the collector surely passes while three jobs run, however the host's timing
    gc.callbacks.append(note)
    try:
        service = WorkerService.start(settings, engine=Engine.load(str(model_dir), EngineOptions()))
        assert service.work(burst=True) == 0
    finally:
        gc.callbacks.remove(note)
        gc.set_threshold(*thresholds)
        for sig, handler in saved.items():
            signal.signal(sig, handler)
    assert [len(job.result(timeout=5).rows) for job in jobs] == [1, 1, 1]
    assert max(frozen) > before  # the collector ran while the worker worked, start-up's objects left out
    assert gc.get_freeze_count() == before
