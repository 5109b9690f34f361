"""The processes of one soak run on loopback: the server (a coordinator with shard processes, or
one single-process server), an aloe-linkemu in front of shard 0 (or of the single server), the
trainers and the evaluator. Each process keeps one log file over its restarts (a "=== start N"
line before each); every start is recorded with its time."""

import os
import re
import signal
import socket
import subprocess
import time
import urllib.request

from sim.backends import blas_env  # noqa: F401 (the runner's environment)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rss_kib(pid):
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


class Proc:
    """One logical process (e.g. "worker2", "shard0") over its restarts."""

    def __init__(self, name, args, log_path, env):
        self.name = name
        self.args = args
        self.log_path = log_path
        self.env = env
        self.popen = None
        self.starts = []        # start times (monotonic)
        self.frozen = False
        self.peak_rss_kib = 0
        self.exits = []         # (time, return code) of every end seen
        # aloe_worker_retries_total: the sum over the earlier starts, and this start's last
        # scraped value.
        self.retries_before = 0.0
        self.last_retries = 0.0
        self._port = None

    def start(self, extra=()):
        with open(self.log_path, "a") as log:
            log.write(f"=== start {len(self.starts) + 1}: {' '.join(self.args + list(extra))}\n")
            log.flush()
            self.popen = subprocess.Popen(self.args + list(extra), stdout=log,
                                          stderr=subprocess.STDOUT, env=self.env,
                                          start_new_session=True)
        self.starts.append(time.monotonic())
        self.frozen = False
        self._port = None
        self.retries_before += self.last_retries
        self.last_retries = 0.0
        return self

    def metrics_port(self):
        """The port of this start's Prometheus endpoint ("metrics on port N" in its log)."""
        if self._port is None:
            text = self.log_text()
            start = text.rfind("=== start")
            m = re.search(r"metrics on port (\d+)", text[start:])
            if m:
                self._port = int(m.group(1))
        return self._port

    def alive(self):
        return self.popen is not None and self.popen.poll() is None

    def signal(self, sig):
        if self.alive():
            self.popen.send_signal(sig)
            return True
        return False

    def wait(self, timeout):
        """The return code, or None when it did not end in `timeout` seconds."""
        if self.popen is None:
            return None
        try:
            code = self.popen.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return None
        self.exits.append((time.monotonic(), code))
        return code

    def kill(self):
        """SIGKILL (after SIGCONT for a frozen one) and reap."""
        if self.popen is None:
            return None
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGKILL)
        code = self.popen.wait()
        self.exits.append((time.monotonic(), code))
        self.frozen = False
        return code

    def sample_rss(self):
        if self.alive():
            self.peak_rss_kib = max(self.peak_rss_kib, rss_kib(self.popen.pid))

    def log_text(self):
        try:
            with open(self.log_path, errors="replace") as f:
                return f.read()
        except OSError:
            return ""


def read_port_file(path):
    try:
        with open(path) as f:
            text = f.read()
    except OSError:
        return None
    m = re.search(r"grpc=(\d+) metrics=(-?\d+)", text)
    return (int(m.group(1)), int(m.group(2))) if m else None


def wait_port_file(path, proc, timeout):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ports = read_port_file(path)
        if ports:
            return ports
        if not proc.alive():
            return None
        time.sleep(0.05)
    return None


def scrape(port, names, timeout=0.5):
    """{name: value} of the samples `names` (summed over their labels) at
    http://127.0.0.1:port/metrics; {} when it cannot be read."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=timeout) as r:
            text = r.read().decode(errors="replace")
    except (OSError, ValueError):
        return {}
    out = {}
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        parts = line.split()
        if len(parts) < 2:
            continue
        name = parts[0].split("{")[0]
        if name in names:
            try:
                out[name] = out.get(name, 0.0) + float(parts[-1])
            except ValueError:
                pass
    return out
