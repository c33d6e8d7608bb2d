"""`mlxq serve`'s process settings (`producer.gateway.cli`): the collector is set for a long-running
server, in a process of its own (a test process's collector is left as it is)."""

from __future__ import annotations

import json
import subprocess
import sys

from mlxq.producer.gateway.cli import GC_YOUNG_OBJECTS


def test_serve_freezes_what_exists_and_lets_the_young_generation_grow() -> None:
    probe = (
        "import gc, json\n"
        "from mlxq.producer.gateway.cli import _settle_gc\n"
        "from mlxq.producer.gateway.app import create_app\n"
        "app = create_app()\n"
        "before = gc.get_threshold()\n"
        "_settle_gc()\n"
        "after, frozen = gc.get_threshold(), gc.get_freeze_count()\n"
        "print(json.dumps({'before': before, 'after': after, 'frozen': frozen}))\n"
    )
    found = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=True
    )
    seen = json.loads(found.stdout.splitlines()[-1])
    assert seen["after"] == [GC_YOUNG_OBJECTS, *seen["before"][1:]]
    assert seen["frozen"] > 10_000  # the modules, schemas and app built so far are out of every collection
