"""One soak run: start the job's processes on loopback, play a fault schedule against them,
watch the coordinator's version, stop everything gracefully and collect what the checks need."""

import os
import shutil
import signal
import subprocess
import time

from . import cluster
from . import schedule as S

TRAINER_TOKEN = "soak-trainer-token"
SHARD_TOKEN = "soak-shard-token"

CONFIG = """listen_address: "127.0.0.1:{port}"
metrics_address: "127.0.0.1:0"
corpus_dir: "{corpus}"
seed: {seed}
model {{ vocab_size: 256 seq_len: 32 d_model: 32 num_layers: 2 num_heads: 2 ffn_mult: 2 }}
inner_optimizer {{ lr: 0.002 min_lr: 0.0002 warmup_steps: 5 total_steps: 100000 batch_size: 4
  weight_decay: 0.1 grad_clip: 1.0 }}
outer_optimizer {{ type: OUTER_DELAYED_NESTEROV lr: 0.4 momentum: 0.9 dn_buffer_size: {trainers} }}
aggregation {{ mode: AGGREGATION_ASYNC min_workers: 1 grace_seconds: 0 }}
local_steps: {local_steps}
lease_seconds: {lease}
eval_every: {eval_every}
shard_processes: {shards}
max_staged_updates: 8
checkpoint {{ dir: "{ckpt}" every_versions: {ckpt_every} keep: 3 }}
security {{ token_file: "{tokens}" }}
"""


class RunOptions:
    def __init__(self, **kw):
        self.scenario = kw.get("scenario", "sharded")
        self.seed = kw.get("seed", 1)
        self.trainers = kw.get("trainers", 3)
        self.seconds = kw.get("seconds", 60.0)         # trainers' run time
        self.quiet_tail = kw.get("quiet_tail", 0.25)    # fraction without faults at the end
        self.warmup = kw.get("warmup", 8.0)             # seconds before the first fault
        self.lease = kw.get("lease", 3.0)
        self.local_steps = kw.get("local_steps", 8)
        self.eval_every = kw.get("eval_every", 10)
        self.ckpt_every = kw.get("ckpt_every", 4)
        self.counts = kw.get("counts", {})              # fault kind -> count; {} = no faults
        self.server_gap = kw.get("server_gap", 7.0)
        self.tmpfs_mib = kw.get("tmpfs_mib", 24)


class Run:
    def __init__(self, bin_dir, corpus_dir, run_dir, opts, wrong_model=None, log=print):
        self.bin = bin_dir
        self.corpus = corpus_dir
        self.dir = run_dir
        self.o = opts
        self.wrong_model = wrong_model
        self.log = log
        self.env = cluster.blas_env()
        self.procs = {}
        self.versions = []      # (t, version) scrapes of the coordinator / server
        self.retries = []       # (t, sum over trainers of aloe_worker_retries_total)
        self.events = []        # (t, text) of what the soak did
        self.fault_log = []     # dicts: kind, time, target, hold, detail
        self.refusals = []      # join-refusal probes: dict(kind, code, refused, joined, text)
        self.mounted = False
        self.t0 = None
        self.metrics_port = None
        self.sharded = opts.scenario == "sharded"
        self.journal = os.path.join(run_dir, "journal") if self.sharded else None
        self.record = False  # shard processes record every committed update (the replay)

    # ---- setup

    def t(self):
        return time.monotonic() - self.t0 if self.t0 is not None else 0.0

    def note(self, text):
        self.events.append((self.t(), text))
        self.log(f"  [{self.t():7.2f}s] {text}")

    def _write(self, name, text):
        path = os.path.join(self.dir, name)
        with open(path, "w") as f:
            f.write(text)
        return path

    def prepare(self):
        if os.path.exists(self.dir):
            shutil.rmtree(self.dir)
        os.makedirs(self.dir)
        self.ckpt = os.path.join(self.dir, "ckpt")
        os.makedirs(self.ckpt)
        # A small tmpfs of its own, so that "the disk is full" is a real ENOSPC (needs root;
        # without it the disk_full fault is skipped).
        if self.o.counts.get(S.DISK_FULL, 0) and os.geteuid() == 0:
            r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={self.o.tmpfs_mib}m",
                                "soak-ckpt", self.ckpt], stderr=subprocess.PIPE, text=True)
            self.mounted = r.returncode == 0
            if not self.mounted:
                self.log(f"  (no tmpfs for the checkpoints: {r.stderr.strip()})")
        self.tokens = self._write("tokens", f"trainers {TRAINER_TOKEN}\nshards {SHARD_TOKEN}\n")
        self.worker_token = self._write("worker.token", TRAINER_TOKEN + "\n")
        self.shard_token = self._write("shard.token", SHARD_TOKEN + "\n")
        self.bad_token = self._write("bad.token", "not-a-token-of-this-job\n")
        self.port = cluster.free_port()
        self.shard_ports = [cluster.free_port() for _ in range(2 if self.sharded else 0)]
        self.link_port = cluster.free_port()
        self.config = self._write("server.textproto", CONFIG.format(
            port=self.port, corpus=self.corpus, seed=self.o.seed, trainers=self.o.trainers,
            local_steps=self.o.local_steps, lease=self.o.lease, eval_every=self.o.eval_every,
            shards=2 if self.sharded else 0, ckpt=self.ckpt, ckpt_every=self.o.ckpt_every,
            tokens=self.tokens))

    def _proc(self, name, args):
        p = cluster.Proc(name, args, os.path.join(self.dir, f"{name}.log"), self.env)
        self.procs[name] = p
        return p

    def _server_args(self):
        b = os.path.join(self.bin, "aloe-server")
        common = [b, f"--config={self.config}", "--drain_seconds=5"]
        if not self.sharded:
            return {"server": common + [f"--port_file={self.dir}/server.ports",
                                        f"--summary_file={self.dir}/summary"]}
        out = {"coordinator": common + ["--role=coordinator", f"--order_journal={self.journal}",
                                        f"--port_file={self.dir}/server.ports",
                                        f"--summary_file={self.dir}/summary"]}
        for i, port in enumerate(self.shard_ports):
            # Shard 0 is told to workers at the link emulator's port: their traffic to it
            # crosses the link (cuts and stalls).
            advertise = f"127.0.0.1:{self.link_port}" if i == 0 else f"127.0.0.1:{port}"
            out[f"shard{i}"] = [b, f"--config={self.config}", "--role=shard",
                                f"--shard_index={i}", f"--listen=127.0.0.1:{port}",
                                f"--advertise={advertise}", f"--coordinator=127.0.0.1:{self.port}",
                                f"--token_file={self.shard_token}",
                                f"--port_file={self.dir}/shard{i}.ports"]
            if self.record:
                out[f"shard{i}"].append(f"--record_commits={self.dir}/records-shard{i}")
        return out

    def head(self):
        return self.procs["coordinator" if self.sharded else "server"]

    def _start_head(self, resume):
        p = self.head()
        ports = os.path.join(self.dir, "server.ports")
        if os.path.exists(ports):
            os.remove(ports)
        p.start(["--resume"] if resume else [])
        got = cluster.wait_port_file(ports, p, 60)
        if got is None:
            raise RuntimeError(f"{p.name} did not start:\n{p.log_text()[-3000:]}")
        self.metrics_port = got[1]

    def _worker_args(self, name, role="trainer", via_link=False, token=None, extra=()):
        port = self.link_port if via_link else self.port
        return [os.path.join(self.bin, "aloe-worker"), f"--server=127.0.0.1:{port}",
                f"--corpus_dir={self.corpus}", f"--name={name}", f"--role={role}",
                "--metrics=127.0.0.1:0" if role == "trainer" and token is None and not extra
                else "--metrics=off", "--connect_timeout=60", "--raw_push=false",
                f"--token_file={token or self.worker_token}"] + list(extra)

    def start(self):
        for name, args in self._server_args().items():
            self._proc(name, args)
        self._start_head(resume=False)
        for i in range(len(self.shard_ports)):
            self.procs[f"shard{i}"].start()
        upstream = self.shard_ports[0] if self.sharded else self.port
        self._proc("link", [os.path.join(self.bin, "aloe-linkemu"),
                            f"--listen=127.0.0.1:{self.link_port}",
                            f"--upstream=127.0.0.1:{upstream}"]).start()
        self._proc("evaluator", self._worker_args("evaluator", role="evaluator",
                                                  extra=["--eval_sequences=64"])).start()
        for i in range(self.o.trainers):
            # Single scenario: the trainers reach the server through the link emulator.
            self._proc(f"worker{i}", self._worker_args(
                f"w{i}", via_link=not self.sharded)).start()
        # The run's clock starts at the first outer step: starting LibTorch takes seconds on a
        # loaded host, and the warm-up before the first fault is meant as training time.
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            m = cluster.scrape(self.metrics_port, ("aloe_model_version",))
            if m.get("aloe_model_version", 0) >= 1:
                break
            if not all(self.procs[f"worker{i}"].alive() for i in range(self.o.trainers)):
                raise RuntimeError("a trainer exited before the first outer step:\n" +
                                   self.procs["worker0"].log_text()[-3000:])
            time.sleep(0.05)
        else:
            raise RuntimeError("no outer step within 120 s of starting the trainers")
        self.t0 = time.monotonic()
        self.wall0 = time.time()
        self.note(f"{self.o.scenario}: {self.o.trainers} trainers at their first outer step")

    # ---- the schedule

    def _alive_trainer(self, index):
        n = self.o.trainers
        for k in range(n):
            p = self.procs[f"worker{(index + k) % n}"]
            if p.alive() and not p.frozen:
                return p
        return None

    def _damage_newest(self, directory, variant):
        try:
            files = sorted((f for f in os.listdir(directory) if f.endswith(".aloeckpt")),
                           key=lambda f: int(f.split("-")[1].split(".")[0]))
        except (OSError, ValueError, IndexError):
            files = []
        if not files:
            return "no checkpoint to damage"
        path = os.path.join(directory, files[-1])
        size = os.path.getsize(path)
        if variant == "truncate":
            os.truncate(path, size // 2)
        else:
            with open(path, "r+b") as f:
                f.seek(max(0, size // 2))
                b = f.read(1)
                f.seek(max(0, size // 2))
                f.write(bytes([(b[0] if b else 0) ^ 0xFF]))
        return f"{variant} {files[-1]} ({size} bytes)"

    def _restart_server_process(self, name):
        if name in ("coordinator", "server"):
            self._start_head(resume=True)
        else:
            self.procs[name].start(["--resume"])

    def play(self, faults):
        """Runs the trainers for opts.seconds while playing `faults`; then stops everything."""
        pending = [(f.time, 0, f) for f in faults]
        follow = []  # (time, seq, callable)
        seq = 0
        end = self.o.seconds
        next_sample = 0.0
        while True:
            now = self.t()
            if now >= end and not follow:
                break
            while pending and pending[0][0] <= now and now < end:
                _, _, f = pending.pop(0)
                for when, action in self._begin(f) or ():
                    seq += 1
                    follow.append((now + when, seq, action))
            follow.sort(key=lambda x: (x[0], x[1]))
            while follow and follow[0][0] <= self.t():
                _, _, action = follow.pop(0)
                action()
            if now >= next_sample:
                self._sample()
                next_sample = now + 0.25
            time.sleep(0.02)

    def _record(self, f, detail):
        entry = {"kind": f.kind, "time": self.t(), "target": f.target, "hold": f.hold,
                 "detail": detail, "skipped": detail.startswith("skipped")}
        if self.journal and os.path.exists(self.journal):
            entry["journal_offset"] = os.path.getsize(self.journal)
        self.fault_log.append(entry)
        self.note(f"{f.kind} {detail}")
        return entry

    def _begin(self, f):
        """Starts fault f; returns [(delay, action)] of what ends it."""
        k = f.kind
        if k in (S.WORKER_KILL, S.WORKER_FREEZE):
            p = self._alive_trainer(f.target)
            if p is None:
                self._record(f, "skipped: no trainer up")
                return []
            if k == S.WORKER_KILL:
                p.kill()
                self._record(f, f"{p.name} (restart in {f.hold:.2f} s)")
                return [(f.hold, lambda: (p.start(), self.note(f"{p.name} restarted")))]
            p.signal(signal.SIGSTOP)
            p.frozen = True
            self._record(f, f"{p.name} for {f.hold:.2f} s (lease {self.o.lease} s)")

            def thaw():
                if p.alive():
                    p.signal(signal.SIGCONT)
                p.frozen = False
                self.note(f"{p.name} thawed")
            return [(f.hold, thaw)]
        if k == S.LINK_CUT:
            self.procs["link"].signal(signal.SIGUSR1)
            self._record(f, "every connection through the link reset")
            return []
        if k == S.LINK_STALL:
            self.procs["link"].signal(signal.SIGUSR2)
            self._record(f, f"link stalled for {f.hold:.2f} s")
            return [(f.hold, lambda: (self.procs["link"].signal(signal.SIGUSR2),
                                      self.note("link resumed")))]
        if k in (S.SHARD_KILL, S.COORDINATOR_KILL, S.SERVER_KILL, S.CORRUPT_CHECKPOINT):
            if k == S.SHARD_KILL or (k == S.CORRUPT_CHECKPOINT and self.sharded):
                name = f"shard{f.target}"
                directory = os.path.join(self.ckpt, f"shard-{f.target}")
            else:
                name = self.head().name
                directory = self.ckpt
            self.procs[name].kill()
            detail = f"{name} (restart in {f.hold:.2f} s)"
            if k == S.CORRUPT_CHECKPOINT:
                detail += ": " + self._damage_newest(directory, f.variant)
            self._record(f, detail)
            return [(f.hold, lambda: (self._restart_server_process(name),
                                      self.note(f"{name} restarted with --resume")))]
        if k == S.DRAIN:
            p = self.head()
            p.signal(signal.SIGTERM)
            self._record(f, f"SIGTERM {p.name}")

            def after_drain():
                code = p.wait(30)
                if code is None:
                    self.note(f"{p.name} did not drain in 30 s: killed")
                    p.kill()
                else:
                    self.note(f"{p.name} drained, exit {code}")
                self._restart_server_process(p.name)
                self.note(f"{p.name} restarted with --resume")
            return [(f.hold, after_drain)]
        if k == S.DISK_FULL:
            if not self.mounted:
                self._record(f, "skipped: no tmpfs for the checkpoint directory (needs root)")
                return []
            filler = os.path.join(self.ckpt, "filler")
            written = 0
            try:
                with open(filler, "wb") as out:
                    block = b"\0" * (1 << 20)
                    while True:
                        out.write(block)
                        out.flush()
                        written += len(block)
            except OSError:
                pass
            self._record(f, f"checkpoint directory full ({written >> 20} MiB of filler) for "
                            f"{f.hold:.2f} s")

            def free():
                try:
                    os.remove(filler)
                except OSError:
                    pass
                self.note("checkpoint directory freed")
            return [(f.hold, free)]
        if k in (S.BAD_TOKEN, S.WRONG_MODEL):
            return self._probe(f)
        raise ValueError(k)

    def _probe(self, f):
        """A worker that must be refused: a bad token, or another model's fingerprint."""
        n = sum(1 for x in self.procs if x.startswith(f.kind))
        name = f"{f.kind}{n}"
        if f.kind == S.BAD_TOKEN:
            args = self._worker_args(name, token=self.bad_token, extra=["--connect_timeout=5"])
        else:
            if not self.wrong_model:
                self._record(f, "skipped: no TorchScript model (python3-torch) to join with")
                return []
            args = self._worker_args(name, extra=["--connect_timeout=5",
                                                  f"--torchscript={self.wrong_model}"])
        p = self._proc(name, args).start()
        entry = self._record(f, f"{name} tries to join")

        def check():
            code = p.wait(0.01)
            if code is None:
                # Still running: it was let in, or hangs. Either is a failure; stop it.
                p.kill()
                code = "hung"
            text = p.log_text()
            joined = "joined as worker" in text
            self.refusals.append({"kind": f.kind, "name": name, "code": code, "joined": joined,
                                  "text": text.strip().splitlines()[-1] if text.strip() else ""})
            entry["detail"] += f": exit {code}, {'JOINED' if joined else 'refused'}"
            self.note(f"{name}: exit {code}, {'joined' if joined else 'refused'}")
        return [(12.0, check)]

    def _sample(self):
        if self.metrics_port:
            m = cluster.scrape(self.metrics_port, ("aloe_model_version",))
            if "aloe_model_version" in m:
                self.versions.append((self.t(), int(m["aloe_model_version"])))
        for p in self.procs.values():
            p.sample_rss()
        total = 0.0
        for i in range(self.o.trainers):
            p = self.procs[f"worker{i}"]
            port = p.metrics_port()
            if port and p.alive() and not p.frozen:
                got = cluster.scrape(port, ("aloe_worker_retries_total",), 0.2)
                if "aloe_worker_retries_total" in got:
                    p.last_retries = got["aloe_worker_retries_total"]
            total += p.retries_before + p.last_retries
        self.retries.append((self.t(), total))

    # ---- the end

    def stop(self):
        """Graceful end: SIGTERM the trainers (they push what they did and leave), the evaluator,
        then the coordinator or server (the shard processes end when it finishes). Returns
        {name: exit code or None (stuck, killed)} of the processes that were up."""
        self.t_stop = self.t()
        results = {}
        trainers = [p for n, p in self.procs.items() if n.startswith("worker")]
        for p in trainers:
            if p.frozen:
                p.signal(signal.SIGCONT)
                p.frozen = False
        for group, timeout in ((trainers, 30), ([self.procs["evaluator"]], 30)):
            up = [p for p in group if p.alive()]
            for p in up:
                p.signal(signal.SIGTERM)
            deadline = time.monotonic() + timeout
            for p in up:
                results[p.name] = p.wait(max(0.1, deadline - time.monotonic()))
        self._sample()
        # A drained coordinator may be restarted, so it does not end the shard processes:
        # they are stopped after it, as an operator would (each writes a final checkpoint).
        head = self.head()
        if head.alive():
            head.signal(signal.SIGTERM)
            results[head.name] = head.wait(40)
        self.final_head_version = self.versions[-1][1] if self.versions else 0
        shards = [p for n, p in self.procs.items() if n.startswith("shard") and p.alive()]
        for p in shards:
            p.signal(signal.SIGTERM)
        deadline = time.monotonic() + 30
        for p in shards:
            results[p.name] = p.wait(max(0.1, deadline - time.monotonic()))
        link = self.procs["link"]
        if link.alive():
            link.signal(signal.SIGTERM)
            results["link"] = link.wait(10)
        for name, p in self.procs.items():
            if p.alive():
                results[name] = None
                p.kill()
        self.t_end = self.t()
        if self.mounted:
            # Keep what the checks read: copy the checkpoints out of the tmpfs, then unmount.
            keep = os.path.join(self.dir, "ckpt-copy")
            shutil.copytree(self.ckpt, keep, ignore=shutil.ignore_patterns("filler"))
            subprocess.run(["umount", self.ckpt])
            self.mounted = False
            os.rmdir(self.ckpt)
            os.rename(keep, self.ckpt)
        return results

    def cleanup(self):
        for p in self.procs.values():
            if p.alive():
                p.kill()
        if self.mounted:
            subprocess.run(["umount", "-l", self.ckpt])
            self.mounted = False
