"""What tokenizing a score batch costs on this host, one tokenizer call per text against batch calls
(`python3 -m bench.tokenize_probe`, ~20 s; prints a table, no MLX work).

The shape is the scoring figure's (64 rows: a 2,048-token prefix, 64 own tokens, 8 one-token
candidates) with the bench checkpoints' tokenizer. Each repetition makes new rows and tokenizes them
both ways in turns with one long-lived `Tokenizer` (as a worker's): `scoring.candidate_token_ids` as
it is (its short texts in batch calls, which the `tokenizers` library spreads over the host's cores)
and with batch calls turned off (`shared_encoding._BATCH_FROM` out of reach: one call per text, as
before `dba2bf2`). `RAYON_NUM_THREADS=1` in the environment keeps the library to one core.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

from bench.prompts import PromptMaker
from worker.engine.scoring import RowText, candidate_token_ids
from worker.engine.text import shared_encoding
from worker.engine.text.tokenizer import Tokenizer
from worker.modelfiles.tiny_model import write_random_checkpoint


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python3 -m bench.tokenize_probe")
    p.add_argument("--rows", type=int, default=64)
    p.add_argument("--prefix", type=int, default=2048)
    p.add_argument("--own", type=int, default=64)
    p.add_argument("--candidates", type=int, default=8)
    p.add_argument("--repeats", type=int, default=12)
    a = p.parse_args(argv)
    folder = write_random_checkpoint(Path(tempfile.mkdtemp()) / "tok")  # only its tokenizer is used
    tok = Tokenizer.from_dir(folder)
    maker = PromptMaker(tok)
    prefix = maker.pieces(a.prefix - maker.special)

    def rows() -> list[RowText]:
        prompts = [prefix + maker.pieces(a.own) for _ in range(a.rows)]
        return [RowText(q, maker.candidates(q, a.candidates), i) for i, q in enumerate(prompts)]

    batch_from = shared_encoding._BATCH_FROM
    times: dict[str, list[float]] = {"batch calls": [], "one call per text": []}
    for rep in range(a.repeats + 1):
        for name in list(times) if rep % 2 == 0 else list(times)[::-1]:
            shared_encoding._BATCH_FROM = batch_from if name == "batch calls" else 1 << 30
            batch = rows()
            t = time.perf_counter()
            candidate_token_ids(tok, batch)
            if rep:  # the first repetition warms up
                times[name].append((time.perf_counter() - t) * 1e3)
    shared_encoding._BATCH_FROM = batch_from
    threads = os.environ.get("RAYON_NUM_THREADS", "all")
    print(
        f"{a.rows} rows x ({a.prefix} + {a.own}) tokens x {a.candidates} candidates; "
        f"{os.cpu_count()} cores, RAYON_NUM_THREADS={threads}; {a.repeats} repetitions in turns"
    )
    print("| tokenizing | ms median (min-max) |\n| --- | --- |")
    for name, ms in times.items():
        print(f"| {name} | {statistics.median(ms):.2f} ({min(ms):.2f}-{max(ms):.2f}) |")


if __name__ == "__main__":
    main()
