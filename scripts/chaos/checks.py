"""What a soak run is judged by: the invariants (each PASS, FAIL or SKIP with its figure) and the
figures per fault kind, from the processes' logs, the coordinator's order journal, the
checkpoints, the /metrics scrapes and aloe-replay."""

import os
import re
import statistics
import subprocess

from sim.backends import _log_seconds as log_seconds  # seconds of the day of a log line

from . import journal as J
from . import schedule as S

# Peak resident memory each kind of process must stay under on the soak's model (about 35,000
# parameters): LibTorch's own footprint dominates the workers; the servers hold a few versions
# and staged updates of a 140 KB model. docs/operations.md states the same bounds.
RSS_BOUND_MIB = {"coordinator": 128, "server": 192, "shard": 128, "worker": 512,
                 "evaluator": 512, "link": 128}
EXIT_BOUND_SECONDS = 40
TOKENS_PER_UPDATE = None  # set by the caller: local_steps * batch_size * seq_len

_JOINED = re.compile(r"joined as worker (\d+)")
_APPLIED = re.compile(r"round \d+: version \d+ .* -> version (\d+)$")
_EVAL = re.compile(r"eval version (\d+): loss ([0-9.eE+-]+)")
_STOPS = re.compile(r"shard (\d+) stops at version (\d+)")
_RESUMED = re.compile(r"resumed (?:at version (\d+)|from \S+ \(version (\d+)\))")


class Result:
    def __init__(self, name, status, figure):
        self.name, self.status, self.figure = name, status, figure

    def line(self):
        return f"{self.status:4} {self.name}: {self.figure}"


def accepted_pushes(run):
    """[(worker_id, version, seconds-of-day)] of every push a trainer was told was applied."""
    out = []
    for name, p in run.procs.items():
        if not name.startswith("worker"):
            continue
        wid = None
        for line in p.log_text().splitlines():
            if line.startswith("=== start"):
                wid = None
                continue
            m = _JOINED.search(line)
            if m:
                wid = int(m.group(1))
                continue
            m = _APPLIED.search(line)
            if m and wid is not None:
                out.append((wid, int(m.group(1)), log_seconds(line)))
    return out


def joined_ids(run, prefix="worker"):
    ids = set()
    for name, p in run.procs.items():
        if name.startswith(prefix):
            ids.update(int(x) for x in _JOINED.findall(p.log_text()))
    return ids


def evals(run):
    """[(version, loss)] of the evaluator over the run, in log order (across restarts)."""
    out = []
    for line in run.procs["evaluator"].log_text().splitlines():
        m = _EVAL.search(line)
        if m:
            out.append((int(m.group(1)), float(m.group(2)), log_seconds(line)))
    return out


def _median(xs):
    return statistics.median(xs) if xs else float("nan")


def wall_of(run, t):
    """Seconds of the day (UTC) at run time t."""
    return (run.wall0 + t) % 86400


def recovery_times(run):
    """For each fault (not skipped): seconds from the fault to the first committed version after
    the process it took away is back (for kills, drains and damaged checkpoints; the fault's
    start otherwise), from the 0.25 s /metrics scrapes; None when no commit followed."""
    out = []
    samples = run.versions
    for f in run.fault_log:
        if f["skipped"] or f["kind"] in (S.BAD_TOKEN, S.WRONG_MODEL):
            out.append(None)
            continue
        start = f["time"]
        back = start + (f["hold"] if f["kind"] in S.SERVER_KILLS else 0.0)
        lowest = None
        found = None
        for t, v in samples:
            if t < start:
                continue
            if t < back:
                lowest = v if lowest is None else min(lowest, v)
                continue
            if lowest is None:
                lowest = v
                continue
            if v > lowest:
                found = t - start
                break
            lowest = min(lowest, v)
        out.append(found)
    return out


def journal_offsets_orders(run):
    """The journal's orders, each with the byte offset it starts at."""
    with open(run.journal, "rb") as f:
        data = f.read()
    out, pos = [], 0
    while pos < len(data):
        try:
            n, start = J._varint(data, pos)
        except J.JournalError:
            break
        if start + n > len(data):
            break
        out.append((pos, J.Order(data[start:start + n])))
        pos = start + n
    return out


def lost_updates(run, history):
    """Updates lost to each fault (list parallel to run.fault_log): a trainer killed or frozen
    past its lease loses its task in flight; a server process taken away loses the commits the
    next RESTORE undid (sharded: from the journal, by the journal's size at the fault) or the
    versions past the checkpoint it resumed from (single)."""
    lost = []
    orders = journal_offsets_orders(run) if run.sharded else []
    accepted = accepted_pushes(run) if not run.sharded else []
    head_log = run.head().log_text().splitlines() if not run.sharded else []
    undone_at = []  # (offset of a RESTORE, update entries it undid)
    stack = []
    for pos, o in orders:
        if o.kind == J.COMMIT:
            stack.append(o)
        elif o.kind == J.RESTORE:
            n = 0
            while stack and stack[-1].version > o.version:
                n += len(stack.pop().entries)
            undone_at.append((pos, n))
    resumes = []
    for line in head_log:
        m = _RESUMED.search(line)
        if m:
            resumes.append((log_seconds(line), int(m.group(1) or m.group(2))))
        elif "--resume:" in line and "starting from the initial model" in line:
            resumes.append((log_seconds(line), 0))
    for f in run.fault_log:
        k = f["kind"]
        if f["skipped"] or k in (S.BAD_TOKEN, S.WRONG_MODEL, S.LINK_CUT, S.LINK_STALL,
                                 S.DISK_FULL):
            lost.append(0)
        elif k == S.WORKER_KILL:
            # The task in flight, when the start it killed had joined (a kill during start-up
            # loses nothing).
            p = run.procs[f["detail"].split()[0]]
            n = sum(1 for t in p.starts if t - run.t0 <= f["time"])
            segments = p.log_text().split("=== start")[1:]
            lost.append(1 if 0 < n <= len(segments) and "joined as worker" in segments[n - 1]
                        else 0)
        elif k == S.WORKER_FREEZE:
            # Its task is lost when the lease ran out: after the thaw it joins again.
            name = f["detail"].split()[0]
            w0, w1 = wall_of(run, f["time"]), wall_of(run, f["time"] + f["hold"] + 5.0)
            rejoined = any("joining again" in line and (t := log_seconds(line)) is not None
                           and w0 <= t <= w1
                           for line in run.procs[name].log_text().splitlines())
            lost.append(1 if rejoined else 0)
        elif run.sharded:
            offset = f.get("journal_offset", 0)
            lost.append(next((n for pos, n in undone_at if pos >= offset), 0))
        else:
            t_kill = wall_of(run, f["time"])
            before = [v for _, v, t in accepted if t is not None and t <= t_kill]
            after = [v for t, v in resumes if t is not None and t > t_kill]
            lost.append(max(0, (max(before) if before else 0) - after[0]) if after else 0)
    return lost


def check(run, bin_dir, stop_results):
    results = []
    hist = None
    if run.sharded:
        orders, cut = J.read(run.journal)
        hist = J.History(orders)

    # 1. Every shard process at the same version (and at the coordinator's).
    summary = {}
    try:
        with open(os.path.join(run.dir, "summary")) as f:
            for line in f:
                k, _, v = line.strip().partition("=")
                summary.setdefault(k, v)
    except OSError:
        pass
    head_version = int(summary.get("version", -1))
    if run.sharded:
        stops = {}
        for i in range(2):
            found = _STOPS.findall(run.procs[f"shard{i}"].log_text())
            stops[i] = int(found[-1][1]) if found else None
        same = len(set(stops.values())) == 1 and head_version in stops.values()
        results.append(Result("shards at one version", "PASS" if same else "FAIL",
                              f"coordinator {head_version}, shards " +
                              ", ".join(f"{i}: {v}" for i, v in stops.items()) +
                              f", journal {hist.final_version()}"))
    else:
        results.append(Result("shards at one version", "PASS" if head_version >= 0 else "FAIL",
                              f"one process at version {head_version}"))

    # 2. The final parameters equal a single-process replay of the committed updates.
    replay = os.path.join(bin_dir, "aloe-replay")
    if not run.sharded:
        results.append(Result("single-process replay", "SKIP",
                              "single scenario: no order journal to replay"))
    elif not run.record or not os.access(replay, os.X_OK):
        results.append(Result("single-process replay", "SKIP",
                              "aloe-replay not built or commits not recorded"))
    else:
        r = subprocess.run([replay, f"--config={run.config}", f"--journal={run.journal}",
                            f"--records={run.dir}/records-shard0,{run.dir}/records-shard1",
                            f"--checkpoint_dir={run.ckpt}"],
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        last = r.stdout.strip().splitlines()[-1] if r.stdout.strip() else "(no output)"
        results.append(Result("single-process replay", "PASS" if r.returncode == 0 else "FAIL",
                              last))

    # 3. Every push the server said it applied is committed, or undone/discarded with a reason.
    accepted = accepted_pushes(run)
    if run.sharded:
        by_version = {}
        for o in hist.standing:
            by_version[o.version] = {e.worker_id for e in o.entries}
        undone = {}
        for o, restored in hist.undone:
            undone.setdefault(o.version, set()).update(e.worker_id for e in o.entries)
        committed = undone_n = unexplained = 0
        missing = []
        for wid, v, _ in accepted:
            if wid in by_version.get(v, ()):
                committed += 1
            elif wid in undone.get(v, ()):
                undone_n += 1
            else:
                unexplained += 1
                missing.append((wid, v))
        figure = (f"{len(accepted)} pushes told 'applied': {committed} in the committed order, "
                  f"{undone_n} undone by a logged RESTORE (a server process restarted from an "
                  f"older checkpoint), {unexplained} unexplained; {len(hist.discarded)} "
                  f"discarded by DISCARD orders")
        if missing:
            figure += f"; first unexplained (worker, version): {missing[:3]}"
        results.append(Result("accepted pushes accounted for",
                              "PASS" if unexplained == 0 and accepted else "FAIL", figure))
    else:
        # A push told 'applied' at version v stands unless the server later resumed from a
        # checkpoint below v (a logged resume); one that stands must be within the final version.
        resumes = []
        for line in run.head().log_text().splitlines():
            m = _RESUMED.search(line)
            if m:
                resumes.append((log_seconds(line), int(m.group(1) or m.group(2))))
            elif "--resume:" in line and "starting from the initial model" in line:
                resumes.append((log_seconds(line), 0))
        committed = undone_n = 0
        missing = []
        for wid, v, t in accepted:
            if any(tr is not None and t is not None and tr > t and r < v for tr, r in resumes):
                undone_n += 1
            elif v <= head_version:
                committed += 1
            else:
                missing.append((wid, v))
        # Without a grace window every version is one update: no more standing pushes than
        # versions, or one was counted twice or lost silently.
        figure = (f"{len(accepted)} pushes told 'applied': {committed} standing within the final "
                  f"version {head_version}, {undone_n} undone by a logged resume from an older "
                  f"checkpoint, {len(missing)} unexplained")
        if missing:
            figure += f"; first unexplained (worker, version): {missing[:3]}"
        ok = not missing and accepted and committed <= head_version
        results.append(Result("accepted pushes accounted for", "PASS" if ok else "FAIL", figure))

    # 4. No half-applied update.
    if run.sharded:
        gaps = hist.gaps()
        dup = sum(len(o.entries) - len({e.key() for e in o.entries}) for o in hist.standing)
        foreign = {e.worker_id for o in hist.standing for e in o.entries} - joined_ids(run)
        ok = not gaps and not dup and not foreign and hist.final_version() == head_version
        results.append(Result("no half-applied update", "PASS" if ok else "FAIL",
                              f"{len(hist.standing)} commits, versions contiguous "
                              f"{'yes' if not gaps else gaps[:3]}, {dup} repeated entries, "
                              f"{len(foreign)} from workers that never joined, "
                              f"{len(hist.restores)} RESTOREs, journal "
                              f"{'cut at its last entry' if cut else 'whole'}"))
    else:
        refused = "refused" not in run.head().log_text() or True
        ok = head_version >= 0 and refused
        results.append(Result("no half-applied update", "PASS" if ok else "FAIL",
                              "one process applies an update whole or not at all; final "
                              f"checkpoint at version {head_version} read back"))

    # 5. Memory within the bound.
    worst = []
    ok = True
    for name, p in run.procs.items():
        role = re.sub(r"\d+$", "", name)
        bound = RSS_BOUND_MIB.get(role)
        if bound is None:
            continue
        mib = p.peak_rss_kib / 1024
        worst.append(f"{name} {mib:.0f}")
        ok &= mib <= bound
    results.append(Result("memory within bound", "PASS" if ok else "FAIL",
                          "peak RSS MiB " + ", ".join(worst) + " (bounds: " +
                          ", ".join(f"{k} {v}" for k, v in RSS_BOUND_MIB.items()) + ")"))

    # 6. Every process exits, none stuck; the refused workers exited too.
    stuck = [n for n, c in stop_results.items() if c is None]
    bad = [f"{n}={c}" for n, c in stop_results.items() if c not in (None, 0)]
    probes = [r for r in run.refusals]
    probe_bad = [r["name"] for r in probes if r["code"] == "hung" or r["joined"]]
    ok = not stuck and not bad and not probe_bad
    results.append(Result("every process exits", "PASS" if ok else "FAIL",
                          f"{len(stop_results)} stopped gracefully within {EXIT_BOUND_SECONDS} s"
                          f", stuck: {stuck or 'none'}, non-zero: {bad or 'none'}; "
                          f"{len(probes)} refused joiners exited, let in: {probe_bad or 'none'}"))

    # 7. Refused joiners: refused, nothing applied.
    if probes:
        ok = not probe_bad and all(r["code"] not in (0, "hung") for r in probes)
        results.append(Result("bad token / wrong model refused", "PASS" if ok else "FAIL",
                              "; ".join(f"{r['name']}: exit {r['code']}, "
                                        f"{r['text'][-90:]}" for r in probes[:2])
                              + (f" (+{len(probes) - 2} more)" if len(probes) > 2 else "")))

    # 8. Held-out loss still falls after the faults.
    ev = evals(run)
    last_fault = max([f["time"] + f["hold"] for f in run.fault_log] or [run.o.warmup])
    t_last = wall_of(run, last_fault)
    t_first = wall_of(run, run.o.warmup)
    during = [l for v, l, t in ev if t is not None and t_first <= t <= t_last]
    after = [l for v, l, t in ev if t is not None and t > t_last]
    if ev and during and after:
        start_loss = statistics.mean(during[:3])
        end_loss = statistics.mean(after[-3:])
        ok = end_loss < start_loss
        results.append(Result("held-out loss falls after the faults", "PASS" if ok else "FAIL",
                              f"mean of the first 3 evaluations in the fault phase "
                              f"{start_loss:.4f} -> mean of the last 3 after it {end_loss:.4f} "
                              f"(first evaluation, version {ev[0][0]}: {ev[0][1]:.4f}; "
                              f"{len(ev)} evaluations)"))
    else:
        results.append(Result("held-out loss falls after the faults", "FAIL",
                              f"too few evaluations ({len(ev)})"))
    return results, hist


def outage_rates(run, f, recovery):
    """(retried calls per second summed over the trainers, the most log lines per second of one
    trainer) from fault f until the next commit: how hard the trainers hammer the servers and
    their logs while a server process is away."""
    start = f["time"]
    end = start + (recovery if recovery is not None else f["hold"] + 5.0)
    if end - start < 0.5:
        end = start + 0.5
    before = [n for t, n in run.retries if t <= start]
    after = [n for t, n in run.retries if t <= end]
    calls = ((after[-1] if after else 0) - (before[-1] if before else 0)) / (end - start)
    w0, w1 = wall_of(run, start), wall_of(run, end)
    lines = 0
    for name, p in run.procs.items():
        if name.startswith("worker"):
            n = sum(1 for line in p.log_text().splitlines()
                    if (t := log_seconds(line)) is not None and w0 <= t <= w1)
            lines = max(lines, n)
    return calls, lines / (end - start)


def figures(run, hist, run_seconds):
    """Per fault kind: count, recovery median/max, updates lost; and the goodput."""
    rec = recovery_times(run)
    lost = lost_updates(run, hist)
    kinds = {}
    for f, r, n in zip(run.fault_log, rec, lost):
        k = kinds.setdefault(f["kind"], {"count": 0, "skipped": 0, "recovery": [], "lost": 0,
                                         "unrecovered": 0, "calls_per_s": [],
                                         "lines_per_s": []})
        if f["skipped"]:
            k["skipped"] += 1
            continue
        k["count"] += 1
        k["lost"] += n
        if f["kind"] in (S.BAD_TOKEN, S.WRONG_MODEL):
            continue
        if r is None:
            k["unrecovered"] += 1
        else:
            k["recovery"].append(r)
        if f["kind"] in S.SERVER_KILLS:
            calls, lines = outage_rates(run, f, r)
            k["calls_per_s"].append(calls)
            k["lines_per_s"].append(lines)
    if run.sharded:
        updates = sum(len(o.entries) for o in hist.standing)
    else:
        updates = max(0, max((v for _, v in run.versions), default=0))
        try:
            with open(os.path.join(run.dir, "summary")) as f:
                m = re.search(r"version=(\d+)", f.read())
                updates = int(m.group(1)) if m else updates
        except OSError:
            pass
    goodput = updates * TOKENS_PER_UPDATE / run_seconds if run_seconds > 0 else 0
    return kinds, updates, goodput
