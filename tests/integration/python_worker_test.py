#!/usr/bin/python3
"""A Python worker (worker/python/examples/train.py, the aloe package) and a C++ aloe-worker
train the same model together through real servers, with an aloe-worker evaluator:

- single: one aloe-server, sync rounds of both trainers, int8 pushes with error feedback. Both
  trainers push every round, with the same bytes per push; the held-out loss falls; and the
  Python TransformerLM, loaded with the version 0 the Python client pulled, gives the held-out
  loss the C++ evaluator reported for version 0 (the same function).
- restart: the server is SIGKILLed mid-job and restarted with --resume; the Python worker
  retries, joins again and finishes the job; one with a wrong token exits 1 naming the refusal.
- sharded: a coordinator and two shard processes, async Delayed Nesterov; the Python worker
  pulls from and pushes to both shard processes in bf16 (its own codec choice), and the
  held-out loss falls from version 0's (evaluated in Python: the evaluator may join later).

Usage: python_worker_test.py [--bin-dir build/bin] [unittest args]
"""

import atexit
import glob
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import unittest

import numpy as np
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BIN_DIR = os.path.join(ROOT, "build", "bin")
PYTHON_DIR = os.path.join(ROOT, "worker", "python")
sys.path.insert(0, PYTHON_DIR)
sys.path.insert(0, os.path.join(ROOT, "tests", "testing"))
CACHE = tempfile.mkdtemp(prefix="aloe-pyproto-")
atexit.register(shutil.rmtree, CACHE, True)
os.environ.setdefault("ALOE_CACHE_DIR", CACHE)

import aloe  # noqa: E402
import unittest_main  # noqa: E402

COMMON = """
metrics_address: "127.0.0.1:0"
corpus_dir: "{corpus}"
seed: 3
model {{ vocab_size: 256 seq_len: 32 d_model: 32 num_layers: 2 num_heads: 2 }}
inner_optimizer {{ lr: 0.003 min_lr: 0.0003 warmup_steps: 5 total_steps: 100000 batch_size: 4 }}
local_steps: 10
eval_every: 1
lease_seconds: 20
"""
SINGLE = COMMON + """
listen_address: "127.0.0.1:0"
outer_optimizer {{ type: OUTER_NESTEROV lr: 0.7 momentum: 0.9 }}
aggregation {{ mode: AGGREGATION_SYNC min_workers: 2 }}
transport {{ codec: CODEC_INT8_BLOCKWISE error_feedback: true int8_block_size: 128 }}
max_versions: 12
"""
SHARDED = COMMON + """
listen_address: "127.0.0.1:{port}"
outer_optimizer {{ type: OUTER_DELAYED_NESTEROV lr: 0.5 momentum: 0.9 dn_buffer_size: 2 }}
aggregation {{ mode: AGGREGATION_ASYNC min_workers: 1 }}
shard_processes: 2
max_versions: 16
"""
RESTART = COMMON + """
listen_address: "127.0.0.1:{port}"
outer_optimizer {{ type: OUTER_NESTEROV lr: 0.7 momentum: 0.9 }}
aggregation {{ mode: AGGREGATION_ASYNC min_workers: 1 }}
checkpoint {{ dir: "{checkpoints}" every_versions: 2 keep: 2 }}
security {{ token_file: "{tokens}" }}
max_versions: 40
"""
TOKEN = "python-worker-token"
EVAL_SEQUENCES = 16


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Cluster:
    def __init__(self, tmp, name):
        self.dir = os.path.join(tmp, name)
        os.makedirs(self.dir)
        self.procs = {}
        self.env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=PYTHON_DIR)

    def start(self, name, argv):
        log = open(os.path.join(self.dir, name + ".log"), "w")
        self.procs[name] = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT,
                                            env=self.env)
        log.close()

    def log(self, name):
        with open(os.path.join(self.dir, name + ".log")) as f:
            return f.read()

    def wait_for_log(self, name, text, timeout):
        """Waits until `name`'s log holds `text`."""
        deadline = time.time() + timeout
        while text not in self.log(name):
            if self.procs[name].poll() is not None or time.time() > deadline:
                raise AssertionError("%s never logged %r\n%s" % (name, text, self.logs()))
            time.sleep(0.05)

    def logs(self):
        return "".join("--- %s:\n%s\n" % (n, self.log(n)[-3000:]) for n in self.procs)

    def wait(self, names, timeout):
        deadline = time.time() + timeout
        for name in names:
            try:
                rc = self.procs[name].wait(max(1, deadline - time.time()))
            except subprocess.TimeoutExpired:
                raise AssertionError("%s still running after %d s\n%s" %
                                     (name, timeout, self.logs())) from None
            if rc != 0:
                raise AssertionError("%s exited %d\n%s" % (name, rc, self.logs()))

    def stop(self):
        for p in self.procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGKILL)
                p.wait()

    def ports(self, name):
        path = os.path.join(self.dir, name + ".ports")
        for _ in range(300):
            if os.path.exists(path) and os.path.getsize(path) > 0:
                with open(path) as f:
                    return dict(kv.split("=") for kv in f.read().split())
            if self.procs[name].poll() is not None:
                break
            time.sleep(0.1)
        raise AssertionError("%s wrote no ports\n%s" % (name, self.logs()))


def eval_losses(server_log):
    return {int(v): float(l) for v, l in
            re.findall(r"eval version (\d+): loss ([0-9.]+)", server_log)}


class PythonWorkerTest(unittest.TestCase):
    tmp = None

    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.mkdtemp(prefix="aloe-python-worker-")
        text = os.path.join(cls.tmp, "text")
        os.makedirs(text)
        for doc in sorted(glob.glob(os.path.join(ROOT, "docs", "*.md")))[:6]:
            shutil.copy(doc, os.path.join(text, os.path.basename(doc)[:-3] + ".txt"))
        cls.corpus = os.path.join(cls.tmp, "corpus")
        subprocess.run([os.path.join(BIN_DIR, "aloe-corpus"), "--input_dir=" + text,
                        "--output_dir=" + cls.corpus], check=True, stdout=subprocess.DEVNULL)

    @classmethod
    def tearDownClass(cls):
        if not os.environ.get("ALOE_KEEP_TEST_DIR"):
            shutil.rmtree(cls.tmp, ignore_errors=True)

    def config(self, cluster, template, **kw):
        path = os.path.join(cluster.dir, "server.textproto")
        with open(path, "w") as f:
            f.write(template.format(corpus=self.corpus, **kw))
        return path

    def workers(self, cluster, address, python_args=()):
        cpp = [os.path.join(BIN_DIR, "aloe-worker"), "--server=" + address,
               "--corpus_dir=" + self.corpus, "--metrics=off", "--device=cpu"]
        cluster.start("evaluator", cpp + ["--role=evaluator", "--name=evaluator",
                                          "--eval_sequences=%d" % EVAL_SEQUENCES])
        # The trainers start once version 0 is evaluated: on a loaded host they can otherwise
        # make version 1 before the evaluator has joined, and version 0 is never evaluated.
        cluster.wait_for_log("evaluator", "eval version 0:", 120)
        cluster.start("cpp", cpp + ["--name=cpp"])
        cluster.start("python", [sys.executable,
                                 os.path.join(PYTHON_DIR, "examples", "train.py"),
                                 "--server=" + address, "--corpus_dir=" + self.corpus,
                                 "--name=python", *python_args])

    def heldout_loss_in_python(self, address, version):
        """Pulls `version` with the Python client and evaluates the held-out windows the C++
        evaluator evaluates with the Python TransformerLM."""
        with aloe.Worker(address, self.corpus, name="probe") as probe:
            layers = probe.client.pull(probe.worker_id, version, probe.spec)
            model = aloe.TransformerLM(probe.model_config)
            probe.set_parameters(model, layers)
            seq = probe.model_config.seq_len
            tokens = probe.corpus.tokens(probe.joined.heldout_file)
        windows = min(EVAL_SEQUENCES, tokens.shape[0] // (seq + 1))
        batch = torch.from_numpy(
            np.asarray(tokens[:windows * (seq + 1)]).astype(np.int64).reshape(windows, seq + 1))
        with torch.no_grad():
            return model.loss(batch).item()

    def test_single_server_sync_int8(self):
        cluster = Cluster(self.tmp, "single")
        self.addCleanup(cluster.stop)
        config = self.config(cluster, SINGLE)
        cluster.start("server", [os.path.join(BIN_DIR, "aloe-server"), "--config=" + config,
                                 "--port_file=" + os.path.join(cluster.dir, "server.ports")])
        address = "127.0.0.1:" + cluster.ports("server")["grpc"]
        # Version 0 through the Python client and model, before anyone trains.
        python_loss0 = self.heldout_loss_in_python(address, 0)
        self.workers(cluster, address)
        cluster.wait(["server", "cpp", "python", "evaluator"], 240)

        losses = eval_losses(cluster.log("server"))
        self.assertIn(0, losses, cluster.logs())
        self.assertAlmostEqual(python_loss0, losses[0], delta=2e-4)
        last = max(losses)
        self.assertEqual(last, 12)
        print("single: held-out loss %.4f -> %.4f (versions 0 -> %d); version 0 in Python %.5f"
              % (losses[0], losses[last], last, python_loss0))
        self.assertLess(losses[last], losses[0] - 1.0)

        # Sync rounds of two: both trainers pushed every one of the 12 rounds, with the same
        # int8 bytes per push.
        py = re.search(r"train\.py: (\d+) rounds, (\d+) tokens .* (\d+) bytes pushed",
                       cluster.log("python"))
        cpp = re.search(r"summary: rounds=(\d+) .*pushed_bytes=(\d+)", cluster.log("cpp"))
        self.assertIsNotNone(py, cluster.log("python"))
        self.assertIsNotNone(cpp, cluster.log("cpp"))
        self.assertEqual(int(py.group(1)), 12)
        self.assertEqual(int(cpp.group(1)), 12)
        self.assertEqual(int(py.group(3)), int(cpp.group(2)))
        self.assertRegex(cluster.log("server"), r"summary: version 12, 24 updates applied")

    def test_sharded_server_async_bf16(self):
        cluster = Cluster(self.tmp, "sharded")
        self.addCleanup(cluster.stop)
        port = free_port()
        config = self.config(cluster, SHARDED, port=port)
        server = os.path.join(BIN_DIR, "aloe-server")
        cluster.start("coordinator", [server, "--config=" + config, "--role=coordinator",
                                      "--port_file=" + os.path.join(cluster.dir,
                                                                    "coordinator.ports")])
        for i in range(2):
            cluster.start("shard%d" % i, [server, "--config=" + config, "--role=shard",
                                          "--shard_index=%d" % i,
                                          "--listen=127.0.0.1:%d" % free_port(),
                                          "--coordinator=127.0.0.1:%d" % port])
        address = "127.0.0.1:%d" % port
        cluster.ports("coordinator")
        loss0 = self.heldout_loss_in_python(address, 0)
        self.workers(cluster, address, ["--codec=bf16"])
        cluster.wait(["coordinator", "cpp", "python", "evaluator"], 240)
        cluster.wait(["shard0", "shard1"], 60)

        # The evaluator may join after version 0 (async): version 0's loss is the Python one.
        losses = eval_losses(cluster.log("coordinator"))
        self.assertTrue(losses, cluster.logs())
        last = max(losses)
        print("sharded: held-out loss %.4f -> %.4f (versions 0 -> %d)" %
              (loss0, losses[last], last))
        self.assertGreaterEqual(last, 16)
        self.assertLess(losses[last], loss0 - 1.0)
        py = re.search(r"train\.py: (\d+) rounds, (\d+) tokens in ([0-9.]+) s "
                       r"\(([0-9]+) tokens/s\), (\d+) bytes pushed", cluster.log("python"))
        self.assertIsNotNone(py, cluster.log("python"))
        self.assertGreaterEqual(int(py.group(1)), 2, cluster.log("python"))
        # bf16: 2 bytes per parameter per push.
        params = sum(p.numel() for p in aloe.TransformerLM(
            type("C", (), dict(vocab_size=256, seq_len=32, d_model=32, num_layers=2,
                               num_heads=2, ffn_mult=4))()).parameters())
        self.assertEqual(int(py.group(5)), 2 * params * int(py.group(1)))
        self.assertIn("(2 shard processes)", cluster.log("python"))

    def test_server_restart_and_wrong_token(self):
        cluster = Cluster(self.tmp, "restart")
        self.addCleanup(cluster.stop)
        port = free_port()
        tokens = os.path.join(cluster.dir, "tokens")
        with open(tokens, "w") as f:
            f.write("python %s\n" % TOKEN)
        for name, token in (("good", TOKEN), ("bad", "not-the-token")):
            with open(os.path.join(cluster.dir, name + ".token"), "w") as f:
                f.write(token + "\n")
        config = self.config(cluster, RESTART, port=port, tokens=tokens,
                             checkpoints=os.path.join(cluster.dir, "ckpt"))
        server = [os.path.join(BIN_DIR, "aloe-server"), "--config=" + config]
        cluster.start("server", server + ["--port_file=" + os.path.join(cluster.dir,
                                                                        "server.ports")])
        cluster.ports("server")
        train = [sys.executable, os.path.join(PYTHON_DIR, "examples", "train.py"),
                 "--server=127.0.0.1:%d" % port, "--corpus_dir=" + self.corpus]
        cluster.start("bad", train + ["--token_file=" + os.path.join(cluster.dir, "bad.token")])
        cluster.start("python", train + ["--name=python", "--token_file=" +
                                         os.path.join(cluster.dir, "good.token")])
        self.assertEqual(cluster.procs["bad"].wait(60), 1, cluster.log("bad"))
        self.assertRegex(cluster.log("bad"), r"train\.py: joining .*UNAUTHENTICATED")

        deadline = time.time() + 120
        while not re.search(r"version ([6-9]|\d\d) ", cluster.log("python")):
            self.assertLess(time.time(), deadline, cluster.logs())
            time.sleep(0.1)
        cluster.procs["server"].send_signal(signal.SIGKILL)
        cluster.procs["server"].wait()
        time.sleep(1.0)
        cluster.start("server2", server + ["--resume"])
        cluster.wait(["server2", "python"], 240)
        log = cluster.log("python")
        self.assertRegex(log, r"joining again")
        self.assertRegex(cluster.log("server2"), r"summary: version 40")
        py = re.search(r"train\.py: (\d+) rounds", log)
        self.assertIsNotNone(py, log)
        print("restart: the Python worker joined again and pushed %s rounds in all" % py.group(1))


def set_bin_dir(path):
    global BIN_DIR
    BIN_DIR = path


if __name__ == "__main__":
    unittest_main.main(set_bin_dir)
