"""Hub pulls run by the server (Ollama's /api/pull, the web page): one at a time per model name,
in a thread, with their progress where /health, /api/status and the page can read it."""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

from gateway.models.hub import HubName, Pulled, PullError, PullProgress, pull

if TYPE_CHECKING:
    from gateway.models.pool import ModelManager

log = logging.getLogger(__name__)
KEEP_FINISHED_S = 60.0  # a finished or failed pull stays listed this long


class Pulls:
    def __init__(self, manager: ModelManager) -> None:
        self.manager = manager
        self._tasks: dict[str, asyncio.Task[Pulled]] = {}

    def start(self, name: HubName) -> tuple[PullProgress, asyncio.Task[Pulled]]:
        """The pull of `name`: the one under way, or a new one."""
        key = name.canonical
        task = self._tasks.get(key)
        if task is not None and not task.done():
            return self.manager.pulls[key], task
        progress = PullProgress(key)
        self.manager.pulls[key] = progress
        task = asyncio.get_running_loop().create_task(self._run(name, progress))
        self._tasks[key] = task
        return progress, task

    async def _run(self, name: HubName, progress: PullProgress) -> Pulled:
        try:
            done = await asyncio.to_thread(pull, name, None, progress)
        except PullError as exc:
            progress.status, progress.error = "failed", str(exc)
            raise
        except Exception as exc:  # noqa: BLE001 - a pull's failure is the pull's, said to its callers
            progress.status, progress.error = "failed", f"{type(exc).__name__}: {exc}"
            raise PullError(progress.error) from exc
        finally:
            asyncio.get_running_loop().call_later(KEEP_FINISHED_S, self._forget, progress)
        self.manager.registry.refresh_user()
        log.info("pulled %s (%s)", done.model_id, done.path)
        return done

    def _forget(self, progress: PullProgress) -> None:
        if self.manager.pulls.get(progress.name) is progress and progress.status in ("done", "failed"):
            del self.manager.pulls[progress.name]
