#!/usr/bin/python3
"""The closing comparison of scripts/demo.sh: the async job against the sync job, from their
logs. For each job, the time from the server's start to the first evaluation at or below a
target held-out perplexity (the best perplexity both jobs reached), and each trainer's share of
its wall time blocked on the network (its summary's blocked_on_network; in a sync job that
includes waiting for the round's slowest trainer).

Usage: demo_compare.py ASYNC_RUN_DIR SYNC_RUN_DIR
"""

import math
import os
import re
import sys

LOG_TIME = re.compile(r"^[IWE] (\d\d):(\d\d):(\d\d\.\d+) ")
TRAINERS = ("worker-fast", "worker-slow")


def seconds(line):
    m = LOG_TIME.match(line)
    return int(m.group(1)) * 3600 + int(m.group(2)) * 60 + float(m.group(3)) if m else None


def read(path):
    with open(path, errors="replace") as f:
        return f.read().splitlines()


def job(run_dir):
    """(evaluations as [(seconds since the server listened, perplexity)], {trainer: blocked})."""
    start = next((seconds(line) for line in read(os.path.join(run_dir, "server.log"))
                  if "listening on" in line), None)
    if start is None:
        sys.exit(f"demo_compare: no start in {run_dir}/server.log")
    evals = []
    for line in read(os.path.join(run_dir, "evaluator.log")):
        m = re.search(r"eval version \d+: loss ([0-9.]+)", line)
        if m and seconds(line) is not None:
            t = seconds(line) - start
            evals.append((t + 86400 if t < 0 else t, math.exp(float(m.group(1)))))
    blocked = {}
    for trainer in TRAINERS:
        for line in read(os.path.join(run_dir, trainer + ".log")):
            m = re.search(r"summary:.*blocked_on_network=([0-9.]+)", line)
            if m:
                blocked[trainer] = float(m.group(1))
    return evals, blocked


def time_to(evals, target):
    return next((t for t, ppl in evals if ppl <= target + 1e-9), None)


def main():
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    jobs = {"async": job(sys.argv[1]), "sync": job(sys.argv[2])}
    if not all(evals for evals, _ in jobs.values()):
        sys.exit("demo_compare: a job has no evaluations")
    best = {mode: min(ppl for _, ppl in evals) for mode, (evals, _) in jobs.items()}
    target = max(best.values())
    print(f"target: held-out perplexity {target:.2f} (the best both jobs reached)")
    times = {}
    for mode, label in (("async", "async Delayed Nesterov + DyLU"), ("sync", "sync DiLoCo")):
        evals, blocked = jobs[mode]
        times[mode] = time_to(evals, target)
        shares = ", ".join(f"{t} {100 * blocked[t]:.0f}%" for t in TRAINERS if t in blocked)
        print(f"{label:30s} reached it after {times[mode]:6.1f} s; "
              f"blocked on the network: {shares or 'no summary'}")
    a, s = times["async"], times["sync"]
    blocked_a = jobs["async"][1].get("worker-fast")
    blocked_s = jobs["sync"][1].get("worker-fast")
    fast = (f"; worker-fast blocked {100 * blocked_a:.0f}% vs {100 * blocked_s:.0f}%"
            if blocked_a is not None and blocked_s is not None else "")
    if a <= s:
        print(f"comparison: async reached perplexity {target:.2f} {s / max(a, 1e-9):.1f}x sooner "
              f"than sync DiLoCo ({a:.0f} s vs {s:.0f} s){fast}")
    else:
        print(f"comparison: sync DiLoCo reached perplexity {target:.2f} {a / max(s, 1e-9):.1f}x "
              f"sooner than async ({s:.0f} s vs {a:.0f} s){fast}")


if __name__ == "__main__":
    main()
