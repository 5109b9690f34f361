#!/usr/bin/python3
"""scripts/simulate-stragglers on a tiny grid (aloe-sim back end, synthetic trainer, every
family): the documented files and CSV columns exist, row counts match the grid, and the
throughput numbers behave as the papers say a correct scheduler must (one consistent 4x
straggler: sync keeps 1/(1+4) of its throughput, async and A-EDiT keep > 0.8; elastic phases
with more workers apply more steps; sync has no staleness). Exits 77 (ctest SKIP_RETURN_CODE)
without python3-matplotlib.

Usage: simulate_stragglers_test.py [--bin-dir build/bin] [unittest args]
"""

import csv
import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
import time
import unittest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BIN_DIR = os.path.join(ROOT, "build", "bin")

# The columns documented in `scripts/simulate-stragglers --help` and the README.
RUN_COLUMNS = (
    "family backend trainer run_id policy seed level workers speeds lag straggle_p "
    "phase_seconds local_steps_h stop_reason wall_seconds virtual_seconds versions local_steps "
    "applied_steps updates rejected final_eval_loss final_perplexity tail_perplexity "
    "steps_per_second tokens_per_second capacity_steps_per_second utilization "
    "throughput_retention "
    "staleness_mean staleness_p50 staleness_p90 staleness_max target_perplexity "
    "time_to_target").split()
CURVE_COLUMNS = ("family run_id policy seed virtual_time local_steps version eval_loss "
                 "perplexity").split()
STALENESS_COLUMNS = "family run_id policy seed staleness count".split()
PHASE_COLUMNS = ("run_id policy seed phase start end workers steps_per_second "
                 "utilization").split()

STEPS = 400  # heterogeneity: local steps per run
H = 20


def read(path):
    with open(path, newline="") as f:
        rows = list(csv.reader(f))
    return rows[0], [dict(zip(rows[0], r)) for r in rows[1:]]


class SimulateStragglersTest(unittest.TestCase):
    out = None

    @classmethod
    def setUpClass(cls):
        cls.out = tempfile.mkdtemp(prefix="aloe-stragglers-")
        cmd = [os.path.join(ROOT, "scripts", "simulate-stragglers"), "--quick",
               "--trainer", "synthetic", "--levels", "no,very", "--steps", str(STEPS),
               "--lags", "0,4", "--random-cells", "0:0,0.25:4", "--virtual-seconds", "1500",
               "--phase-seconds", "33", "--policies", "sync,async-dn-dylu,a-edit",
               "--jobs", "2", "--bin-dir", BIN_DIR, "--out", cls.out]
        start = time.monotonic()
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        cls.log = proc.stdout + f"\n(grid took {time.monotonic() - start:.0f} s)"
        cls.returncode = proc.returncode

    @classmethod
    def tearDownClass(cls):
        if cls.out:
            shutil.rmtree(cls.out, ignore_errors=True)

    def setUp(self):
        self.assertEqual(self.returncode, 0, self.log)

    def path(self, name):
        return os.path.join(self.out, name)

    def runs(self, family):
        header, rows = read(self.path(f"{family}.csv"))
        self.assertEqual(header, RUN_COLUMNS)
        return rows

    def cell(self, family, policy, **where):
        rows = [r for r in self.runs(family) if r["policy"] == policy and
                all(float(r[k]) == v for k, v in where.items())]
        self.assertEqual(len(rows), 1, (family, policy, where))
        return rows[0]

    def test_files_and_columns(self):
        for name in ("perplexity_vs_local_steps.png", "perplexity_vs_time.png", "staleness.png",
                     "throughput_retention.png", "elastic.png"):
            with open(self.path(name), "rb") as f:
                self.assertEqual(f.read(8), b"\x89PNG\r\n\x1a\n", name)
        for name, columns in (("summary.csv", RUN_COLUMNS), ("curves.csv", CURVE_COLUMNS),
                              ("staleness.csv", STALENESS_COLUMNS),
                              ("elastic_phases.csv", PHASE_COLUMNS)):
            self.assertEqual(read(self.path(name))[0], columns, name)
        with open(self.path("summary.md")) as f:
            md = f.read()
        for heading in ("## Heterogeneity x policy", "## Consistent straggler",
                        "## Random stragglers", "## Elastic 1-2-4-8-4-2-1", "## Paper findings"):
            self.assertIn(heading, md)

    def test_row_counts_match_the_grid(self):
        # --quick heterogeneity policies filtered by --policies: sync, async-dn-dylu.
        self.assertEqual(len(self.runs("heterogeneity")), 2 * 2)
        self.assertEqual(len(self.runs("consistent")), 2 * 3)
        self.assertEqual(len(self.runs("random")), 2 * 3)
        self.assertEqual(len(self.runs("elastic")), 3)
        self.assertEqual(len(read(self.path("summary.csv"))[1]), 4 + 6 + 6 + 3)
        _, phases = read(self.path("elastic_phases.csv"))
        self.assertEqual(len(phases), 3 * 7)
        for r in self.runs("heterogeneity"):
            # aloe-sim stops at the first push that reaches --max_local_steps.
            self.assertGreaterEqual(int(r["local_steps"]), STEPS, r["run_id"])
            self.assertLess(int(r["local_steps"]), STEPS + 4 * H, r["run_id"])
            _, curve = read(self.path("curves.csv"))
            points = [c for c in curve if c["run_id"] == r["run_id"]]
            self.assertGreaterEqual(len(points), 3, r["run_id"])
            self.assertEqual(int(points[0]["local_steps"]), 0)
            self.assertEqual(int(points[-1]["local_steps"]), int(r["local_steps"]))

    def test_consistent_straggler_retention(self):
        # Paper 000 Table 6: one worker of 8 at 1/(1+4) speed. A sync round waits for it:
        # exactly 1/5 of the lag-0 throughput; async and A-EDiT lose only its own compute,
        # (7 + 1/5) / 8 = 0.9 at best.
        sync = float(self.cell("consistent", "sync", lag=4)["throughput_retention"])
        self.assertAlmostEqual(sync, 0.2, delta=0.02)
        r = float(self.cell("consistent", "a-edit", lag=4)["throughput_retention"])
        self.assertGreater(r, 0.8)
        self.assertLessEqual(r, 0.9 + 0.01)
        # Async DN+DyLU behind a grace window runs its first round (H steps each, speeds not yet
        # measured) together, so the 7 others wait once for the straggler's first round:
        # 0.9 - 7 x (lag x H) / (8 x run seconds) = 0.9 - 7 x 400 / (8 x 1500) = 0.667.
        r = float(self.cell("consistent", "async-dn-dylu", lag=4)["throughput_retention"])
        self.assertAlmostEqual(r, 0.9 - 7 * 400 / (8 * 1500), delta=0.03)
        for policy in ("sync", "async-dn-dylu", "a-edit"):
            base = self.cell("consistent", policy, lag=0)
            self.assertAlmostEqual(float(base["throughput_retention"]), 1.0, places=6)
            # No straggler: 8 workers x 1 step/s x 8 x 64 tokens per step, fully used.
            self.assertAlmostEqual(float(base["utilization"]), 1.0, delta=0.02, msg=policy)

    def test_random_stragglers_slow_everyone(self):
        # Every worker's mean speed falls to 1/(1 + 0.25 * 4) = 0.5 of its speed; sync also
        # waits for the unluckiest worker of each round.
        sync = float(self.cell("random", "sync", straggle_p=0.25, lag=4)["throughput_retention"])
        dn = float(self.cell("random", "async-dn-dylu", straggle_p=0.25,
                             lag=4)["throughput_retention"])
        self.assertLess(dn, 0.55)
        self.assertGreater(dn, 0.45)
        self.assertLess(sync, dn)

    def test_staleness(self):
        for r in self.runs("heterogeneity"):
            if r["policy"] == "sync":
                self.assertEqual(r["staleness_max"], "0", r["run_id"])
        very = [r for r in self.runs("heterogeneity")
                if r["policy"] == "async-dn-dylu" and r["level"] == "very"]
        self.assertEqual(len(very), 1)
        # Workers of different speeds push between each other's base and apply.
        self.assertGreater(int(very[0]["staleness_max"]), 0)
        _, hist = read(self.path("staleness.csv"))
        counted = sum(int(h["count"]) for h in hist if h["run_id"] == very[0]["run_id"])
        self.assertEqual(counted, int(very[0]["updates"]))

    def test_elastic_phases_follow_the_schedule(self):
        _, phases = read(self.path("elastic_phases.csv"))
        for policy in ("sync", "async-dn-dylu", "a-edit"):
            mine = [p for p in phases if p["policy"] == policy]
            self.assertEqual([int(p["workers"]) for p in mine], [1, 2, 4, 8, 4, 2, 1])
            peak = float(mine[3]["steps_per_second"])
            first = float(mine[0]["steps_per_second"])
            self.assertGreater(peak, 4 * first, policy)
            self.assertLessEqual(peak, 8 * 1.0 + 1e-9, policy)
            for p in mine:
                # Work is counted where it was computed and only once it is applied.
                self.assertLessEqual(float(p["utilization"]), 1.0 + 1e-6, (policy, p["phase"]))


def main():
    global BIN_DIR
    args = sys.argv[1:]
    if "--bin-dir" in args:
        i = args.index("--bin-dir")
        BIN_DIR = args[i + 1]
        del args[i:i + 2]
    if importlib.util.find_spec("matplotlib") is None:
        print("SKIP: python3-matplotlib is not installed (scripts/install-deps.sh)")
        return 77
    if not os.access(os.path.join(BIN_DIR, "aloe-sim"), os.X_OK):
        print(f"FAIL: {BIN_DIR}/aloe-sim is missing: build first")
        return 1
    result = unittest.main(argv=[sys.argv[0]] + args, exit=False).result
    return 0 if result.wasSuccessful() else 1


if __name__ == "__main__":
    sys.exit(main())
