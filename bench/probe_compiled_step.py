"""Probe (temporary): the host time to build a 64-row flat decode step's graph (the probe_build model:
16 layers, bf16, RoPE and norms as one op each, the kernel a one-op stand-in) as the engine builds it,
against one `mx.compile`d function replaying the same ops (the cache writes by `slice_update` at an
array column, so the trace does not change with the step). Not the engine's code: what a compiled
decode step could save of the loop thread's build.

    PYTHONPATH=. python bench/probe_compiled_step.py
"""

import statistics
import time

import mlx.core as mx

from bench import probe_build as pb
from mlxq.worker.engine.models import attention

attention.decode_attention = pb._stand_in
mx.fast.rope = pb._one_op
mx.fast.rms_norm = pb._one_op
model = pb.build_model(mx.bfloat16)
batch = pb.build_batch(model, 64, True, mx.bfloat16, 0)
for _ in range(3):
    mx.eval(batch._next_step(batch._pending), *(a for c in batch.cache for a in (c.keys, c.values)))

args = model.args
h, hkv, d = args.num_attention_heads, args.n_kv_heads, args.head_dim
layers = model.layers
rope = layers[0].self_attn.rope
W = []
for L in layers:
    a, m = L.self_attn, L.mlp
    W.append(
        [
            L.input_layernorm.weight,
            a.qkv_proj.transposed(),
            a.o_proj.transposed(),
            L.post_attention_layernorm.weight,
            m.gate_up_proj.transposed(),
            m.down_proj.transposed(),
        ]
    )
emb = model.model.embed_tokens.weight
normw = model.model.norm.weight
eps = args.rms_norm_eps
inter = args.intermediate_size


def step(ids, positions, col, keys, values):
    x = emb[ids]
    nk, nv = [], []
    b = x.shape[0]
    for (n1, qkv, o, n2, gu, dn), K, V in zip(W, keys, values, strict=True):
        y = mx.fast.rms_norm(x, n1, eps)
        qk, v = mx.split((y @ qkv).reshape(b, h + 2 * hkv, 1, d), [h + hkv], axis=1)
        qk = mx.fast.rope(qk, d, traditional=False, base=None, scale=1.0, offset=positions, freqs=rope._freqs)
        K = mx.slice_update(K, qk[:, h:], col, axes=(2,))
        V = mx.slice_update(V, v, col, axes=(2,))
        nk.append(K)
        nv.append(V)
        att = mx.as_strided(qk, (b, h * d), (qk.shape[1] * d, 1))  # stand-in for the kernel
        x = mx.addmm(x, att, o)
        y = mx.fast.rms_norm(x, n2, eps)
        g, u = mx.split(y @ gu, [inter], axis=-1)
        x = mx.addmm(x, mx.sigmoid(g) * g * u, dn)
    return mx.argmax(mx.fast.rms_norm(x, normw, eps) @ emb.T, axis=-1), nk, nv


compiled = mx.compile(step)
ids = batch._pending
positions = mx.array([100] * 64, dtype=mx.int32)
keys = [c.keys for c in batch.cache]
values = [c.values for c in batch.cache]
col = mx.array([batch.cache[0].end], dtype=mx.int32)
out = compiled(ids, positions, col, keys, values)
mx.eval(out)
t_old, t_new = [], []
ks, vs = keys, values
del keys, values
for _turn in range(6):
    for _ in range(200):
        pending = batch._pending
        t0 = time.perf_counter()
        o = batch._next_step(pending)
        t_old.append(time.perf_counter() - t0)
        mx.eval(o, *(a for c in batch.cache for a in (c.keys, c.values)))
        del o
    for _ in range(200):
        t0 = time.perf_counter()
        o, ks, vs = compiled(ids, positions, col, ks, vs)
        t_new.append(time.perf_counter() - t0)
        mx.eval(o, ks, vs)
        del o
print(
    "now ms",
    round(statistics.median(t_old) * 1e3, 3),
    "compiled ms",
    round(statistics.median(t_new) * 1e3, 3),
)
