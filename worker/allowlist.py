"""Which RQ jobs an mlxq worker runs: its own two job functions, with one JSON request each."""

from __future__ import annotations

from rq.job import Job

from mlxq.jobs import keys


def forbidden_reason(job: Job) -> str | None:
    """Why this job must not run here, or None. Checked before RQ imports anything by name."""
    try:
        func_name = job.func_name
        args, kwargs = job.args, job.kwargs
    except Exception as e:
        return f"the payload is not JSON in RQ's JSON format ({type(e).__name__}: {e}); mlxq never unpickles"
    if func_name not in keys.JOB_FUNCS:
        allowed = ", ".join(sorted(keys.JOB_FUNCS))
        return f"function {func_name!r} is not an mlxq job; this worker runs only {allowed}"
    if len(args) != 1 or kwargs:
        return (
            f"{func_name} takes exactly one argument, the request object (got {len(args)} "
            f"positional and {len(kwargs)} keyword arguments)"
        )
    # RQ would import and call these by name when the job ends (the raw names: reading RQ's
    # `success_callback` imports it).
    callbacks = [
        name
        for kind in ("success", "failure", "stopped")
        if (name := getattr(job, f"_{kind}_callback_name", None))
    ]
    if callbacks:
        names = ", ".join(callbacks)
        return f"the job names callbacks ({names}); an mlxq worker calls no function a job names"
    return None
