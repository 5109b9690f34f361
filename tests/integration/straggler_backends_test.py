#!/usr/bin/python3
"""scripts/simulate-stragglers runs the same random-straggler grid on both back ends and they
agree on the ordering of the policies. The grid: 4 workers, H = 20, every step of every worker
delayed 40x with probability 0.02 (one seeded step-time trace, replayed by aloe-sim --trace and
by each real aloe-worker --step_trace); sync DiLoCo against async Delayed Nesterov + DyLU. A sync
round waits for its slowest worker, async does not, so async must do more local steps per
second on both back ends. The loopback back end trains real processes on a small corpus made
here from the repository's own docs. Exits 77 (ctest SKIP_RETURN_CODE) without
python3-matplotlib.

Usage: straggler_backends_test.py [--bin-dir build/bin] [unittest args]
"""

import csv
import glob
import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
import unittest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BIN_DIR = os.path.join(ROOT, "build", "bin")
POLICIES = ("sync", "async-dn-dylu")
GRID = ["--families", "random", "--random-cells", "0.02:40", "--policies", ",".join(POLICIES),
        "--workers", "4", "--local-steps", "20"]


def steps_per_second(out_dir):
    with open(os.path.join(out_dir, "random.csv"), newline="") as f:
        rows = list(csv.DictReader(f))
    return {r["policy"]: float(r["steps_per_second"]) for r in rows}


class StragglerBackendsTest(unittest.TestCase):
    tmp = None

    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.mkdtemp(prefix="aloe-backends-")
        text = os.path.join(cls.tmp, "text")
        os.makedirs(text)
        for doc in sorted(glob.glob(os.path.join(ROOT, "docs", "*.md"))):
            shutil.copy(doc, os.path.join(text, os.path.basename(doc)[:-3] + ".txt"))
        corpus = os.path.join(cls.tmp, "corpus")
        subprocess.run([os.path.join(BIN_DIR, "aloe-corpus"), f"--input_dir={text}",
                        f"--output_dir={corpus}"], check=True, stdout=subprocess.DEVNULL)
        cls.results, cls.logs = {}, {}
        for backend, extra in (("sim", ["--virtual-seconds", "400", "--trainer", "synthetic"]),
                               ("loopback", ["--real-seconds", "20"])):
            out = os.path.join(cls.tmp, backend)
            proc = subprocess.run(
                [os.path.join(ROOT, "scripts", "simulate-stragglers"), "--backend", backend]
                + GRID + extra + ["--bin-dir", BIN_DIR, "--corpus-dir", corpus, "--out", out],
                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            cls.logs[backend] = proc.stdout
            if proc.returncode == 0:
                cls.results[backend] = steps_per_second(out)
                print(f"{backend}: local steps/s {cls.results[backend]}", file=sys.stderr)

    @classmethod
    def tearDownClass(cls):
        if cls.tmp:
            shutil.rmtree(cls.tmp, ignore_errors=True)

    def check(self, backend):
        self.assertIn(backend, self.results, self.logs[backend])
        speed = self.results[backend]
        self.assertEqual(sorted(speed), sorted(POLICIES))
        return speed

    def test_async_beats_sync_on_the_simulator(self):
        speed = self.check("sim")
        self.assertGreater(speed["async-dn-dylu"], 1.3 * speed["sync"], speed)

    def test_async_beats_sync_with_real_workers_replaying_the_trace(self):
        speed = self.check("loopback")
        # Four worker processes share the host's cores, so the gain is smaller than on the
        # simulator; ctest runs this test alone (RUN_SERIAL) to keep other tests' load out of
        # its wall-clock speeds.
        self.assertGreater(speed["async-dn-dylu"], 1.10 * speed["sync"], speed)

    def test_both_back_ends_order_the_policies_alike(self):
        sim, loop = self.check("sim"), self.check("loopback")
        self.assertEqual(sorted(POLICIES, key=sim.get), sorted(POLICIES, key=loop.get),
                         (sim, loop))


if __name__ == "__main__":
    if "--bin-dir" in sys.argv:
        i = sys.argv.index("--bin-dir")
        BIN_DIR = os.path.abspath(sys.argv[i + 1])
        del sys.argv[i:i + 2]
    if importlib.util.find_spec("matplotlib") is None:
        print("SKIP: python3-matplotlib is missing", file=sys.stderr)
        sys.exit(77)
    unittest.main()
