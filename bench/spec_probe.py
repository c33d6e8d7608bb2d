import sys, time
from mlxq.worker.engine import Engine, EngineOptions
from mlxq.worker.engine.generation_batch import GenerationBatch
from mlxq.jobs.schema import GenerateRequest
from mlxq.worker.engine.speculation.policy import DraftPolicy
from bench.fig_speculation import COPY_HEAVY
mode, n = sys.argv[1], int(sys.argv[2])
opts = dict(speculation=mode, draft_policy=DraftPolicy(max_batch=64)) if mode != "plain" else {}
if mode == "draft_model":
    opts["draft_model"] = "/tmp/smol"
e = Engine.load("/tmp/smol", EngineOptions(**opts))
tok = e.tokenizer
for rep in range(int(sys.argv[3])):
    b = GenerationBatch(e, max_sequences=n)
    for i in range(n):
        b.admit(str(i), GenerateRequest(messages=[{"role": "user", "content": COPY_HEAVY[i % 3]}], max_tokens=128, temperature=0), lambda t, ids: None, lambda: False)
    t = time.perf_counter(); out = []
    while len(b):
        out += b.step()
    b.settle(); b.close()
    dt = time.perf_counter() - t
    toks = sum(f.result.usage.completion_tokens for f in out)
    u = out[0].result.usage
    print(mode, n, rep, f"{toks/dt:.0f} tok/s", u.draft_tokens, u.accepted_tokens, flush=True)
