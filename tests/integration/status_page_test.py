#!/usr/bin/python3
"""The status page in a real browser. Starts aloe-server (async Delayed Nesterov, DyLU, a grace
window, checkpoints) with two trainers (one slowed down 2x) and an evaluator on a small corpus
made from the repository's docs, waits for a few evaluations, then freezes the workers (SIGSTOP)
so that nothing changes, opens http://127.0.0.1:PORT/ in Debian's headless Chromium, and checks
the numbers the page shows (its DOM after the scripts ran) against the server's own /metrics:
version, held-out loss and perplexity, live workers, each trainer's steps/s and planned steps,
rejections by reason, data shards, the checkpoint's version; and that both plots drew their
series. Keeps a screenshot: status_page.png in --out-dir.

Then a layer-sharded server (a coordinator, two shard processes, one trainer, frozen the same
way): the coordinator's page lists both shard processes with their addresses, the version it
committed for them, and the version each reports it applied, against the coordinator's
/metrics (aloe_model_version, aloe_shard_applied_version).

Without chromium it exits 77 (ctest SKIP_RETURN_CODE), except under CI (environment CI set),
where scripts/install-deps.sh installs it and its absence is a failure.

Usage: status_page_test.py [--bin-dir build/bin] [--out-dir DIR] [unittest args]
"""

import glob
import html.parser
import json
import math
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
import urllib.error
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BIN_DIR = os.path.join(ROOT, "build", "bin")
OUT_DIR = os.path.join(ROOT, "build", "test-artifacts")
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")

CONFIG = """
listen_address: "127.0.0.1:0"
metrics_address: "127.0.0.1:0"
corpus_dir: "{corpus}"
model {{ vocab_size: 256 seq_len: 32 d_model: 32 num_layers: 2 num_heads: 2 }}
inner_optimizer {{ lr: 0.003 min_lr: 0.0003 warmup_steps: 5 total_steps: 100000 batch_size: 4 }}
outer_optimizer {{ type: OUTER_DELAYED_NESTEROV lr: 0.7 momentum: 0.9 dn_buffer_size: 2 }}
aggregation {{ mode: AGGREGATION_ASYNC grace_seconds: 0.2 }}
local_work {{ mode: LOCAL_WORK_DYLU }}
checkpoint {{ dir: "{checkpoints}" every_versions: 3 keep: 2 }}
local_steps: 8
eval_every: 2
lease_seconds: 120
"""

SHARDED_CONFIG = """
listen_address: "127.0.0.1:0"
metrics_address: "127.0.0.1:0"
corpus_dir: "{corpus}"
model {{ vocab_size: 256 seq_len: 32 d_model: 32 num_layers: 2 num_heads: 2 }}
inner_optimizer {{ lr: 0.003 batch_size: 4 total_steps: 100000 }}
outer_optimizer {{ type: OUTER_NESTEROV lr: 0.7 momentum: 0.9 }}
aggregation {{ mode: AGGREGATION_ASYNC min_workers: 1 }}
shard_processes: 2
local_steps: 8
lease_seconds: 120
"""


def get(url):
    with urllib.request.urlopen(url, timeout=10) as r:
        return r.read().decode()


def parse_metrics(text):
    """{(name, frozenset(labels)): value} of a Prometheus text exposition."""
    out = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = re.match(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{(.*)\})? (\S+)$', line)
        if not m:
            continue
        labels = frozenset(re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', m.group(3) or ""))
        out[(m.group(1), labels)] = float(m.group(4))
    return out


class Dom(html.parser.HTMLParser):
    """Elements of a dumped DOM: their tag, attributes and text (their own and their
    children's), in document order."""

    VOID = {"meta", "br", "link", "img", "input", "hr", "path", "circle", "rect"}

    def __init__(self, text):
        super().__init__()
        self.elements, self.stack = [], []
        self.feed(text)

    def handle_starttag(self, tag, attrs):
        element = {"tag": tag, "attrs": dict(attrs), "text": "", "children": []}
        if self.stack:
            self.stack[-1]["children"].append(element)
        self.elements.append(element)
        if tag not in self.VOID:
            self.stack.append(element)

    def handle_startendtag(self, tag, attrs):
        self.handle_starttag(tag, attrs)
        if tag not in self.VOID:
            self.stack.pop()

    def handle_endtag(self, tag):
        if tag in self.VOID or tag not in (e["tag"] for e in self.stack):
            return
        while self.stack.pop()["tag"] != tag:
            pass

    def handle_data(self, data):
        for element in self.stack:
            element["text"] += data

    def by_id(self, ident):
        for e in self.elements:
            if e["attrs"].get("id") == ident:
                return e
        raise AssertionError(f"no element with id {ident}")

    def with_attr(self, name):
        return [e for e in self.elements if name in e["attrs"]]


def descendants(element):
    for child in element["children"]:
        yield child
        yield from descendants(child)


def cell(row, cls):
    for e in descendants(row):
        if cls in e["attrs"].get("class", "").split():
            return e["text"].strip()
    raise AssertionError(f"row without a {cls} cell")


def free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class LivePage(unittest.TestCase):
    """A server role's page over real processes that a subclass starts in setUpClass (start,
    then freeze); their logs are kept in a temporary directory until tearDownClass."""

    tmp = None
    procs = []
    metrics_url = None

    @classmethod
    def make_corpus(cls):
        cls.tmp = tempfile.mkdtemp(prefix="aloe-status-")
        cls.procs = []
        text = os.path.join(cls.tmp, "text")
        os.makedirs(text)
        for doc in sorted(glob.glob(os.path.join(ROOT, "docs", "*.md")))[:6]:
            shutil.copy(doc, os.path.join(text, os.path.basename(doc)[:-3] + ".txt"))
        corpus = os.path.join(cls.tmp, "corpus")
        subprocess.run([os.path.join(BIN_DIR, "aloe-corpus"), f"--input_dir={text}",
                        f"--output_dir={corpus}"], check=True, stdout=subprocess.DEVNULL)
        return corpus

    @classmethod
    def start_server(cls, name, config_text, flags=()):
        """Starts aloe-server with `config_text`; returns its {"grpc": port, "metrics": port}."""
        config = os.path.join(cls.tmp, name + ".textproto")
        with open(config, "w") as f:
            f.write(config_text)
        ports = os.path.join(cls.tmp, name + ".ports")
        cls.start(name, [os.path.join(BIN_DIR, "aloe-server"), f"--config={config}",
                         f"--port_file={ports}", *flags])
        for _ in range(300):
            if os.path.exists(ports) and os.path.getsize(ports) > 0:
                break
            time.sleep(0.1)
        with open(ports) as f:
            return dict(kv.split("=") for kv in f.read().split())

    @classmethod
    def worker_argv(cls, grpc_port, corpus):
        return [os.path.join(BIN_DIR, "aloe-worker"), f"--server=127.0.0.1:{grpc_port}",
                f"--corpus_dir={corpus}", "--metrics=off", "--device=cpu"]

    @classmethod
    def start(cls, name, argv):
        env = dict(os.environ, OMP_NUM_THREADS="1")
        with open(os.path.join(cls.tmp, name + ".log"), "w") as log:
            cls.procs.append((name, subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT,
                                                     env=env)))

    @classmethod
    def freeze(cls, names):
        """Stops the processes `names` (SIGSTOP): from here on the server's numbers stay put."""
        for name, proc in cls.procs:
            if name in names:
                proc.send_signal(signal.SIGSTOP)
        time.sleep(2)  # a grace window open at the freeze closes; the last reports arrive

    @classmethod
    def tearDownClass(cls):
        for _, proc in cls.procs:
            proc.send_signal(signal.SIGCONT)
            proc.terminate()
        for _, proc in cls.procs:
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if cls.tmp:
            shutil.rmtree(cls.tmp, ignore_errors=True)

    def logs(self):
        text = ""
        for name, _ in self.procs:
            with open(os.path.join(self.tmp, name + ".log"), errors="replace") as f:
                text += f"--- {name}:\n" + f.read()[-2000:] + "\n"
        return text

    def chromium(self, *flags):
        profile = tempfile.mkdtemp(dir=self.tmp)
        proc = subprocess.run(
            [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
             "--disable-extensions", "--hide-scrollbars", f"--user-data-dir={profile}",
             "--window-size=1400,1250", "--virtual-time-budget=6000", *flags,
             self.metrics_url + "/"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, timeout=120)
        self.assertEqual(proc.returncode, 0, proc.stderr[-3000:])
        return proc.stdout


class StatusPageTest(LivePage):

    @classmethod
    def setUpClass(cls):
        corpus = cls.make_corpus()
        found = cls.start_server("server", CONFIG.format(
            corpus=corpus, checkpoints=os.path.join(cls.tmp, "ckpt")))
        cls.metrics_url = f"http://127.0.0.1:{found['metrics']}"
        worker = cls.worker_argv(found["grpc"], corpus)
        cls.start("evaluator", worker + ["--role=evaluator", "--name=evaluator",
                                         "--eval_sequences=8"])
        cls.start("trainer-fast", worker + ["--name=trainer-fast"])
        cls.start("trainer-slow", worker + ["--name=trainer-slow", "--slowdown=2"])
        # A few evaluations and a checkpoint, so that both plots have points.
        deadline = time.time() + 150
        while time.time() < deadline:
            status = json.loads(get(cls.metrics_url + "/status.json"))
            losses = status["history"]["losses"]
            if len(losses) >= 3 and losses[-1][0] - losses[0][0] >= 5 and status["checkpoint"]:
                break
            time.sleep(1)
        cls.freeze({"evaluator", "trainer-fast", "trainer-slow"})

    def test_page_shows_the_servers_numbers_and_draws_its_plots(self):
        before = parse_metrics(get(self.metrics_url + "/metrics"))
        dom = Dom(self.chromium("--dump-dom"))
        after = parse_metrics(get(self.metrics_url + "/metrics"))

        def metric(name, labels=None):
            labels = labels or {}
            key = (name, frozenset(labels.items()))
            self.assertIn(key, after, f"{name}{labels} not in /metrics")
            self.assertEqual(before.get(key), after[key], f"{name} moved while frozen")
            return after[key]

        body = [e for e in dom.elements if e["tag"] == "body"][0]
        self.assertGreaterEqual(int(body["attrs"].get("data-polls", "0")), 1,
                                "the page never rendered status.json\n" + self.logs())
        self.assertEqual(int(dom.by_id("version")["text"]), metric("aloe_model_version"))
        loss = metric("aloe_eval_loss")
        self.assertEqual(dom.by_id("loss")["text"], f"{loss:.4f}")
        self.assertEqual(dom.by_id("perplexity")["text"], f"{math.exp(loss):.2f}")
        self.assertEqual(int(dom.by_id("loss")["attrs"]["data-version"]),
                         metric("aloe_eval_version"))
        self.assertEqual(int(dom.by_id("worker-count")["text"]), metric("aloe_live_workers"))
        self.assertEqual(metric("aloe_live_workers"), 3)

        rows = {r["attrs"]["data-worker"]: r for r in dom.with_attr("data-worker")}
        self.assertEqual(sorted(rows), ["evaluator", "trainer-fast", "trainer-slow"])
        speeds = {}
        for name in ("trainer-fast", "trainer-slow"):
            labels = {"worker": rows[name]["attrs"]["data-id"], "name": name}
            speed = metric("aloe_trainer_steps_per_second", labels)
            shown = float(cell(rows[name], "steps-per-second").replace(",", ""))
            self.assertAlmostEqual(shown, speed, delta=0.006, msg=name)
            speeds[name] = speed
            planned = cell(rows[name], "planned-steps")
            if planned != "–":  # shown only while the worker has a training task
                self.assertEqual(int(planned), metric("aloe_trainer_planned_steps", labels))
            self.assertGreaterEqual(int(cell(rows[name], "pushes")), 1, name)
        self.assertTrue(all(v > 0 for v in speeds.values()), speeds)

        for row in dom.with_attr("data-reason"):
            reason = row["attrs"]["data-reason"]
            shown = float(row["children"][1]["text"].replace(",", ""))
            self.assertEqual(shown, metric("aloe_updates_rejected_total", {"reason": reason}),
                             reason)
        self.assertEqual(len(dom.with_attr("data-reason")), 7)

        learned = {dict(labels)["shard"]: v for (name, labels), v in after.items()
                   if name == "aloe_data_shard_tokens_learned"}
        shards = {r["attrs"]["data-shard"]: r for r in dom.with_attr("data-shard")}
        self.assertEqual(sorted(shards), sorted(learned))
        total = sum(learned.values())
        self.assertGreater(total, 0)
        for name, row in shards.items():
            # One decimal, as the page's toFixed rounds it: a share at a rounding midpoint may
            # round either way after the page's own float arithmetic and JSON round trip.
            shown = cell(row, "learned-share")
            self.assertRegex(shown, r"^\d+\.\d%$")
            self.assertLessEqual(abs(float(shown[:-1]) - 100 * learned[name] / total), 0.05 + 1e-6,
                                 name)

        self.assertRegex(dom.by_id("checkpoint")["text"],
                         rf"^version {int(metric('aloe_checkpoint_version'))}, ")

        for plot in ("plot-version", "plot-loss"):
            svg = dom.by_id(plot)
            self.assertGreaterEqual(int(svg["attrs"]["data-points"]), 2, plot)
            paths = [e for e in descendants(svg)
                     if e["tag"] == "path" and "series" in e["attrs"].get("class", "")]
            self.assertTrue(paths, f"{plot} drew no series")
            # A move and at least two segments (a step is H and V).
            self.assertGreaterEqual(len(re.findall(r"[MLHV]", paths[0]["attrs"]["d"])), 3, plot)

    def test_screenshot_is_kept(self):
        os.makedirs(OUT_DIR, exist_ok=True)
        png = os.path.join(OUT_DIR, "status_page.png")
        if os.path.exists(png):
            os.remove(png)
        self.chromium(f"--screenshot={png}")
        self.assertTrue(os.path.exists(png))
        with open(png, "rb") as f:
            self.assertEqual(f.read(8), b"\x89PNG\r\n\x1a\n")
        self.assertGreater(os.path.getsize(png), 20000)  # a drawn page, not a blank one
        print(f"screenshot: {png}", file=sys.stderr)

    def test_the_endpoint_is_read_only(self):
        request = urllib.request.Request(self.metrics_url + "/status.json", data=b"x",
                                         method="POST")
        with self.assertRaises(urllib.error.HTTPError) as caught:
            urllib.request.urlopen(request, timeout=10)
        self.assertEqual(caught.exception.code, 405)


class CoordinatorPageTest(LivePage):

    @classmethod
    def setUpClass(cls):
        corpus = cls.make_corpus()
        config = SHARDED_CONFIG.format(corpus=corpus)
        found = cls.start_server("coordinator", config, ["--role=coordinator"])
        cls.metrics_url = f"http://127.0.0.1:{found['metrics']}"
        cls.shard_addresses = []
        for index in range(2):
            address = f"127.0.0.1:{free_port()}"
            cls.shard_addresses.append(address)
            cls.start_server(f"shard{index}", config,
                             ["--role=shard", f"--shard_index={index}", f"--listen={address}",
                              f"--coordinator=127.0.0.1:{found['grpc']}"])
        cls.start("trainer", cls.worker_argv(found["grpc"], corpus) + ["--name=trainer"])
        deadline = time.time() + 120
        while time.time() < deadline:
            if json.loads(get(cls.metrics_url + "/status.json"))["version"] >= 5:
                break
            time.sleep(0.5)
        cls.freeze({"trainer"})

    def test_page_shows_each_shard_processs_committed_and_applied_version(self):
        metrics = parse_metrics(get(self.metrics_url + "/metrics"))
        dom = Dom(self.chromium("--dump-dom"))
        version = metrics[("aloe_model_version", frozenset())]
        self.assertGreaterEqual(version, 5, self.logs())
        self.assertEqual(int(dom.by_id("version")["text"]), version)
        rows = [r for r in dom.elements
                if r["tag"] == "tr" and r in descendants(dom.by_id("shard-processes"))
                and any(c["tag"] == "td" for c in r["children"])]
        self.assertEqual(len(rows), 2, self.logs())
        for index, row in enumerate(rows):
            cells = [c["text"].strip() for c in row["children"] if c["tag"] == "td"]
            applied = metrics[("aloe_shard_applied_version",
                               frozenset({("process", str(index))}))]
            # Frozen: every commit reached both shard processes, and they said so.
            self.assertEqual(applied, version, self.logs())
            self.assertEqual(cells, [str(index), self.shard_addresses[index], str(int(version)),
                                     str(int(applied))])


if __name__ == "__main__":
    for flag in ("--bin-dir", "--out-dir"):
        if flag in sys.argv:
            i = sys.argv.index(flag)
            value = os.path.abspath(sys.argv[i + 1])
            if flag == "--bin-dir":
                BIN_DIR = value
            else:
                OUT_DIR = value
            del sys.argv[i:i + 2]
    if CHROMIUM is None:
        if os.environ.get("CI"):
            print("FAIL: chromium is missing under CI (scripts/install-deps.sh installs it)",
                  file=sys.stderr)
            sys.exit(1)
        print("SKIP: chromium is missing (Debian package chromium)", file=sys.stderr)
        sys.exit(77)
    unittest.main()
