"""The two back ends of scripts/simulate-stragglers. Both turn a grid.Run into a directory with
config.textproto, a log and sim.csv in aloe-sim's CSV format (sim/simulator.h):

  virtual_time,version,worker,staleness,shard,steps,eval_loss,outcome

- SimBackend: build/bin/aloe-sim, virtual clock, deterministic (same run -> same CSV).
- LoopbackBackend: a real aloe-server, an evaluator and one aloe-worker process per simulated
  worker on 127.0.0.1 (OS-chosen ports). Speeds become --slowdown (fastest / own speed), joins
  and leaves become process starts and SIGTERMs at those wall-clock offsets, the run is bounded
  by max_seconds. Rows come from the workers' round log lines (time, base version, steps,
  resulting version) and the server's evaluation lines; time is wall seconds since the trainers
  were started. Step-time traces (random stragglers) become aloe-worker --step_trace with the
  same trace file, each worker replaying its own cycle (--trace_worker).
"""

import json
import os
import re
import signal
import subprocess
import time

from . import grid
from . import textproto

CSV_HEADER = "virtual_time,version,worker,staleness,shard,steps,eval_loss,outcome"


def blas_env():
    """scripts/lib.sh aloe_blas_env: name an OpenBLAS core type the CPU supports and use one
    intra-op thread per process."""
    env = dict(os.environ)
    if not env.get("OPENBLAS_CORETYPE"):
        try:
            with open("/proc/cpuinfo") as f:
                flags = f.read()
        except OSError:
            flags = ""
        if " avx512f " in flags:
            env["OPENBLAS_CORETYPE"] = "SkylakeX"
        elif " avx2 " in flags:
            env["OPENBLAS_CORETYPE"] = "Haswell"
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def _write(path, text):
    with open(path, "w") as f:
        f.write(text)


def _reap(procs, timeout):
    """Waits for every process, killing one that has not exited within `timeout` seconds."""
    for p in procs:
        try:
            p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def write_trace(run, run_dir):
    """Writes run.trace to run_dir/trace.csv in aloe-sim's --trace format (which aloe-worker
    --step_trace reads too); returns its path, or None for a run without a trace."""
    if run.trace is None:
        return None
    lines = ["# worker_index,seconds_per_step (a cycle per worker, replayed forever)"]
    for w, cycle in sorted(run.trace.items()):
        lines += [f"{w},{grid._fmt(s)}" for s in cycle]
    path = os.path.join(run_dir, "trace.csv")
    _write(path, "\n".join(lines) + "\n")
    return path


class SimBackend:
    name = "sim"

    def __init__(self, bin_dir, corpus_dir, link=None):
        self.binary = os.path.join(bin_dir, "aloe-sim")
        self.corpus_dir = corpus_dir
        # (rate Mbit/s, round trip ms): every simulated worker's link (aloe-sim --links, one
        # way latency half the round trip); None = instant transfers.
        self.link = link
        if not os.access(self.binary, os.X_OK):
            raise FileNotFoundError(f"{self.binary} not found: build it first (scripts/test.sh "
                                    "or cmake --build build --target aloe-sim)")

    def command(self, run, run_dir):
        cmd = [self.binary, f"--config={run_dir}/config.textproto", f"--trainer={run.trainer}",
               f"--out={run_dir}/sim.csv", f"--seed={run.seed}",
               f"--eval_every={run.eval_every}"]
        if run.trace is not None:
            cmd.append(f"--trace={run_dir}/trace.csv")
        else:
            cmd.append("--speeds=" + ",".join(grid._fmt(v) for v in run.speeds))
        if run.events:
            cmd.append(f"--events={run.events_flag()}")
        if run.max_local_steps:
            cmd.append(f"--max_local_steps={run.max_local_steps}")
        if run.max_virtual_seconds:
            cmd.append(f"--max_virtual_seconds={grid._fmt(run.max_virtual_seconds)}")
        if run.trainer == "torch":
            cmd += [f"--corpus_dir={self.corpus_dir}", "--torch_threads=1"]
        if self.link:
            rate, rtt = self.link
            cmd.append(f"--links={grid._fmt(rate)}:{grid._fmt(rtt / 2)}")
        return cmd

    def prepare(self, run, run_dir):
        os.makedirs(run_dir, exist_ok=True)
        _write(os.path.join(run_dir, "config.textproto"), run.config_text)
        write_trace(run, run_dir)
        return self.command(run, run_dir)

    def run(self, run, run_dir, reuse=False):
        """Runs `run` into `run_dir`; returns {wall_seconds, stop_reason, reused}. Raises
        RuntimeError with the log's tail when aloe-sim fails."""
        cmd = self.prepare(run, run_dir)
        stamp_path = os.path.join(run_dir, "run.json")
        # Relative to the run directory, so that a copied run directory is reused too.
        stamp = {"command": [c.replace(run_dir, "RUN_DIR") for c in cmd],
                 "config": run.config_text}
        if reuse and os.path.exists(os.path.join(run_dir, "sim.csv")):
            try:
                with open(stamp_path) as f:
                    old = json.load(f)
                if old.get("command") == stamp["command"] and old.get("config") == run.config_text:
                    return {"wall_seconds": old.get("wall_seconds", 0.0),
                            "stop_reason": old.get("stop_reason", ""), "reused": True}
            except (OSError, ValueError):
                pass
        start = time.monotonic()
        with open(os.path.join(run_dir, "log.txt"), "w") as log:
            log.write(" ".join(cmd) + "\n")
            log.flush()
            proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=log, env=blas_env(),
                                  text=True)
            log.write(proc.stdout)
        wall = time.monotonic() - start
        if proc.returncode != 0:
            raise RuntimeError(f"aloe-sim failed (rc {proc.returncode}) for {run.run_id}:\n"
                               + _tail(os.path.join(run_dir, "log.txt")))
        m = re.search(r"stop=(\S+)", proc.stdout)
        info = {"wall_seconds": wall, "stop_reason": m.group(1) if m else "", "reused": False}
        _write(stamp_path, json.dumps(dict(stamp, **info), indent=1))
        return info


def _tail(path, lines=15):
    try:
        with open(path, errors="replace") as f:
            return "".join(f.readlines()[-lines:])
    except OSError:
        return ""


_LOG_TIME = re.compile(r"^[IWE] (\d\d):(\d\d):(\d\d\.\d+) ")
_ROUND = re.compile(r"round \d+: version (\d+) shard (\S+) steps (\d+) .*?(?: -> version (\d+))?$")
_EVAL = re.compile(r"eval version (\d+): loss ([0-9.eE+-]+)")


def _log_seconds(line):
    m = _LOG_TIME.match(line)
    if not m:
        return None
    return int(m.group(1)) * 3600 + int(m.group(2)) * 60 + float(m.group(3))


def _since(t, t0):
    d = t - t0
    if d < -43200:  # the UTC day changed during the run
        d += 86400
    return d


class LoopbackBackend:
    """Real processes on loopback. One run at a time (they need every core)."""
    name = "loopback"

    def __init__(self, bin_dir, corpus_dir, real_seconds, link=None):
        self.bin_dir = bin_dir
        self.corpus_dir = corpus_dir
        self.real_seconds = real_seconds  # family -> seconds
        # (rate Mbit/s, round trip ms): each trainer reaches the server through an aloe-linkemu
        # of its own with this link; None = straight over loopback.
        self.link = link
        for b in ("aloe-server", "aloe-worker") + (("aloe-linkemu",) if link else ()):
            if not os.access(os.path.join(bin_dir, b), os.X_OK):
                raise FileNotFoundError(f"{os.path.join(bin_dir, b)} not found: build it first")
        self._step_seconds = {}

    def supports(self, run):
        if run.trainer != "torch":
            return "the loopback back end always trains the real model (use --trainer torch)"
        return None

    def _config(self, run, max_seconds, budget_seconds):
        overrides = {"listen_address": ': "127.0.0.1:0"', "metrics_address": ': "off"',
                     "corpus_dir": f': "{self.corpus_dir}"', "max_seconds": f": {max_seconds}",
                     "eval_every": f": {max(1, run.eval_every)}", "lease_seconds": ": 30"}
        if budget_seconds is not None:
            overrides["local_work"] = ("{ mode: LOCAL_WORK_TIME_BUDGET time_budget_seconds: "
                                       f"{budget_seconds:.3f} }}")
        return textproto.merge(run.config_text, overrides)

    def step_seconds(self, run, work_dir):
        """Wall seconds per local step of an unslowed worker while `run.workers` trainers share
        this machine (measured once per worker count: a short sync job at slowdown 1)."""
        key = (run.workers, run.local_steps)
        if key in self._step_seconds:
            return self._step_seconds[key]
        cal = grid.Run(run.family, f"calibrate-k{run.workers}", "sync", run.seed, "torch",
                       run.workers, run.local_steps,
                       textproto.merge(run.config_text, {
                           "aggregation": f"{{ mode: AGGREGATION_SYNC min_workers: "
                                          f"{run.workers} }}",
                           "local_work": None, "penalty": None}),
                       speeds=[1.0] * run.workers, eval_every=1000)
        cal_dir = os.path.join(work_dir, cal.run_id)
        self._launch(cal, cal_dir, max_seconds=None, max_versions=3, budget_seconds=None)
        per_step = []
        for w in range(run.workers):
            for line in _read_lines(os.path.join(cal_dir, f"worker{w}.log")):
                m = re.search(r"steps (\d+) .*\(compute ([0-9.]+)s", line)
                if m and int(m.group(1)) > 0:
                    per_step.append(float(m.group(2)) / int(m.group(1)))
        if not per_step:
            raise RuntimeError(f"calibration run in {cal_dir} logged no rounds")
        per_step.sort()
        self._step_seconds[key] = per_step[len(per_step) // 2]
        return self._step_seconds[key]

    def run(self, run, run_dir, reuse=False):
        os.makedirs(run_dir, exist_ok=True)
        budget = None
        if grid.POLICIES[run.policy].time_budget:
            # A-EDiT budget = H steps of the fastest worker, in this machine's wall seconds.
            budget = run.local_steps * self.step_seconds(run, os.path.dirname(run_dir)) / (
                run.fastest_speed())
        start = time.monotonic()
        seconds = self.real_seconds.get(run.family, 60)
        rows, stop = self._launch(run, run_dir, max_seconds=seconds, max_versions=None,
                                  budget_seconds=budget)
        with open(os.path.join(run_dir, "sim.csv"), "w") as f:
            f.write(CSV_HEADER + "\n")
            for r in rows:
                f.write(",".join(r) + "\n")
        return {"wall_seconds": time.monotonic() - start, "stop_reason": stop, "reused": False,
                "real_seconds": seconds}

    def _launch(self, run, run_dir, max_seconds, max_versions, budget_seconds):
        """Starts server, evaluator and trainers; returns (rows, stop_reason)."""
        os.makedirs(run_dir, exist_ok=True)
        cfg = self._config(run, max_seconds or 0, budget_seconds)
        if max_versions:
            cfg = textproto.merge(cfg, {"max_versions": f": {max_versions}",
                                        "max_seconds": None})
        cfg_path = os.path.join(run_dir, "config.textproto")
        _write(cfg_path, cfg)
        ports = os.path.join(run_dir, "ports")
        if os.path.exists(ports):
            os.remove(ports)
        env = blas_env()
        procs = []

        def spawn(args, log_name):
            log = open(os.path.join(run_dir, log_name), "w")
            p = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=env)
            log.close()
            procs.append(p)
            return p

        # Phases scale with the run: virtual phase seconds -> real seconds.
        scale = 1.0
        if run.events and max_seconds and run.max_virtual_seconds:
            scale = max_seconds / run.max_virtual_seconds
        try:
            server = spawn([os.path.join(self.bin_dir, "aloe-server"), f"--config={cfg_path}",
                            f"--port_file={ports}",
                            f"--summary_file={os.path.join(run_dir, 'summary')}",
                            "--drain_seconds=5"], "server.log")
            port = None
            for _ in range(600):
                if os.path.exists(ports) and os.path.getsize(ports) > 0:
                    m = re.search(r"grpc=(\d+)", open(ports).read())
                    if m:
                        port = m.group(1)
                        break
                if server.poll() is not None:
                    break
                time.sleep(0.1)
            if port is None:
                raise RuntimeError("aloe-server did not start:\n"
                                   + _tail(os.path.join(run_dir, "server.log")))
            worker = [os.path.join(self.bin_dir, "aloe-worker"), f"--corpus_dir={self.corpus_dir}",
                      "--metrics=off"]
            evaluator = spawn(worker + [f"--server=127.0.0.1:{port}", "--role=evaluator",
                                        "--name=evaluator",
                                        "--eval_sequences=64"], "evaluator.log")
            for _ in range(1200):
                if "joined as worker" in "".join(_read_lines(
                        os.path.join(run_dir, "evaluator.log"))):
                    break
                if evaluator.poll() is not None:
                    raise RuntimeError("the evaluator exited:\n"
                                       + _tail(os.path.join(run_dir, "evaluator.log")))
                time.sleep(0.1)
            trace = write_trace(run, run_dir)
            trainers = {}
            links = []

            def start_trainer(i):
                if trace is not None:
                    pace = [f"--step_trace={trace}", f"--trace_worker={i}"]
                else:
                    pace = [f"--slowdown={run.fastest_speed() / run.speeds[i]:.6f}"]
                via = self._link_for(i, port, run_dir, spawn, links)
                trainers[i] = spawn(worker + [f"--name=w{i}", f"--server=127.0.0.1:{via}"] + pace,
                                    f"worker{i}.log")

            t0_wall = time.time()
            t0 = t0_wall % 86400
            initially_absent = {w for k, t, w in sorted(run.events, key=lambda e: e[1])
                                if k == "join" and not any(
                                    e[2] == w and e[1] < t for e in run.events)}
            for i in range(run.workers):
                if i not in initially_absent:
                    start_trainer(i)
            pending = sorted(((t * scale, k, w) for k, t, w in run.events), key=lambda e: e[0])
            deadline = time.monotonic() + (max_seconds or 600) + 180
            while server.poll() is None:
                now = time.time() - t0_wall
                while pending and pending[0][0] <= now:
                    _, kind, w = pending.pop(0)
                    if kind == "join":
                        start_trainer(w)
                    elif w in trainers and trainers[w].poll() is None:
                        trainers[w].send_signal(signal.SIGTERM if kind == "leave"
                                                else signal.SIGKILL)
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{run.run_id}: the server did not finish in time")
                time.sleep(0.05)
            # The links outlive nothing: they go once the daemons they carry have ended.
            _reap([p for p in procs if p not in links], timeout=30)
            for p in links:
                p.terminate()
            _reap(links, timeout=10)
        finally:
            for p in procs:
                if p.poll() is None:
                    p.terminate()
            _reap(procs, timeout=10)
        return self._rows(run, run_dir, t0), ("max_versions" if max_versions else "max_seconds")

    def _link_for(self, i, port, run_dir, spawn, links):
        """The port trainer i dials: the server's, or that of an aloe-linkemu of its own."""
        if not self.link:
            return port
        port_file = os.path.join(run_dir, f"link{i}.port")
        if os.path.exists(port_file):
            os.remove(port_file)
        rate, rtt = self.link
        cmd = [os.path.join(self.bin_dir, "aloe-linkemu"), "--listen=127.0.0.1:0",
               f"--upstream=127.0.0.1:{port}", f"--rate_mbit={rate}", f"--delay_ms={rtt / 2}",
               f"--port_file={port_file}"]
        links.append(spawn(cmd, f"link{i}.log"))
        for _ in range(300):
            if os.path.exists(port_file):
                m = re.search(r"route0=(\d+)", open(port_file).read())
                if m:
                    return m.group(1)
            time.sleep(0.1)
        raise RuntimeError(f"aloe-linkemu for trainer {i} did not start:\n"
                           + _tail(os.path.join(run_dir, f"link{i}.log")))

    def _rows(self, run, run_dir, t0):
        rows = []  # (time, sort key, fields)
        for w in range(run.workers):
            for line in _read_lines(os.path.join(run_dir, f"worker{w}.log")):
                m = _ROUND.search(line)
                t = _log_seconds(line)
                if not m or t is None:
                    continue
                base, shard, steps = int(m.group(1)), m.group(2), int(m.group(3))
                if m.group(4) is not None:
                    version = int(m.group(4))
                    outcome = "applied"
                    staleness = max(0, version - 1 - base)
                else:
                    version, outcome, staleness = base, "accepted", 0
                rows.append((_since(t, t0), 0, [f"{_since(t, t0):.6f}", str(version), str(w),
                                                str(staleness), shard, str(steps), "", outcome]))
        evals = {}
        for line in _read_lines(os.path.join(run_dir, "server.log")):
            m = _EVAL.search(line)
            t = _log_seconds(line)
            if m and t is not None:
                evals[int(m.group(1))] = (max(0.0, _since(t, t0)), float(m.group(2)))
        # Attach each evaluation to the push row that produced its version, else an eval row.
        by_version = {}
        for r in rows:
            if r[2][7] == "applied":
                by_version[int(r[2][1])] = r
        for v, (t, loss) in sorted(evals.items()):
            if v in by_version:
                by_version[v][2][6] = f"{loss:.6f}"
            else:
                rows.append((t if v else 0.0, -1 if v == 0 else 1,
                             [f"{(t if v else 0.0):.6f}", str(v), "", "", "", "",
                              f"{loss:.6f}", "eval"]))
        rows.sort(key=lambda r: (r[0], r[1]))
        return [r[2] for r in rows]


def _read_lines(path):
    try:
        with open(path, errors="replace") as f:
            return f.readlines()
    except OSError:
        return []
