"""How a worker engine's process is reached and watched: a local worker process (spawned, with a
warm standby), a remote worker over TCP/TLS, the supervision settings, and what the host says of
a process (its memory, why it exited, the kernel's OOM kills)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
import ssl
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from engines.base import EngineConfig, LoadInterrupted, ModelLoadError
from engines.worker import wire

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Supervision:
    """How a worker is watched and restarted."""

    heartbeat_s: float = 0.5  # ping interval
    heartbeat_timeout_s: float = 3.0  # no answer for this long: the worker is hung
    step_timeout_s: float = 120.0  # one engine step running this long: the device is hung
    max_crashes: int = 3  # crashes within the window before giving up on this engine
    crash_window_s: float = 300.0
    backoff_s: tuple[float, ...] = (0.5, 2.0, 8.0)  # wait before restart n (then doubling, up to max_backoff_s)
    load_timeout_s: float = 600.0
    max_backoff_s: float = 30.0

    def delay(self, n: int) -> float:
        """The wait before restart `n` (1-based)."""
        if n <= len(self.backoff_s):
            return self.backoff_s[max(0, n - 1)]
        return min(self.max_backoff_s, self.backoff_s[-1] * 2.0 ** (n - len(self.backoff_s)))


class Connection(Protocol):
    """How to reach a worker: start (or dial) it and get a loaded engine's Ready."""

    what: str  # for messages: "local worker", "worker at 10.0.0.2:7000"

    async def open(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter, wire.Ready]: ...

    def kill(self) -> None:
        """Make sure the worker is gone (a local one is SIGKILLed; a remote connection is dropped)."""

    async def exit_reason(self) -> str:
        """Why the worker went away, as well as can be told ("killed by SIGSEGV", "closed the connection")."""
        ...


async def _exit_of(process: asyncio.subprocess.Process) -> str:
    """How a worker process ended, waiting briefly for it ("closed its connection" if it lives on)."""
    try:
        code = await asyncio.wait_for(process.wait(), 2.0)
    except TimeoutError:
        return "closed its connection"
    return _describe_exit(code)


def _describe_exit(code: int | None) -> str:
    if code is None:
        return "stopped answering"
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with status {code}"


async def _expect_ready(reader: asyncio.StreamReader, timeout: float) -> wire.Ready:
    msg = wire.decode_for_gateway(await asyncio.wait_for(wire.read_frame(reader), timeout))
    if isinstance(msg, wire.Error):
        raise wire.error_from(msg) if msg.kind != "Unauthorized" else ModelLoadError(msg.message)
    if not isinstance(msg, wire.Ready):
        raise wire.ProtocolError(f"expected Ready, got {type(msg).__name__}")
    return msg


def rss_bytes(pid: int) -> int | None:
    """Resident memory of a process (Linux /proc; None elsewhere or when it is gone)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def oom_kills() -> int | None:
    """The kernel's OOM kills in this process's cgroup so far (cgroup v2 `memory.events`; None where
    it cannot be read). A worker shares the gateway's cgroup, so a rise means a memory kill there."""
    try:
        rel = next(line.split(":", 2)[2] for line in Path("/proc/self/cgroup").read_text().splitlines()
                   if line.startswith("0::"))
        for folder in (Path("/sys/fs/cgroup") / rel.strip().lstrip("/"), Path("/sys/fs/cgroup")):
            events = folder / "memory.events"
            if events.exists():
                for line in events.read_text().splitlines():
                    key, _, value = line.partition(" ")
                    if key == "oom_kill":
                        return int(value)
    except (OSError, StopIteration, ValueError):
        return None
    return None


# Seconds after a standby took over before the next one starts loading.
SPARE_DELAY_S = 5.0

_Spawned = tuple[asyncio.subprocess.Process, asyncio.StreamReader, asyncio.StreamWriter, wire.Ready]


class LocalWorker:
    """A worker process on this host, started with one end of a socketpair."""

    what = "local worker"

    def __init__(self, runtime: str, config: EngineConfig, env: dict[str, str] | None = None,
                 plugins: tuple[str, ...] = (), log_level: str = "info", load_timeout_s: float = 600.0,
                 standby: bool = False) -> None:
        self.runtime = runtime
        self.config = config
        self.env = env or {}
        self.plugins = plugins
        self.log_level = log_level
        self.load_timeout_s = load_timeout_s
        self.process: asyncio.subprocess.Process | None = None
        self._we_killed = False
        self._oom_base: int | None = None  # the cgroup's OOM kills when the serving worker started
        # A warm standby: a second worker, loaded and waiting, that takes over at once when the
        # serving one dies (then another is loaded behind it). Costs a second copy of the model.
        self.standby = standby
        self._spare: asyncio.Task[_Spawned] | None = None
        self._trusted = False  # the first worker passed its functional check: standbys are worth loading

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process else None

    def killed_from_outside(self) -> bool:
        """The worker died of a SIGKILL that the gateway did not send (`kill -9`)."""
        p = self.process
        return p is not None and p.returncode == -signal.SIGKILL and not self._we_killed and not self.memory_killed()

    def memory_killed(self) -> bool:
        """The worker died of a SIGKILL while the kernel's OOM killer killed in this cgroup (its
        `memory.events` count rose since the worker started serving): the running requests' doing."""
        p = self.process
        if p is None or p.returncode != -signal.SIGKILL or self._we_killed:
            return False
        now = oom_kills()
        return now is not None and self._oom_base is not None and now > self._oom_base

    async def open(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter, wire.Ready]:
        """A loaded worker: the standby when one is ready, else a new one."""
        got = await self._take_spare()
        if got is None:
            got = await self._spawn()
        self.process, reader, writer, ready = got
        self._we_killed = False
        self._oom_base = oom_kills()
        if self._spare is None and self.standby and self._trusted:
            # Not at once: loading the next standby would compete with the streams resuming on
            # this one (its replay and prefill) for the same cores.
            self._spare = asyncio.create_task(self._spawn(after_s=SPARE_DELAY_S))
        return reader, writer, ready

    def keep_spare(self) -> None:
        """Load a standby behind the serving worker (when this worker has one)."""
        self._trusted = True
        if self.standby and self._spare is None:
            self._spare = asyncio.create_task(self._spawn())

    def spare_ready(self) -> bool:
        t = self._spare
        return t is not None and t.done() and not t.cancelled() and t.exception() is None \
            and t.result()[0].returncode is None

    def spare_pid(self) -> int | None:
        return self._spare.result()[0].pid if self.spare_ready() and self._spare is not None else None

    async def _take_spare(self) -> _Spawned | None:
        task, self._spare = self._spare, None
        if task is None:
            return None
        try:
            got = await task
        except Exception as exc:  # noqa: BLE001 - a standby that failed to load: start a new worker
            log.warning("the standby worker failed to load (%s); starting a new one", exc)
            return None
        if got[0].returncode is not None:
            return None
        return got

    async def drop_spare(self) -> None:
        task, self._spare = self._spare, None
        if task is None:
            return
        task.cancel()
        with contextlib.suppress(BaseException):
            proc, _reader, writer, _ready = await task
            writer.close()
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await proc.wait()

    async def _spawn(self, after_s: float = 0.0) -> _Spawned:
        await asyncio.sleep(after_s)
        ours, theirs = socket.socketpair()
        args = [sys.executable, "-m", "engines.worker", "--fd", str(theirs.fileno()), "--log-level", self.log_level]
        for p in self.plugins:
            args += ["--plugin", p]
        try:
            # Its own session: a terminal's Ctrl-C reaches the gateway, which drains and then
            # closes the socket; the worker never outlives it (the socket, and PR_SET_PDEATHSIG).
            oom_base = oom_kills()
            process = await asyncio.create_subprocess_exec(
                *args, pass_fds=(theirs.fileno(),), env={**os.environ, **self.env}, start_new_session=True,
            )
        finally:
            theirs.close()
        writer: asyncio.StreamWriter | None = None
        try:
            reader, writer = await asyncio.open_connection(sock=ours)
            writer.write(wire.frame(wire.Hello(wire.PROTOCOL)))
            writer.write(wire.frame(wire.Load(self.runtime, self.config)))
            ready = await _expect_ready(reader, self.load_timeout_s)
        except (asyncio.IncompleteReadError, ConnectionError) as exc:
            if writer is not None:
                writer.close()
            else:
                ours.close()
            how = await _exit_of(process)
            now = oom_kills()
            if process.returncode == -signal.SIGKILL and not (now is not None and oom_base is not None and now > oom_base):
                raise LoadInterrupted(f"the worker {how} from outside while loading") from exc
            raise ModelLoadError(f"the worker {how} while loading") from exc
        except BaseException:
            # Cancelled (a standby dropped, a load abandoned) or timed out: the process is killed
            # and reaped here, so that no unreaped child outlives the task that started it.
            if writer is not None:
                writer.close()
            else:
                ours.close()
            with contextlib.suppress(ProcessLookupError):
                process.kill()
            with contextlib.suppress(BaseException):
                await asyncio.wait_for(process.wait(), 5.0)
            raise
        return process, reader, writer, ready

    def kill(self) -> None:
        if self.process is not None and self.process.returncode is None:
            self._we_killed = True
            with contextlib.suppress(ProcessLookupError):
                self.process.kill()

    async def exit_reason(self) -> str:
        if self.process is None:
            return "never started"
        return await _exit_of(self.process)


class RemoteWorker:
    """A worker on another host (`gateway worker --listen`), dialled over TCP (optionally TLS)."""

    def __init__(self, host: str, port: int, token: str, ssl_context: ssl.SSLContext | None = None,
                 timeout_s: float = 10.0) -> None:
        self.host, self.port, self.token = host, port, token
        self.ssl_context = ssl_context
        self.timeout_s = timeout_s
        self.what = f"worker at {host}:{port}"
        self._writer: asyncio.StreamWriter | None = None

    async def open(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter, wire.Ready]:
        try:
            reader, writer = await asyncio.wait_for(
                asyncio.open_connection(self.host, self.port, ssl=self.ssl_context), self.timeout_s)
        except (OSError, TimeoutError) as exc:
            raise ModelLoadError(f"cannot reach the {self.what}: {exc}") from exc
        writer.write(wire.frame(wire.Hello(wire.PROTOCOL, self.token)))
        try:
            ready = await _expect_ready(reader, self.timeout_s)
        except (asyncio.IncompleteReadError, ConnectionError) as exc:
            writer.close()
            raise ModelLoadError(f"the {self.what} closed the connection during the handshake") from exc
        except BaseException:
            writer.close()
            raise
        self._writer = writer
        return reader, writer, ready

    def kill(self) -> None:
        if self._writer is not None:
            self._writer.close()

    async def exit_reason(self) -> str:
        return "closed the connection"
