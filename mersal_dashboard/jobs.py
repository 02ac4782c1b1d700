"""The dashboard's actions as jobs: each runs in the background and reports its progress.

A retry or delete of a whole group goes through thousands of rows, a batch per transaction;
its job says how far it got, so the page shows a progress line while it runs and the outcome
after, and a reload neither repeats nor loses it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from mersal.errors import MersalError
from mersal.urls import mask

log = logging.getLogger("mersal.dashboard")

KEPT = 200
"""Finished jobs remembered (the oldest forgotten first)."""


@dataclass
class Job:
    """One action: what it does, how far it got, and how it ended."""

    id: str
    app: str
    what: str
    back: str
    """The page to go back to afterwards."""
    total: int | None = None
    done: int = 0
    finished: bool = False
    outcome: str | None = None
    error: str | None = None

    def progress(self, done: int) -> None:
        """Record that `done` items are done so far."""
        self.done = done


Work = Callable[[Job], Awaitable[str]]
"""What a job does: given its job to report progress to, returns the outcome to show."""


@dataclass
class Jobs:
    """The jobs started here, by id."""

    _jobs: OrderedDict[str, Job] = field(default_factory=OrderedDict)
    _tasks: set[asyncio.Task[None]] = field(default_factory=set)

    def start(self, app: str, what: str, back: str, work: Work, *, total: int | None = None) -> Job:
        """Run `work` in the background as a new job."""
        job = Job(secrets.token_urlsafe(12), app, what, back, total=total)
        self._jobs[job.id] = job
        while len(self._jobs) > KEPT:
            self._jobs.popitem(last=False)
        task = asyncio.create_task(self._run(job, work), name=f"mersal-dashboard-job-{job.id}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return job

    def get(self, job_id: str) -> Job | None:
        """The job of `job_id`, if it is remembered."""
        return self._jobs.get(job_id)

    async def wait(self) -> None:
        """Wait for the running jobs to end (before the dashboard stops)."""
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)

    async def cancel(self) -> None:
        """Stop the running jobs: what they committed stays done."""
        for task in self._tasks:
            task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self.wait()

    async def _run(self, job: Job, work: Work) -> None:
        try:
            job.outcome = await work(job)
        except MersalError as error:
            job.error = str(error)
        except Exception as error:
            log.exception("dashboard job %r failed", job.what)
            job.error = f"{type(error).__name__}: {mask(str(error))}"
        finally:
            job.finished = True
