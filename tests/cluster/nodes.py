"""Three extra RabbitMQ nodes on this machine, joined into one cluster, beside the default node.

The default node (127.0.0.1:5672, its epmd, its /etc/rabbitmq files and plugins) is never
touched: these nodes run from the broker's own scripts under /usr/lib/rabbitmq/bin with every
file under one base directory (MERSAL_CLUSTER_DIR, else /tmp/mersal-cluster), and a process is
only ever signalled when its /proc/PID/environ names one of them.

    python -m tests.cluster.nodes start            # boot and join c1..c3 (reuses a healthy cluster)
    python -m tests.cluster.nodes status
    python -m tests.cluster.nodes kill c2          # SIGKILL c2's Erlang VM
    python -m tests.cluster.nodes start c2         # boot it again and wait until it has rejoined
    python -m tests.cluster.nodes restart c2       # graceful stop, then start again
    python -m tests.cluster.nodes stop c2          # graceful stop of one node
    python -m tests.cluster.nodes stop             # stop all three, remove the base directory
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import secrets
import shutil
import signal
import socket
import struct
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from urllib.parse import quote

RABBIT_BIN = Path("/usr/lib/rabbitmq/bin")
SERVER = RABBIT_BIN / "rabbitmq-server"
CTL = RABBIT_BIN / "rabbitmqctl"
COOKIE = Path("/var/lib/rabbitmq/.erlang.cookie")

NODES: tuple[str, ...] = ("c1", "c2", "c3")
PORTS: dict[str, int] = {"c1": 5681, "c2": 5682, "c3": 5683}
DIST_PORTS: dict[str, int] = {"c1": 25681, "c2": 25682, "c3": 25683}
HOST = socket.gethostname().split(".")[0]
EPMD_PORT = 4369
MARKER = ".mersal-cluster"

BOOT_TIMEOUT = 60.0
STOP_TIMEOUT = 15.0
CTL_TIMEOUT = 60.0
# rabbitmqctl's own distribution ports; the default range (35672-35682) is left to calls
# against the default node, so neither side runs out when both are busy.
CTL_DIST_PORTS = ("35700", "35740")

RABBITMQ_CONF = """\
listeners.tcp.default = 127.0.0.1:{port}
loopback_users = none
log.console = false
log.file.level = info
"""
# c2 and c3 join c1 while they boot (a node with data of its own skips this), which saves the
# four rabbitmqctl calls and second boot of the app that a join afterwards costs; one that
# gives up waiting for c1 boots alone and is joined with rabbitmqctl instead.
JOIN_AT_BOOT = """\
cluster_formation.peer_discovery_backend = classic_config
cluster_formation.classic_config.nodes.1 = {seed}
cluster_formation.discovery_retry_limit = 120
cluster_formation.discovery_retry_interval = 250
"""
# Not a rabbitmq.conf key in 3.10 (the node refuses to boot with it there); the default makes
# at-least-once dead-lettering wait 180 s before it re-sends an unconfirmed message.
ADVANCED_CONFIG = "[{rabbit, [{dead_letter_worker_publisher_confirm_timeout, 5000}]}].\n"
ENABLED_PLUGINS = "[rabbitmq_consistent_hash_exchange].\n"


class ClusterError(RuntimeError):
    """A node did not do what was asked of it in time."""


def node_name(node: str) -> str:
    """The Erlang node name of a short name: c1 -> mersal-c1@HOST."""
    if node not in NODES:
        raise ValueError(f"unknown node {node!r}; the nodes are {', '.join(NODES)}")
    return f"mersal-{node}@{HOST}"


def short_name(full: str) -> str:
    """The short name of an Erlang node name: mersal-c1@HOST -> c1."""
    return full.split("@", 1)[0].removeprefix("mersal-")


def default_base() -> Path:
    """The base directory: MERSAL_CLUSTER_DIR, else /tmp/mersal-cluster."""
    return Path(os.environ.get("MERSAL_CLUSTER_DIR") or "/tmp/mersal-cluster")


def erlang_cookie() -> bytes:
    """The default node's Erlang cookie, or a random one when this user may not read it."""
    try:
        return COOKIE.read_bytes()
    except OSError:
        return secrets.token_hex(20).upper().encode()


def wait_for(what: str, check: Callable[[], bool], timeout: float, interval: float = 0.1) -> None:
    """Poll `check` until it is true; ClusterError naming `what` after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise ClusterError(f"not within {timeout:.0f} s: {what}")
        time.sleep(interval)


def alive(pid: int) -> bool:
    """Whether process `pid` exists and is not a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")


def command_name(pid: int) -> str:
    """The process's command name (/proc/PID/comm), or "" when it is gone."""
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def belongs_to(pid: int, node: str) -> bool:
    """Whether process `pid` was started for `node` (its environ names the node)."""
    try:
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return False
    return f"RABBITMQ_NODENAME={node_name(node)}".encode() in environ


def node_processes(node: str) -> list[int]:
    """The live processes started for `node`, except an epmd one may have started."""
    pids = (int(entry.name) for entry in Path("/proc").iterdir() if entry.name.isdigit())
    return [
        pid for pid in pids if belongs_to(pid, node) and alive(pid) and command_name(pid) != "epmd"
    ]


def rss_kib(pid: int) -> int:
    """The resident set size of `pid` in KiB (VmRSS), 0 when it is gone."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return 0
    for line in status.splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def epmd_port(name: str) -> int | None:
    """The distribution port epmd has registered for `name` (the part before @), if any."""
    request = b"z" + name.encode()
    try:
        with socket.create_connection(("127.0.0.1", EPMD_PORT), timeout=2) as sock:
            sock.sendall(struct.pack(">H", len(request)) + request)
            reply = sock.recv(4)
    except OSError:
        return None
    if len(reply) < 4 or reply[:2] != b"w\x00":
        return None
    return int(struct.unpack(">H", reply[2:4])[0])


class Cluster:
    """Three RabbitMQ nodes, c1..c3, clustered; AMQP on PORTS, all files under `base`."""

    def __init__(self, base: Path | None = None) -> None:
        self.base = base or default_base()
        self.boot_seconds: float | None = None
        self.phases: dict[str, float] = {}

    # -- the cluster ------------------------------------------------------------------------

    def start(self) -> None:
        """Boot the three nodes and join c2 and c3 to c1; reuse a cluster that is up.

        A boot that fails (seen: a node stopping while it joins at boot on a loaded machine)
        is tried once more from scratch.
        """
        if self.healthy():
            self.boot_seconds, self.phases = None, {}
            return
        try:
            self._boot()
        except ClusterError as error:
            print(f"[cluster] boot failed, trying again from scratch: {error}", file=sys.stderr)
            self.teardown()
            self._boot()

    def _boot(self) -> None:
        began = time.monotonic()
        self._halt_all()
        self._prepare()
        self._parallel(self._spawn)
        self._parallel(self._await_boot)
        self.phases["boot"] = time.monotonic() - began
        members = self.running()
        strays = [node for node in NODES[1:] if node not in members]
        if strays:
            self._parallel(self._join, strays)
            wait_for("3 running nodes", lambda: self.running() == list(NODES), BOOT_TIMEOUT, 0.2)
        # Nodes that cluster while they boot can settle on fewer feature flags than a lone
        # node enables (seen: quorum queues disabled); turn every one on.
        self.ctl("enable_feature_flag", "all")
        self.phases["join"] = time.monotonic() - began - self.phases["boot"]
        self.boot_seconds = time.monotonic() - began

    def teardown(self) -> None:
        """Stop every node (gracefully, then SIGKILL) and remove the base directory."""
        self._halt_all()
        if (self.base / MARKER).exists():
            shutil.rmtree(self.base, ignore_errors=True)

    def healthy(self) -> bool:
        """Whether all three nodes run, the cluster counts all three, and quorum queues work."""
        if any(self.pid(node) is None for node in NODES):
            return False
        if self.running() != list(NODES):
            return False
        flags = self.ctl("list_feature_flags", "name", "state", "--formatter", "json")
        return all(flag.get("state") == "enabled" for flag in json.loads(flags or "[]"))

    def running(self) -> list[str]:
        """The short names of the nodes the cluster counts as running, in NODES order."""
        for node in NODES:
            if self.pid(node) is None:
                continue
            try:
                output = self.ctl("cluster_status", "--formatter", "json", node=node, timeout=20)
            except (ClusterError, subprocess.TimeoutExpired):
                continue
            names = {short_name(full) for full in json.loads(output).get("running_nodes", [])}
            return [known for known in NODES if known in names]
        return []

    # -- one node ---------------------------------------------------------------------------

    def pid(self, node: str) -> int | None:
        """The OS pid of the node's Erlang VM (beam.smp), or None when it is not running."""
        saved = self._saved_pid(node)
        candidates = [saved] if saved is not None else []
        for pid in [*candidates, *node_processes(node)]:
            if alive(pid) and belongs_to(pid, node) and command_name(pid).startswith("beam"):
                return pid
        return None

    def kill(self, node: str) -> None:
        """SIGKILL the node's Erlang VM and wait until it is gone."""
        pid = self.pid(node)
        if pid is None:
            raise ClusterError(f"{node} is not running")
        os.kill(pid, signal.SIGKILL)
        wait_for(f"{node} (pid {pid}) gone", lambda: not alive(pid), STOP_TIMEOUT, 0.02)
        self._await_unregistered(node)

    def stop_node(self, node: str) -> None:
        """Stop the node gracefully (rabbitmqctl stop); SIGKILL it if it takes too long."""
        self._halt(node)

    def start_node(self, node: str) -> None:
        """Boot the node again with its old data and wait until it runs in the cluster."""
        if self.pid(node) is None:
            self._spawn(node)
            self._await_boot(node)
        wait_for(f"{node} running in the cluster", lambda: node in self.running(), BOOT_TIMEOUT)

    # -- talking to the nodes ---------------------------------------------------------------

    def url(self, node: str, vhost: str = "/") -> str:
        """The AMQP URL of `vhost` on `node`."""
        node_name(node)
        return f"amqp://guest:guest@127.0.0.1:{PORTS[node]}/{quote(vhost, safe='')}"

    def failover_url(self, vhost: str = "/", order: Sequence[str] = NODES) -> str:
        """The URLs of `vhost` on every node of `order`, joined by ";"."""
        return ";".join(self.url(node, vhost) for node in order)

    def ctl(self, *args: str, node: str | None = None, timeout: float = CTL_TIMEOUT) -> str:
        """Run `rabbitmqctl -q ARGS` against `node` (else the first running one); its stdout."""
        target = node or self._any_running()
        command = [str(CTL), "-q", "-n", node_name(target), *args]
        result = subprocess.run(
            command,
            env=self._ctl_env(),
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
        if result.returncode:
            detail = (result.stderr or result.stdout).strip()
            raise ClusterError(f"rabbitmqctl {' '.join(args)} on {target}: {detail}")
        return result.stdout

    def add_vhost(self, vhost: str) -> None:
        """Create `vhost` and give guest every permission on it."""
        self.ctl("add_vhost", vhost)
        self.ctl("set_permissions", "-p", vhost, "guest", ".*", ".*", ".*")

    def delete_vhost(self, vhost: str) -> None:
        """Delete `vhost` and everything in it."""
        self.ctl("delete_vhost", vhost)

    def leader(self, queue: str, vhost: str = "/") -> str:
        """The short name of the node leading quorum queue `queue`; LookupError if none."""
        output = self.ctl("list_queues", "-p", vhost, "name", "leader", "--formatter", "json")
        for row in json.loads(output or "[]"):
            if row.get("name") == queue and row.get("leader"):
                return short_name(str(row["leader"]))
        raise LookupError(f"no leader for queue {queue!r} in vhost {vhost!r}")

    # -- files and environments -------------------------------------------------------------

    def node_dir(self, node: str) -> Path:
        """The directory holding the node's config, data and logs."""
        return self.base / node

    def _prepare(self) -> None:
        """A fresh base directory: cookie, empty env file, each node's config files."""
        if self.base.exists() and any(self.base.iterdir()):
            if not (self.base / MARKER).exists():
                raise ClusterError(f"{self.base} is not empty and not a cluster's base directory")
            shutil.rmtree(self.base)
        (self.base / "home").mkdir(parents=True)
        (self.base / MARKER).touch()
        (self.base / "rabbitmq-env.conf").touch()
        cookie = os.open(self.base / "home" / ".erlang.cookie", os.O_WRONLY | os.O_CREAT, 0o400)
        with os.fdopen(cookie, "wb") as file:
            file.write(erlang_cookie())
        for node in NODES:
            folder = self.node_dir(node)
            (folder / "data").mkdir(parents=True)
            (folder / "log").mkdir()
            conf = RABBITMQ_CONF.format(port=PORTS[node])
            if node != NODES[0]:
                conf += JOIN_AT_BOOT.format(seed=node_name(NODES[0]))
            (folder / "rabbitmq.conf").write_text(conf)
            (folder / "advanced.config").write_text(ADVANCED_CONFIG)
            (folder / "enabled_plugins").write_text(ENABLED_PLUGINS)

    def _clean_env(self) -> dict[str, str]:
        """This process's environment without RabbitMQ or Erlang settings, with a private HOME."""
        env = {
            key: value
            for key, value in os.environ.items()
            if not key.startswith(("RABBITMQ_", "ERL_")) and key != "CONF_ENV_FILE"
        }
        env["HOME"] = str(self.base / "home")
        env["RABBITMQ_CONF_ENV_FILE"] = str(self.base / "rabbitmq-env.conf")
        env.setdefault("LANG", "C.UTF-8")
        return env

    def _ctl_env(self) -> dict[str, str]:
        """The environment rabbitmqctl runs in."""
        env = self._clean_env()
        env["RABBITMQ_CTL_DIST_PORT_MIN"], env["RABBITMQ_CTL_DIST_PORT_MAX"] = CTL_DIST_PORTS
        return env

    def _node_env(self, node: str) -> dict[str, str]:
        """The environment the node's rabbitmq-server runs in."""
        folder = self.node_dir(node)
        env = self._clean_env()
        env.update(
            RABBITMQ_NODENAME=node_name(node),
            RABBITMQ_NODE_IP_ADDRESS="127.0.0.1",
            RABBITMQ_NODE_PORT=str(PORTS[node]),
            RABBITMQ_DIST_PORT=str(DIST_PORTS[node]),
            RABBITMQ_SERVER_ADDITIONAL_ERL_ARGS="-kernel inet_dist_use_interface {127,0,0,1}",
            RABBITMQ_MNESIA_BASE=str(folder / "data"),
            RABBITMQ_LOG_BASE=str(folder / "log"),
            RABBITMQ_CONFIG_FILE=str(folder / "rabbitmq.conf"),
            RABBITMQ_ADVANCED_CONFIG_FILE=str(folder / "advanced.config"),
            RABBITMQ_ENABLED_PLUGINS_FILE=str(folder / "enabled_plugins"),
            RABBITMQ_PID_FILE=str(folder / f"{node}.pid"),
            ERL_CRASH_DUMP=str(folder / "log" / "erl_crash.dump"),
            ERL_EPMD_ADDRESS="127.0.0.1",
        )
        return env

    # -- booting and stopping ---------------------------------------------------------------

    def _spawn(self, node: str) -> None:
        """Start the node's rabbitmq-server in a session of its own, detached from us."""
        folder = self.node_dir(node)
        (folder / f"{node}.pid").unlink(missing_ok=True)
        (folder / f"{node}.pid.saved").unlink(missing_ok=True)
        with open(folder / "log" / "server.out", "ab") as out:
            subprocess.run(
                ["setsid", "--fork", str(SERVER)],
                env=self._node_env(node),
                cwd=folder,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                check=True,
            )

    def _await_boot(self, node: str) -> None:
        """Wait until the node has registered with epmd and booted; remember its pid."""

        def registered() -> bool:
            if not node_processes(node):
                raise ClusterError(f"{node} exited while booting:\n{self._log_tail(node)}")
            return epmd_port(f"mersal-{node}") == DIST_PORTS[node]

        wait_for(f"{node} registered with epmd", registered, BOOT_TIMEOUT, 0.05)
        seconds = str(int(BOOT_TIMEOUT))
        self.ctl("await_startup", "--timeout", seconds, node=node, timeout=BOOT_TIMEOUT + 10)
        pid = self.pid(node)
        if pid is None:
            raise ClusterError(f"{node} booted but its Erlang VM cannot be found")
        (self.node_dir(node) / f"{node}.pid.saved").write_text(f"{pid}\n")

    def _join(self, node: str) -> None:
        """Make `node` a member of c1's cluster (stop_app, reset, join_cluster, start_app)."""
        self.ctl("stop_app", node=node)
        self.ctl("reset", node=node)
        self.ctl("join_cluster", node_name(NODES[0]), node=node)
        self.ctl("start_app", node=node)

    def _halt_all(self) -> None:
        """Stop every node that runs, all at once."""
        self._parallel(self._halt)

    def _halt(self, node: str) -> None:
        """Stop the node gracefully, then SIGKILL what is left of it after STOP_TIMEOUT."""
        if not node_processes(node):
            return
        if self.pid(node) is not None:
            with contextlib.suppress(ClusterError, subprocess.TimeoutExpired):
                self.ctl("stop", node=node, timeout=STOP_TIMEOUT)
        with contextlib.suppress(ClusterError):
            wait_for(f"{node} stopped", lambda: self.pid(node) is None, STOP_TIMEOUT)
        for pid in node_processes(node):
            if belongs_to(pid, node):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        wait_for(f"{node} gone", lambda: not node_processes(node), STOP_TIMEOUT)
        self._await_unregistered(node)

    def _await_unregistered(self, node: str) -> None:
        """Wait until epmd has forgotten the node, so its name can be registered again."""
        name = f"mersal-{node}"
        wait_for(f"epmd forgetting {name}", lambda: epmd_port(name) is None, STOP_TIMEOUT, 0.02)

    def _any_running(self) -> str:
        """The first node whose Erlang VM runs."""
        for node in NODES:
            if self.pid(node) is not None:
                return node
        raise ClusterError("no node of the cluster is running")

    def _saved_pid(self, node: str) -> int | None:
        """The pid remembered when the node last booted (RabbitMQ deletes its own pid file)."""
        for name in (f"{node}.pid.saved", f"{node}.pid"):
            with contextlib.suppress(OSError, ValueError):
                return int((self.node_dir(node) / name).read_text().strip())
        return None

    def _log_tail(self, node: str, lines: int = 30) -> str:
        """The last lines of the node's console output and log, for error messages."""
        logs = self.node_dir(node) / "log"
        texts = []
        for path in (logs / "server.out", logs / f"{node_name(node)}.log"):
            with contextlib.suppress(OSError):
                texts.append("\n".join(path.read_text(errors="replace").splitlines()[-lines:]))
        return "\n".join(texts)

    @staticmethod
    def _parallel(action: Callable[[str], None], nodes: Sequence[str] = NODES) -> None:
        """Run `action` for each of `nodes` at once; re-raise the first failure."""
        with ThreadPoolExecutor(max_workers=len(nodes)) as pool:
            for _ in pool.map(action, nodes):
                pass


def status_lines(cluster: Cluster, running: Sequence[str]) -> list[str]:
    """One line per node: names, ports, pid, RSS and whether the cluster counts it running."""
    lines = [f"base {cluster.base}"]
    for node in NODES:
        pid = cluster.pid(node)
        if pid is None:
            state, process = "down", "pid -"
        else:
            state = "running" if node in running else "not running in the cluster"
            process = f"pid {pid} rss {rss_kib(pid) // 1024} MiB"
        lines.append(f"{node}  {node_name(node)}  amqp {PORTS[node]}  {process}  {state}")
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    """The command line: start|stop|status [NODE], kill NODE, restart NODE."""
    parser = argparse.ArgumentParser(
        prog="python -m tests.cluster.nodes", description="A local 3-node RabbitMQ cluster."
    )
    parser.add_argument("command", choices=("start", "stop", "status", "kill", "restart"))
    parser.add_argument("node", nargs="?", choices=NODES)
    args = parser.parse_args(argv)
    if args.command in ("kill", "restart") and args.node is None:
        parser.error(f"{args.command} needs a node: {', '.join(NODES)}")
    if not SERVER.exists():
        print(f"{SERVER} is missing: RabbitMQ is not installed here", file=sys.stderr)
        return 1
    cluster = Cluster()
    try:
        return run(cluster, args.command, args.node)
    except ClusterError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1


def run(cluster: Cluster, command: str, node: str | None) -> int:
    """Carry out one command line; the exit status."""
    began = time.monotonic()
    if command == "status":
        running = cluster.running()
        print("\n".join(status_lines(cluster, running)))
        return 0 if running == list(NODES) else 3
    if command == "start" and node is None:
        cluster.start()
        done = "reused" if cluster.boot_seconds is None else f"up in {cluster.boot_seconds:.1f} s"
        print(f"cluster {done}: {cluster.failover_url()}")
        return 0
    if command == "stop" and node is None:
        cluster.teardown()
        print(f"cluster stopped and {cluster.base} removed in {time.monotonic() - began:.1f} s")
        return 0
    assert node is not None
    if command in ("stop", "restart"):
        cluster.stop_node(node)
    if command == "kill":
        cluster.kill(node)
    if command in ("start", "restart"):
        cluster.start_node(node)
    print(f"{command} {node}: done in {time.monotonic() - began:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
