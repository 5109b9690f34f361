#!/usr/bin/python3
"""scripts/soak --quick (about 2 minutes): a coordinator with two shard processes, then a
single-process server, each with real trainers and an evaluator under a seeded fault schedule;
every invariant must PASS (the replay one too: aloe-replay is built with the daemons). Also the
parts that need no process: the schedule is seeded and spaced, and the journal reader undoes
the commits a RESTORE undoes.

Usage: soak_test.py [--bin-dir build/bin] [unittest args]
"""

import os
import struct
import subprocess
import sys
import unittest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BIN_DIR = os.path.join(ROOT, "build", "bin")
sys.path.insert(0, os.path.join(ROOT, "scripts"))

from chaos import journal as J  # noqa: E402
from chaos import schedule as S  # noqa: E402


def varint(n):
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        out.append(b | (0x80 if n else 0))
        if not n:
            return bytes(out)


def order(kind, version, entries=()):
    body = varint(1 << 3) + varint(kind) + varint(2 << 3) + varint(version)
    for worker, update, weight in entries:
        e = (varint(1 << 3) + varint(worker) + varint(2 << 3) + varint(update)
             + varint((3 << 3) | 5) + struct.pack("<f", weight))
        body += varint((3 << 3) | 2) + varint(len(e)) + e
    return varint(len(body)) + body


class ScheduleAndJournalTest(unittest.TestCase):
    def test_schedule_is_seeded_and_spaces_server_faults(self):
        counts = S.counts_for("sharded", 20, 5, 2)
        a = S.make(7, "sharded", 5, 100, 3, 2, counts, 3.0, 7.0)
        b = S.make(7, "sharded", 5, 100, 3, 2, counts, 3.0, 7.0)
        c = S.make(8, "sharded", 5, 100, 3, 2, counts, 3.0, 7.0)
        self.assertEqual([repr(f) for f in a], [repr(f) for f in b])
        self.assertNotEqual([repr(f) for f in a], [repr(f) for f in c])
        self.assertEqual(sum(f.kind == S.WORKER_KILL for f in a), 20)
        server = [f for f in a if f.kind in S.SERVER_SIDE]
        self.assertEqual(len(server), 5 + 2)  # five kills, two disk_full
        for x, y in zip(server, server[1:]):
            self.assertGreaterEqual(y.time - x.time, 7.0 * 0.8)
            self.assertLess(x.hold, 7.0 * 0.8)
        for f in a:
            self.assertTrue(5 <= f.time < 100, f)
            if f.kind == S.WORKER_FREEZE:
                self.assertGreater(f.hold, 3.0)  # longer than the lease
        with self.assertRaises(ValueError):
            S.make(7, "sharded", 5, 20, 3, 2, counts, 3.0, 7.0)

    def test_restore_undoes_later_commits(self):
        data = (order(J.RESTORE, 0) + order(J.COMMIT, 1, [(1, 1, 1.0)])
                + order(J.COMMIT, 2, [(2, 1, 0.5), (1, 2, 0.5)])
                + order(J.COMMIT, 3, [(3, 1, 1.0)]) + order(J.DISCARD, 0, [(4, 1, 0.0)])
                + order(J.RESTORE, 1) + order(J.COMMIT, 2, [(3, 2, 0.25)]))
        orders, cut = J.parse(data + b"\x05\x08")  # a cut last entry
        self.assertTrue(cut)
        self.assertEqual(len(orders), 7)
        h = J.History(orders)
        self.assertEqual([o.version for o in h.standing], [1, 2])
        self.assertEqual(h.committed, {(1, 1): 1, (3, 2): 2})
        self.assertEqual(h.undone_keys, {(2, 1), (1, 2), (3, 1)})
        self.assertEqual(h.discarded, {(4, 1)})
        self.assertEqual(h.restores, [0, 1])
        self.assertEqual(h.gaps(), [])
        self.assertEqual(h.final_version(), 2)
        self.assertAlmostEqual(h.standing[1].entries[0].weight, 0.25)


class QuickSoakTest(unittest.TestCase):
    def test_quick_soak_passes_every_invariant(self):
        proc = subprocess.run([os.path.join(ROOT, "scripts", "soak"), "--quick", "--bin-dir",
                               BIN_DIR], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True)
        out = proc.stdout
        self.assertEqual(proc.returncode, 0, out)
        self.assertNotIn("FAIL ", out)
        for name in ("shards at one version", "accepted pushes accounted for",
                     "no half-applied update", "memory within bound", "every process exits",
                     "held-out loss falls after the faults"):
            self.assertEqual(out.count(f"PASS {name}:"), 2, f"{name}\n{out}")
        self.assertIn("PASS single-process replay: ", out)
        self.assertRegex(out, r"PASS single-process replay: \d+ commits .* 0 of \d+ parameters "
                              r"differ")
        for kind in (S.WORKER_KILL, S.WORKER_FREEZE, S.LINK_CUT, S.LINK_STALL, S.SHARD_KILL,
                     S.COORDINATOR_KILL, S.DRAIN, S.CORRUPT_CHECKPOINT, S.SERVER_KILL):
            self.assertRegex(out, rf"\n  {kind} +[1-9]", f"{kind}\n{out}")
        self.assertRegex(out, r"goodput: \d+ committed updates, \d+ tokens learned/s .* x the "
                              r"fault-free run's")


if __name__ == "__main__":
    if "--bin-dir" in sys.argv:
        i = sys.argv.index("--bin-dir")
        BIN_DIR = sys.argv[i + 1]
        del sys.argv[i:i + 2]
    unittest.main()
