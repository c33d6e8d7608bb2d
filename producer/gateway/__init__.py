"""An OpenAI-compatible HTTP gateway in front of the queue (`mlxq serve`; the `gateway` extra).

Stateless: every fact a request needs (API keys, jobs in flight per key, what a stream's chunks look
like) lives in Redis, so any number of instances behind a load balancer serve the same clients, and a
stream begun on one instance resumes on another. Producer side only: it enqueues jobs and reads their
streams and results as `AsyncClient` does, never imports MLX.

`app.create_app` builds the ASGI app; `cli` holds `mlxq serve` and `mlxq api-key`.
"""
