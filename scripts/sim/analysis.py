"""Per-run metrics from an aloe-sim style CSV (see backends.CSV_HEADER), and the cross-run ones
(throughput retention, time to a target perplexity).

Definitions (also in --help and the README):
- local_steps: steps of every pushed update (applied, accepted or rejected), as aloe-sim counts
  them for --max_local_steps; the x axis of 'perplexity vs local updates'.
- steps_per_second (system throughput): local steps of the updates applied in the time window
  (first outer step, last outer step], divided by the window's length. Measuring between two
  outer steps makes a sync run exact (whole rounds) and keeps partial work in flight at the end
  out of both numerator and denominator. tokens_per_second = steps_per_second x batch x seq_len.
- capacity: steps/s all present workers could do together (sum of speeds; time-averaged over
  presence for elastic runs); utilization = steps_per_second / capacity.
- throughput_retention: steps_per_second / that of the same policy's no-straggler run (lag 0,
  p = 0, or heterogeneity 'no'); paper 000 Table 6 reports this ratio per method.
- staleness: versions applied between an update's base version and its own outer step.
- tail_perplexity: mean perplexity of the evaluations in the last 10% of the local steps.
- perplexity: exp(eval loss) (a real perplexity for the torch trainer; a monotone transform of
  the quadratic loss for the synthetic one).
"""

import csv
import math


def read_rows(path):
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def _num(x):
    return float(x) if x not in ("", None) else None


def run_metrics(rows, capacity, tokens_per_step):
    """Metrics of one run from its CSV rows."""
    pushes = [r for r in rows if r["outcome"] in ("applied", "accepted", "rejected")]
    local_steps = sum(int(r["steps"]) for r in pushes)
    versions = max((int(r["version"]) for r in rows), default=0)
    # Outer steps: rows after which the version grew (applied pushes, or eval rows of versions
    # completed by a leave / lease expiry).
    step_idx = []
    last_version = 0
    for i, r in enumerate(rows):
        v = int(r["version"])
        if v > last_version:
            step_idx.append(i)
            last_version = v
    applied_steps = 0
    if step_idx:
        applied_steps = sum(int(r["steps"]) for r in rows[:step_idx[-1] + 1]
                            if r["outcome"] in ("applied", "accepted"))
    sps = None
    if len(step_idx) >= 2:
        a, b = step_idx[0], step_idx[-1]
        t_a, t_b = float(rows[a]["virtual_time"]), float(rows[b]["virtual_time"])
        # By time, not row: several pushes may land at t_a (one grace window); all of them
        # belong to the instant that opens the window and none is counted.
        window_steps = sum(int(r["steps"]) for r in rows[a + 1:b + 1]
                           if r["outcome"] in ("applied", "accepted")
                           and float(r["virtual_time"]) > t_a)
        if t_b > t_a:
            sps = window_steps / (t_b - t_a)
    if sps is None and step_idx:
        t_b = float(rows[step_idx[-1]]["virtual_time"])
        sps = applied_steps / t_b if t_b > 0 else None
    staleness = sorted(int(r["staleness"]) for r in pushes
                       if r["outcome"] in ("applied", "accepted") and r["staleness"] != "")
    evals = [(float(r["virtual_time"]), int(r["version"]), float(r["eval_loss"]))
             for r in rows if r["eval_loss"] not in ("", None)]
    final_loss = evals[-1][2] if evals else None
    # Mean perplexity over the evaluations of the last 10% of the local steps: single held-out
    # evaluations of a small model move by a few percent from one version to the next.
    points = curve(rows)
    tail = [math.exp(min(p[3], 700)) for p in points if p[1] >= 0.9 * local_steps]
    out = {
        "virtual_seconds": float(rows[-1]["virtual_time"]) if rows else 0.0,
        "versions": versions,
        "local_steps": local_steps,
        "applied_steps": applied_steps,
        "updates": sum(1 for r in pushes if r["outcome"] in ("applied", "accepted")),
        "rejected": sum(1 for r in pushes if r["outcome"] == "rejected"),
        "final_eval_loss": final_loss,
        "final_perplexity": _exp(final_loss),
        "tail_perplexity": sum(tail) / len(tail) if tail else None,
        "steps_per_second": sps,
        "tokens_per_second": sps * tokens_per_step if sps is not None else None,
        "capacity_steps_per_second": capacity,
        "utilization": sps / capacity if sps is not None and capacity else None,
        "staleness_mean": sum(staleness) / len(staleness) if staleness else None,
        "staleness_p50": _quantile(staleness, 0.5),
        "staleness_p90": _quantile(staleness, 0.9),
        "staleness_max": staleness[-1] if staleness else None,
    }
    return out


def curve(rows):
    """Evaluation points: [(virtual_time, local_steps so far, version, eval_loss)]."""
    points = []
    steps = 0
    for r in rows:
        if r["outcome"] in ("applied", "accepted", "rejected"):
            steps += int(r["steps"])
        if r["eval_loss"] not in ("", None):
            points.append((float(r["virtual_time"]), steps, int(r["version"]),
                           float(r["eval_loss"])))
    return points


def staleness_histogram(rows):
    hist = {}
    for r in rows:
        if r["outcome"] in ("applied", "accepted") and r["staleness"] != "":
            s = int(r["staleness"])
            hist[s] = hist.get(s, 0) + 1
    return dict(sorted(hist.items()))


def phase_throughput(rows, phases, speeds=None):
    """Elastic runs: [(start, end, workers, steps_per_second, utilization)] per phase: the local
    steps of updates that were applied (an accepted push counts once its round completes),
    divided by the phase length. With `speeds` (steps/s per worker) each update's steps are
    spread over the time they were computed, [push - steps / speed, push], so a round that
    straddles a boundary is shared by both phases; without, they count at the push time.
    Utilization = steps_per_second / (workers x 1 step/s)."""
    done = []  # (push time, steps, worker) of updates that were applied
    pending = []
    last_version = 0
    for r in rows:
        v = int(r["version"])
        if r["outcome"] in ("accepted", "applied"):
            pending.append((float(r["virtual_time"]), int(r["steps"]), int(r["worker"])))
        if v > last_version:
            done += pending
            pending = []
            last_version = v
    out = []
    for start, end, workers in phases:
        steps = 0.0
        for t, n, w in done:
            if speeds:
                t0 = t - n / speeds[w]
                overlap = max(0.0, min(t, end) - max(t0, start))
                steps += n * overlap / (t - t0) if t > t0 else 0.0
            elif start <= t < end:
                steps += n
        sps = steps / (end - start)
        out.append((start, end, workers, sps, sps / workers))
    return out


def time_to_target(points, target_loss):
    for t, _, _, loss in points:
        if loss <= target_loss + 1e-12:
            return t
    return None


def _exp(x):
    if x is None:
        return None
    try:
        return math.exp(x)
    except OverflowError:
        return float("inf")


def _quantile(sorted_values, q):
    if not sorted_values:
        return None
    i = min(len(sorted_values) - 1, max(0, int(math.ceil(q * len(sorted_values))) - 1))
    return sorted_values[i]
