"""A lean pool of forked worker processes: each makes its own tasks on request and sends them back
over a pipe; the main process reads them in order.

Protocol, per worker ``w`` of ``n`` (forked, so it inherits the task function, the shared ring and
whatever the main process set up, with nothing pickled): the worker's tasks are ``tasks(w, n)``, an
iterator (task ``t`` of the stream comes from worker ``t % n``). Two pipes:

- requests (main -> worker): one small message per task the main process wants; ``prefetch`` up
  front, one more each time it takes a task. The worker makes a task only when asked, so at most
  ``prefetch`` tasks per worker are made ahead (what bounds the ring's use). EOF (the main process
  closed the pipe, or died) ends the worker.
- results (worker -> main): one pickled message per task, ``(OK, payload)`` or ``(ERROR, exception
  bytes, traceback text)``. Pickled with ``multiprocessing``'s ``ForkingPickler``, so a tensor in
  torch's shared memory travels as a handle, as in torch's DataLoader.

Failure handling, as torch's DataLoader gives it (one ``RuntimeError`` in the main process): a worker
that exits or is killed before sending its task -> "worker w (pid N) exited unexpectedly (exit code
c | killed by signal SIGBUS: Bus error)"; no task within ``timeout`` seconds -> "... timed out"; an
exception raised in a worker is re-raised in the main process as itself (type and attributes: a
``SampleDecodeError`` still names its shard and key), with the worker's traceback as a note; one that
cannot be pickled becomes a ``RuntimeError`` carrying that traceback. Closing the iterator (the
consumer stopped, or an error) closes the pipes -- a worker waiting for a request sees EOF, one
sending sees a broken pipe -- and joins the workers, terminating those still busy.

Why not torch's DataLoader: per task it runs its index queue (a ``multiprocessing.Queue``: a pickle,
a lock and a feeder thread on each side), a result queue likewise, and the profiler's
``record_function`` around each ``next()``: ~140 us of CPU between the processes per message
without tensors, against ~50 us here (one pipe write and one pipe read + a pickle of a few hundred
bytes; BENCHMARKS.md "Loader per-sample cost", round 2). It also needs nothing of the DataLoader's
sampler machinery: which task a worker makes is fixed by its number.
"""

from __future__ import annotations

import itertools
import math
import multiprocessing
import pickle
import select
import signal
import time
import traceback
from multiprocessing.connection import Connection
from multiprocessing.reduction import ForkingPickler as _ForkingPickler
from typing import Any, Callable, Iterator

import torch

from headrace.dataio.usererror import UserError

OK, ERROR = 0, 1
LIVENESS_S = 1.0  # how often a wait without timeout checks that the worker is alive
JOIN_S = 2.0  # how long a closing pool waits for a worker before terminating it
_REQUEST = b"\x01"
_CONTEXT = multiprocessing.get_context("fork")  # the ring is an anonymous map: only a fork inherits it

_worker: tuple[int, int] | None = None


def worker_info() -> tuple[int, int] | None:
    """``(worker id, worker count)`` inside a pool worker, None in the main process."""
    return _worker


class WorkerError(RuntimeError):
    """A worker died, hung, or raised something that could not be sent back."""


class WorkerDied(WorkerError, UserError):
    """A worker exited or was killed (its exit code or signal named), or hung past ``worker_timeout``: an event of
    the machine (the OOM killer, a kill), reported in one line by the entry points, not a bug's traceback."""


class WorkerPool:
    """``num_workers`` forked workers (started here) and, through ``tasks()``, the payloads of tasks
    ``0 .. num_tasks-1`` (None: endless) in order: task ``t`` is made by worker ``t % num_workers`` as
    the ``t // num_workers``-th item of its ``tasks(worker, num_workers)``. ``timeout`` (<= 0: none)
    bounds the wait for one task. ``close()`` ends the workers; the caller calls it when done or failed."""

    def __init__(
        self,
        tasks: Callable[[int, int], Iterator[Any]],
        *,
        num_workers: int,
        prefetch: int,
        timeout: float,
        num_tasks: int | None,
    ):
        self.num_workers, self.timeout, self.num_tasks = num_workers, timeout, num_tasks
        self.procs: list = []
        self.requests: list[Connection] = []
        self.results: list[Connection] = []
        self.ready: list[select.poll] = []  # per results pipe, registered once (Connection.poll: a selector a call)
        self.asked = [0] * num_workers
        try:
            for w in range(num_workers):
                results_in, results_out = _CONTEXT.Pipe(duplex=False)
                requests_in, requests_out = _CONTEXT.Pipe(duplex=False)
                inherited = [
                    *self.requests,
                    *self.results,
                    results_in,
                    requests_out,
                ]  # main's ends: closed in the child
                mine = None if num_tasks is None else len(range(w, num_tasks, num_workers))
                proc = _CONTEXT.Process(
                    target=_worker_main,
                    name=f"headrace-worker-{w}",
                    daemon=True,
                    args=(w, num_workers, tasks, mine, requests_in, results_out, inherited),
                )
                proc.start()
                results_out.close()  # the worker's ends: its death is then EOF here
                requests_in.close()
                self.procs.append(proc)
                self.requests.append(requests_out)
                self.results.append(results_in)
                self.ready.append(select.poll())
                self.ready[-1].register(results_in.fileno(), select.POLLIN)
            for w in range(num_workers):
                for _ in range(prefetch):
                    self._ask(w)
        except BaseException:
            self.close(clean=False)
            raise

    def tasks(self) -> Iterator[Any]:
        t = 0
        while self.num_tasks is None or t < self.num_tasks:
            w = t % self.num_workers
            payload = self._receive(w)
            self._ask(w)
            t += 1
            self._check_alive(t)
            if self.num_tasks is not None and t + self.num_workers > self.num_tasks:
                self.requests[w].close()  # its last task is here (handles fetched): it may exit now
            yield payload
            del payload

    def _check_alive(self, received: int) -> None:
        """``WorkerDied`` for a worker gone (killed, crashed) while it still owes tasks, found at every task, not
        only at its own turn: the payloads it made before it died can feed many steps meanwhile. A worker
        exits on its own (status 0) after its last task, or after sending an error, which its turn raises in
        order; any other status is a death. Cost: one ``waitpid(WNOHANG)`` a worker."""
        for w, proc in enumerate(self.procs):
            owes = self.num_tasks is None or received + (w - received) % self.num_workers < self.num_tasks
            if owes and proc.exitcode not in (None, 0):
                raise WorkerDied(_exit_message(proc, w))

    def close(self, clean: bool = True) -> None:
        """Close the pipes and join the workers (``clean``: give each ``JOIN_S`` to finish; else
        terminate at once those still running, e.g. a hung one)."""
        for conn in (*self.requests, *self.results):
            conn.close()
        for proc in self.procs:
            proc.join(JOIN_S if clean else 0.05)
            if proc.is_alive():
                proc.terminate()
                proc.join(JOIN_S)
            if proc.is_alive():
                proc.kill()
                proc.join()
        self.procs = []

    def _ask(self, w: int) -> None:
        """Request worker ``w``'s next task, if it has one."""
        if self.num_tasks is not None and w + self.asked[w] * self.num_workers >= self.num_tasks:
            return
        self.asked[w] += 1
        try:
            self.requests[w].send_bytes(_REQUEST)
        except BrokenPipeError:  # it died: the next receive from it says how
            pass

    def _receive(self, w: int) -> Any:
        conn, proc, timeout = self.results[w], self.procs[w], self.timeout
        deadline = time.monotonic() + timeout if timeout > 0 else None
        while True:
            wait = LIVENESS_S if deadline is None else max(0.0, deadline - time.monotonic())
            if self.ready[w].poll(math.ceil(wait * 1000)):  # readable, or EOF (a hang-up): recv tells which
                try:
                    message = conn.recv()
                except (EOFError, OSError):  # OSError: it died part-way through a message ("got end of file")
                    raise WorkerDied(_exit_message(proc, w)) from None
                break
            if not proc.is_alive():
                raise WorkerDied(_exit_message(proc, w))
            if deadline is not None and time.monotonic() >= deadline:
                raise WorkerDied(
                    f"worker {w} (pid {proc.pid}) timed out: no batch within {timeout:g} s (data.worker_timeout)"
                )
        if message[0] == OK:
            return message[1]
        _, exc_bytes, trace = message
        try:
            error = pickle.loads(exc_bytes) if exc_bytes is not None else None
        except Exception:
            error = None
        if not isinstance(error, BaseException):
            raise WorkerError(f"worker {w} (pid {proc.pid}) raised:\n{trace}")
        error.add_note(f"(raised in worker {w}, pid {proc.pid}:)\n{trace}")
        raise error


def _exit_message(proc, w: int) -> str:
    proc.join(LIVENESS_S)  # the pipe closes a moment before the exit status is there
    code = proc.exitcode
    if code is not None and code < 0:
        how = f"killed by signal {signal.Signals(-code).name}: {signal.strsignal(-code)}"
    else:
        how = f"exit code {code}"
    return f"worker {w} (pid {proc.pid}) exited unexpectedly ({how})"


def _worker_main(
    worker: int,
    num_workers: int,
    tasks: Callable[[int, int], Iterator[Any]],
    count: int | None,
    requests: Connection,
    results: Connection,
    inherited: list[Connection],
) -> None:
    """Make ``count`` (None: endless) tasks, each when asked, then wait for the main process to close
    the request pipe: a tensor sent by handle (torch's shared memory) is fetched from this process
    when the main process unpickles it."""
    global _worker
    _worker = (worker, num_workers)
    for conn in inherited:
        conn.close()
    torch.set_num_threads(1)  # as torch's DataLoader workers: n workers must not each spawn a core's worth of threads
    made = tasks(worker, num_workers)
    try:
        for _ in itertools.repeat(None) if count is None else range(count):
            if not _wait_for_request(requests):
                return
            try:
                payload = next(made)
                message = _ForkingPickler.dumps((OK, payload))  # torch's reductions: shared tensors by handle
            except KeyboardInterrupt:  # Ctrl-C reaches every process: the main process reports it
                return
            except BaseException as e:
                _send_error(results, e)
                return
            try:
                results.send_bytes(message)
            except OSError:  # the main process closed the pipe (stopped early) or is gone
                return
            del payload, message
        _wait_for_request(requests)  # EOF once the main process has received the last task
    except KeyboardInterrupt:
        return


def _wait_for_request(requests: Connection) -> bool:
    """Block until the main process asks for a task (True) or closes the pipe (False)."""
    try:
        requests.recv_bytes()
        return True
    except (EOFError, OSError):
        return False


def _send_error(results: Connection, e: BaseException) -> None:
    trace = traceback.format_exc()
    try:
        exc_bytes = pickle.dumps(e)  # one that pickles but cannot be rebuilt: the main process falls back to text
    except Exception:
        exc_bytes = None
    try:
        results.send((ERROR, exc_bytes, trace))
    except OSError:  # the main process is gone
        pass


__all__ = ["WorkerError", "WorkerPool", "worker_info"]
