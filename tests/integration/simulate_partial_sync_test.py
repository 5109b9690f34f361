#!/usr/bin/python3
"""scripts/simulate-partial-sync --quick (aloe-sim with its network model, synthetic trainer):
the documented files and CSV columns exist, the grid has its four cells, the K = 1 run went
through its 10 Mbit/s links (peak upload = the link rate, compute utilization well below 1),
and summary.md states both findings with a verdict. An aloe-sim that does not simulate layer
groups refuses the K > 1 cells or runs them with every push rejected; then they must say so.
The findings' verdict rules are also checked on fabricated rows. Exits 77 (ctest
SKIP_RETURN_CODE) without python3-matplotlib or without an aloe-sim that has the network model.

Usage: simulate_partial_sync_test.py [--bin-dir build/bin] [unittest args]
"""

import argparse
import csv
import importlib.util
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
import unittest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BIN_DIR = os.path.join(ROOT, "build", "bin")
sys.path.insert(0, os.path.join(ROOT, "scripts"))

from sim import partial_sync_report as report  # noqa: E402

# The columns documented in `scripts/simulate-partial-sync --help`.
RUN_COLUMNS = (
    "run_id status policy schedule groups fill_bubbles merge_delay_steps mixing_alpha link "
    "rate_mbit latency_ms peak_window workers step_seconds local_steps_h seed trainer "
    "stop_reason wall_seconds local_steps versions virtual_seconds final_eval_loss "
    "final_perplexity tail_perplexity target_loss target_perplexity time_to_target "
    "peak_up_bytes_per_second peak_up_max peak_down_max bytes_up_mean updates_mean utilization "
    "utilization_mean note").split()
CURVE_COLUMNS = ("run_id policy schedule groups fill_bubbles rate_mbit seed virtual_time "
                 "local_steps version eval_loss perplexity").split()
PLOTS = ("perplexity_vs_local_steps.png", "perplexity_vs_time.png", "peak_bandwidth_vs_k.png",
         "utilization_vs_bandwidth.png")
STEPS = 240  # --quick: local steps per run
H = 20
LINK_BYTES_PER_SECOND = 10e6 / 8  # --quick: 10 Mbit/s per worker


def read(path):
    with open(path, newline="") as f:
        rows = list(csv.reader(f))
    return rows[0], [dict(zip(rows[0], r)) for r in rows[1:]]


def run_quick_grid(out_dir):
    """Runs `--quick` with the synthetic trainer into out_dir; returns (exit status, output)."""
    cmd = [os.path.join(ROOT, "scripts", "simulate-partial-sync"), "--quick", "--trainer",
           "synthetic", "--jobs", "2", "--bin_dir", BIN_DIR, "--out", out_dir]
    start = time.monotonic()
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    return proc.returncode, proc.stdout + f"\n(grid took {time.monotonic() - start:.0f} s)"


class SimulatePartialSyncTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.out = tempfile.mkdtemp(prefix="aloe-partial-sync-")
        cls.addClassCleanup(shutil.rmtree, cls.out, ignore_errors=True)
        cls.returncode, cls.log = run_quick_grid(cls.out)

    def setUp(self):
        self.assertEqual(self.returncode, 0, self.log)

    def path(self, name):
        return os.path.join(self.out, name)

    def runs(self):
        header, rows = read(self.path("runs.csv"))
        self.assertEqual(header, RUN_COLUMNS)
        return rows

    def test_files_columns_and_progress(self):
        for name in PLOTS:
            with open(self.path(name), "rb") as f:
                self.assertEqual(f.read(8), b"\x89PNG\r\n\x1a\n", name)
        self.assertEqual(read(self.path("curves.csv"))[0], CURVE_COLUMNS)
        self.assertIn("[4/4]", self.log)

    def test_quick_grid_cells(self):
        cells = sorted((r["policy"], r["rate_mbit"], r["groups"], r["schedule"])
                       for r in self.runs())
        self.assertEqual(cells, [("sync", "10", "1", "full"), ("sync", "10", "2", "dreamddp"),
                                 ("sync", "10", "2", "enp"), ("sync", "10", "2", "strided")])
        for r in self.runs():
            self.assertEqual(r["seed"], "1")
            self.assertIn(r["status"], ("ok", "refused", "rejected"), r)
            if r["status"] != "ok":
                self.assertNotEqual(r["groups"], "1")
                self.assertTrue(r["note"], r)  # says why
                continue
            # aloe-sim stops at the first push that reaches --max_local_steps.
            self.assertGreaterEqual(int(r["local_steps"]), STEPS, r["run_id"])
            self.assertLess(int(r["local_steps"]), STEPS + 4 * H, r["run_id"])
            self.assertEqual(len(r["peak_up_bytes_per_second"].split(";")), 4)
            self.assertEqual(len(r["utilization"].split(";")), 4)
            with open(self.path(os.path.join("runs", r["run_id"], "config.textproto"))) as f:
                config = f.read()
            self.assertEqual("partial_sync" in config, r["groups"] != "1", r["run_id"])

    def test_full_model_run_is_behind_its_links(self):
        base = [r for r in self.runs() if r["groups"] == "1"]
        self.assertEqual(len(base), 1)
        r = base[0]
        self.assertEqual(r["status"], "ok", r)
        self.assertAlmostEqual(float(r["final_perplexity"]), math.exp(float(r["final_eval_loss"])),
                               delta=1e-4 * float(r["final_perplexity"]))
        # A full-model push takes about a second at 10 Mbit/s, longer than the 0.05 s window:
        # every worker's peak upload is the link rate. Without the links it would be the model's
        # bytes in one window, 27 MB/s.
        for peak in r["peak_up_bytes_per_second"].split(";"):
            self.assertAlmostEqual(float(peak), LINK_BYTES_PER_SECOND,
                                   delta=0.01 * LINK_BYTES_PER_SECOND)
        # A round's 1.0-1.8 s of compute waits for 2.2 s of push and pull: under half the time.
        self.assertGreater(float(r["utilization_mean"]), 0.1)
        self.assertLess(float(r["utilization_mean"]), 0.5)
        # Target = its own final loss + ln 1.02: reached, at the latest at its end.
        self.assertAlmostEqual(float(r["target_loss"]), float(r["final_eval_loss"]) +
                               math.log(1.02), places=4)
        self.assertLessEqual(float(r["time_to_target"]), float(r["virtual_seconds"]))
        _, curve = read(self.path("curves.csv"))
        points = [c for c in curve if c["run_id"] == r["run_id"]]
        self.assertGreaterEqual(len(points), 3)
        self.assertEqual(int(points[0]["local_steps"]), 0)
        self.assertEqual(int(points[-1]["local_steps"]), int(r["local_steps"]))
        self.assertAlmostEqual(float(points[-1]["virtual_time"]), float(r["virtual_seconds"]),
                               places=3)

    def test_summary_states_both_findings(self):
        with open(self.path("summary.md")) as f:
            md = f.read()
        for text in ("Command: `scripts/simulate-partial-sync --quick", "Host: ", "date: ",
                     "| policy | links | K | schedule |", "## Findings"):
            self.assertIn(text, md)
        for finding in ("(a) paper 003 Tables 1-2", "(b) streaming"):
            lines = [ln for ln in md.splitlines() if finding in ln]
            self.assertEqual(len(lines), 1, finding)
            self.assertRegex(lines[0], r"^- \*\*(holds|does not hold|not checked)\*\*: ")
        statuses = set(r["status"] for r in self.runs())
        if "refused" in statuses:
            self.assertIn("were refused by this aloe-sim", md)
        if "rejected" in statuses:
            self.assertIn("ran without a single push applied", md)


def _row(policy, groups, schedule, *, seconds, ppl, peak, rate=10.0, fill=False):
    return {"row": {"policy": policy, "rate_mbit": rate, "groups": groups, "schedule": schedule,
                    "fill_bubbles": int(fill), "status": "ok", "note": "", "local_steps": 3200,
                    "virtual_seconds": seconds, "tail_perplexity": ppl, "time_to_target": seconds,
                    "peak_up_max": peak, "bytes_up_mean": 4e7, "updates_mean": 40,
                    "peak_window": 0.05}}


class FindingRulesTest(unittest.TestCase):
    """The verdicts on fabricated rows, one rule broken at a time."""

    def paper003(self, enp_seconds=80.0, dd_seconds=70.0, enp_ppl=7.0, dd_ppl=7.0):
        return [_row("sync", 1, "full", seconds=100.0, ppl=7.0, peak=1.25e6),
                _row("sync", 4, "enp", seconds=enp_seconds, ppl=enp_ppl, peak=1.25e6),
                _row("sync", 4, "dreamddp", seconds=dd_seconds, ppl=dd_ppl, peak=1.25e6)]

    def test_paper003_verdicts(self):
        verdict = lambda rows: report.finding_a(rows, 4)[1]  # noqa: E731
        self.assertEqual(verdict(self.paper003()), report.HOLDS)
        self.assertEqual(verdict(self.paper003(enp_seconds=100.0)), report.FAILS)
        self.assertEqual(verdict(self.paper003(dd_ppl=7.2)), report.FAILS)  # +2.9%
        self.assertEqual(verdict(self.paper003(dd_seconds=85.0)), report.FAILS)  # after ENP
        self.assertEqual(verdict(self.paper003(enp_ppl=6.9, dd_ppl=7.0)), report.FAILS)
        self.assertEqual(verdict(self.paper003()[:2]), report.UNCHECKED)
        refused = self.paper003()
        refused[2]["row"]["status"] = "refused"
        self.assertEqual(verdict(refused), report.UNCHECKED)
        _, _, text = report.finding_a(self.paper003(), 4)
        self.assertIn("K=1 100.0, ENP 80.0 (x1.25 faster), DreamDDP 70.0 (x1.43)", text)

    def streaming(self, peak4, ppl4=7.1):
        rows = []
        for rate in (10.0, 1000.0):
            rows += [_row("sync", 1, "full", seconds=100.0, ppl=7.0, peak=8e6, rate=rate),
                     _row("sync", 4, "strided", seconds=100.0, ppl=ppl4, peak=peak4, rate=rate)]
        return rows

    def test_streaming_verdicts(self):
        self.assertEqual(report.finding_b(self.streaming(2e6))[1], report.HOLDS)
        self.assertEqual(report.finding_b(self.streaming(3e6))[1], report.FAILS)  # x2.7 < 3
        self.assertEqual(report.finding_b(self.streaming(2e6, ppl4=7.2))[1], report.FAILS)
        name, _, text = report.finding_b(self.streaming(2e6))
        self.assertIn("8.00 -> 2.00 MB/s (x4.00 lower, K = 4)", text)
        # 1 MB per push at 1000 Mbit/s: 8 ms, inside the 50 ms window.
        self.assertIn("takes 8.0 ms at 1000 Mbit/s, within the 50 ms peak window", text)


def simulator_status(sim):
    """(0, "") when `sim` runs and has the network model; else (1 or 77, what to print)."""
    if not os.access(sim, os.X_OK):
        return 1, f"FAIL: {sim} is missing: build first"
    help_text = subprocess.run([sim, "--help"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True).stdout
    if "--links" not in help_text:
        return 77, f"SKIP: {sim} has no network model (--links)"
    return 0, ""


def main():
    global BIN_DIR
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--bin-dir", default=BIN_DIR)
    known, args = parser.parse_known_args()
    BIN_DIR = known.bin_dir
    if importlib.util.find_spec("matplotlib") is None:
        print("SKIP: python3-matplotlib is not installed (scripts/install-deps.sh)")
        return 77
    status, why = simulator_status(os.path.join(BIN_DIR, "aloe-sim"))
    if status != 0:
        print(why)
        return status
    result = unittest.main(argv=[sys.argv[0]] + args, exit=False).result
    return 0 if result.wasSuccessful() else 1


if __name__ == "__main__":
    sys.exit(main())
