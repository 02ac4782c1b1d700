"""Fork the chaos programs from one interpreter that imported them once: a start costs a fork.

A cold start of `python -m tests.chaos.worker` spends about two seconds of CPU importing, and a
scenario starts a program after every kill. The harness (`tests.chaos.ledger.Zygote`) runs this
module once per scenario and talks to it in lines of JSON: it writes requests on stdin,
`{"id": N, "argv": [...], "log": PATH}`, and reads on stdout

    {"id": N, "pid": PID}            the program runs, in a process of its own
    {"id": N, "line": TEXT}          a line the program printed
    {"id": N, "code": CODE}          it ended (negative: the signal that ended it)

Each program is a real OS process (kill -9 kills it alone, its sessions and connections die
with it), its stderr in its log file. When stdin closes, every program left is killed.
"""

from __future__ import annotations

import json
import os
import random
import selectors
import signal
import sys
import traceback

import sqlalchemy.dialects.postgresql.asyncpg  # noqa: F401  (loaded by the first engine)

from tests.chaos import worker


def run_child(argv: list[str], log: str, out: int) -> None:
    """In the forked child: wire stdin, stdout and stderr, run the program and exit with it."""
    signal.set_wakeup_fd(-1)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    devnull = os.open(os.devnull, os.O_RDONLY)
    errors = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    os.dup2(devnull, 0)
    os.dup2(out, 1)
    os.dup2(errors, 2)
    for fd in (devnull, errors, out):
        os.close(fd)
    random.seed()
    code = 1
    try:
        code = worker.main(argv)
    except SystemExit as exit_:
        code = exit_.code if isinstance(exit_.code, int) else int(exit_.code is not None)
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


class Zygote:
    """The loop: start what is asked for, pass on what the programs print, report their ends."""

    def __init__(self) -> None:
        self.selector = selectors.DefaultSelector()
        self.children: dict[int, int] = {}  # pid -> request id
        self.outputs: dict[int, tuple[int, bytes]] = {}  # read end -> (request id, partial line)
        self.requests = b""

    def reply(self, **fields: object) -> None:
        """One line to the harness."""
        sys.stdout.write(json.dumps(fields) + "\n")
        sys.stdout.flush()

    def serve(self) -> None:
        """Until stdin closes, then kill what is left."""
        wake_read, wake_write = os.pipe()
        os.set_blocking(wake_read, False)
        os.set_blocking(wake_write, False)
        signal.set_wakeup_fd(wake_write)
        signal.signal(signal.SIGCHLD, lambda *_: None)
        self.selector.register(0, selectors.EVENT_READ, "requests")
        self.selector.register(wake_read, selectors.EVENT_READ, "ended")
        try:
            while self.step(wake_read):
                pass
        finally:
            for pid in self.children:
                os.kill(pid, signal.SIGKILL)

    def step(self, wake_read: int) -> bool:
        """Handle what is ready; False once stdin closed."""
        for key, _ in self.selector.select():
            if key.data == "requests":
                data = os.read(0, 65536)
                if not data:
                    return False
                self.requests += data
                while b"\n" in self.requests:
                    line, self.requests = self.requests.split(b"\n", 1)
                    self.start(json.loads(line))
            elif key.data == "ended":
                os.read(wake_read, 4096)
                self.reap()
            else:
                self.forward(key.fd)
        return True

    def start(self, request: dict[str, object]) -> None:
        """Fork the program asked for."""
        ident = int(str(request["id"]))
        argv = request["argv"]
        assert isinstance(argv, list)
        read_end, write_end = os.pipe()
        sys.stdout.flush()
        pid = os.fork()
        if pid == 0:
            os.close(read_end)
            run_child([str(a) for a in argv], str(request["log"]), write_end)
        os.close(write_end)
        self.children[pid] = ident
        self.outputs[read_end] = (ident, b"")
        self.selector.register(read_end, selectors.EVENT_READ, "output")
        self.reply(id=ident, pid=pid)

    def forward(self, fd: int) -> None:
        """Pass on the whole lines a program printed."""
        ident, partial = self.outputs[fd]
        data = os.read(fd, 65536)
        if not data:
            self.selector.unregister(fd)
            os.close(fd)
            del self.outputs[fd]
            return
        *lines, partial = (partial + data).split(b"\n")
        self.outputs[fd] = (ident, partial)
        for line in lines:
            self.reply(id=ident, line=line.decode(errors="replace"))

    def reap(self) -> None:
        """Report every program that ended."""
        while self.children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            ident = self.children.pop(pid)
            self.reply(id=ident, code=os.waitstatus_to_exitcode(status))


if __name__ == "__main__":
    Zygote().serve()
