"""scripts/soak: the command line (see --help)."""

import argparse
import glob
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

from . import checks
from . import cluster
from . import runner
from . import schedule as S

ROOT = cluster.ROOT

DESCRIPTION = """A chaos soak of a whole ALOE job on loopback: a coordinator with two shard
processes (scenario "sharded", with --order_journal) or one single-process server (scenario
"single"), real aloe-worker trainers and an evaluator on a tiny model and a small corpus made from
docs/*.md, and a seeded schedule of faults:

  worker_kill         SIGKILL a trainer, start it again 0.2-1 s later
  worker_freeze       SIGSTOP a trainer for longer than the lease, then SIGCONT
  link_cut            reset every connection crossing the link emulator (aloe-linkemu carries
                      the trainers' traffic to shard 0, or to the single server)
  link_stall          hold every byte in the link emulator for 1-3 s
  shard_kill          SIGKILL a shard process, restart it with --resume 1-2.4 s later
  coordinator_kill    SIGKILL the coordinator, restart it with --resume
  server_kill         (single) SIGKILL the server, restart it with --resume
  drain               SIGTERM the coordinator/server (graceful drain), restart it with --resume
  corrupt_checkpoint  SIGKILL a shard process (the server in "single"), truncate or flip a byte
                      of its newest checkpoint, restart it with --resume: it must fall back
  disk_full           fill the checkpoint directory (a tmpfs of its own: needs root) for 3-5 s
  bad_token           a worker with a wrong access token tries to join: must be refused
  wrong_model         a worker with another model (--torchscript, made with python3-torch)
                      tries to join: must be refused

Each scenario first runs without faults (the goodput baseline), then with the schedule. At the
end of every run the invariants are printed PASS/FAIL/SKIP with their figures, then per fault
kind the count, the recovery time (fault, or the restart of what it took away, to the next
committed version, from 0.25 s /metrics scrapes) median/max, the updates lost, and the goodput
(tokens of committed updates per second) against the baseline. Exit status 1 when an invariant
fails. Results: OUT/<scenario>/{faulted,baseline}/ (logs, journal, checkpoints) and
OUT/results.json."""


def parse(argv):
    p = argparse.ArgumentParser(prog="scripts/soak", description=DESCRIPTION,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--scenario", choices=["sharded", "single", "both"], default="both")
    p.add_argument("--seed", type=int, default=1, help="seed of the fault schedule and the job")
    p.add_argument("--seconds", type=float, default=90,
                   help="trainers' run time of each faulted run (default 90)")
    p.add_argument("--baseline-seconds", type=float, default=None,
                   help="run time of each fault-free baseline (default: --seconds; 0 = none)")
    p.add_argument("--trainers", type=int, default=3, help="aloe-worker trainers (default 3)")
    p.add_argument("--worker-kills", type=int, default=8)
    p.add_argument("--server-kills", type=int, default=4,
                   help="server processes taken away (kills, drains, damaged checkpoints)")
    p.add_argument("--others", type=int, default=1,
                   help="faults of every other kind (freeze, cut, stall, disk full, bad token, "
                        "wrong model)")
    p.add_argument("--only", default="",
                   help="comma-separated fault kinds: play only these (e.g. shard_kill with "
                        "--shard-down 2.4 --worker-kills 0 is the operator's scenario)")
    p.add_argument("--shard-down", type=float, default=None,
                   help="seconds a killed shard process stays down (default: drawn in 1-2.4)")
    p.add_argument("--quick", action="store_true",
                   help="the CI run (under 3 minutes): both scenarios, short runs, every fault "
                        "kind at least once in the sharded one")
    p.add_argument("--full", action="store_true",
                   help="the long run: 110 worker kills and 10 server-side kills in the sharded "
                        "scenario (about 9 minutes)")
    p.add_argument("--bin-dir", default=os.path.join(ROOT, "build", "bin"))
    p.add_argument("--out", default=None,
                   help="results directory (default: a temporary one, removed when every "
                        "invariant passed)")
    p.add_argument("--keep", action="store_true", help="keep --out's default directory")
    return p.parse_args(argv)


def plans(a):
    """[(scenario, seconds, baseline seconds, counts)] of the runs to make."""
    if a.quick:
        sharded = {S.WORKER_KILL: 5, S.WORKER_FREEZE: 1, S.LINK_CUT: 1, S.LINK_STALL: 1,
                   S.SHARD_KILL: 1, S.COORDINATOR_KILL: 1, S.DRAIN: 1, S.CORRUPT_CHECKPOINT: 1,
                   S.DISK_FULL: 1, S.BAD_TOKEN: 1, S.WRONG_MODEL: 1}
        single = {S.WORKER_KILL: 2, S.SERVER_KILL: 1, S.CORRUPT_CHECKPOINT: 1, S.LINK_CUT: 1}
        return [("sharded", 60, 25, sharded), ("single", 32, 0, single)]
    if a.full:
        scen = ["sharded"] if a.scenario != "single" else ["single"]
        if a.scenario == "both":
            scen = ["sharded", "single"]
        return [(s, 480, 120, S.counts_for(s, 110, 10, 4)) for s in scen]
    scen = ["sharded", "single"] if a.scenario == "both" else [a.scenario]
    base = a.seconds if a.baseline_seconds is None else a.baseline_seconds
    only = {k for k in a.only.split(",") if k}
    return [(s, a.seconds, base, S.counts_for(s, a.worker_kills, a.server_kills, a.others, only))
            for s in scen]


def make_corpus(bin_dir, work):
    text = os.path.join(work, "text")
    os.makedirs(text, exist_ok=True)
    for doc in sorted(glob.glob(os.path.join(ROOT, "docs", "*.md"))):
        shutil.copy(doc, os.path.join(text, os.path.basename(doc)[:-3] + ".txt"))
    corpus = os.path.join(work, "corpus")
    subprocess.run([os.path.join(bin_dir, "aloe-corpus"), f"--input_dir={text}",
                    f"--output_dir={corpus}"], check=True, stdout=subprocess.DEVNULL)
    return corpus


def start_wrong_model(work):
    """Starts writing a TorchScript model of another architecture (python3-torch); returns the
    process and the path, or (None, None) without the script."""
    script = os.path.join(ROOT, "tests", "integration", "make_torchscript_models.py")
    if not os.path.exists(script):
        return None, None
    out = os.path.join(work, "models")
    os.makedirs(out, exist_ok=True)
    proc = subprocess.Popen(["/usr/bin/python3", script, out], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    return proc, os.path.join(out, "loss.pt")


def one_run(a, work, corpus, scenario, seconds, counts, name, wrong_model):
    opts = runner.RunOptions(scenario=scenario, seed=a.seed, trainers=a.trainers,
                             seconds=seconds, counts=counts)
    run = runner.Run(a.bin_dir, corpus, os.path.join(work, scenario, name), opts,
                     wrong_model=wrong_model)
    run.record = scenario == "sharded" and os.access(os.path.join(a.bin_dir, "aloe-replay"),
                                                     os.X_OK)
    faults = []
    if counts:
        fault_end = seconds * (1 - opts.quiet_tail)
        try:
            faults = S.make(a.seed, scenario, opts.warmup, fault_end, a.trainers, 2, counts,
                            opts.lease, opts.server_gap, a.shard_down)
        except ValueError as e:
            sys.exit(f"scripts/soak: {e}: raise --seconds or lower --server-kills")
        print(f"{scenario}/{name}: {len(faults)} faults in [{opts.warmup:.0f}, "
              f"{fault_end:.0f}) s of a {seconds:.0f} s run (seed {a.seed})")
    else:
        print(f"{scenario}/{name}: {seconds:.0f} s without faults")
    sys.stdout.flush()
    run.prepare()
    try:
        run.start()
        run.play(faults)
        stopped = run.stop()
    finally:
        run.cleanup()
    return run, stopped


def report(run, stopped, baseline_goodput):
    results, hist = checks.check(run, run.bin, stopped)
    kinds, updates, goodput = checks.figures(run, hist, run.t_stop)
    for r in results:
        print("  " + r.line())
    print(f"  {'fault kind':20} {'count':>5} {'skip':>4} {'recovery median/max s':>22} "
          f"{'no recovery':>11} {'updates lost':>12}")
    for kind, k in sorted(kinds.items()):
        rec = k["recovery"]
        rs = (f"{checks._median(rec):.2f} / {max(rec):.2f}" if rec else "-")
        print(f"  {kind:20} {k['count']:5} {k['skipped']:4} {rs:>22} {k['unrecovered']:11} "
              f"{k['lost']:12}")
    for kind, k in sorted(kinds.items()):
        if k["calls_per_s"]:
            print(f"  while a server process was away ({kind}): trainers retried "
                  f"{max(k['calls_per_s']):.1f} calls/s at most (all trainers), one trainer "
                  f"logged {max(k['lines_per_s']):.1f} lines/s at most")
    ratio = f" = {goodput / baseline_goodput:.2f} x the fault-free run's " \
            f"{baseline_goodput:.0f}" if baseline_goodput else ""
    print(f"  goodput: {updates} committed updates, {goodput:.0f} tokens learned/s over "
          f"{run.t_stop:.0f} s{ratio}")
    return {"invariants": [r.__dict__ for r in results], "kinds": kinds, "updates": updates,
            "goodput": goodput, "baseline_goodput": baseline_goodput,
            "faults": run.fault_log, "seconds": run.t_stop}


def main(argv=None):
    a = parse(sys.argv[1:] if argv is None else argv)
    for b in ("aloe-server", "aloe-worker", "aloe-linkemu", "aloe-corpus"):
        if not os.access(os.path.join(a.bin_dir, b), os.X_OK):
            print(f"{os.path.join(a.bin_dir, b)} not found: build it first (cmake --build build "
                  f"--target aloe-server aloe-worker aloe-linkemu aloe-corpus aloe-replay)",
                  file=sys.stderr)
            return 2
    if not os.access(os.path.join(a.bin_dir, "aloe-replay"), os.X_OK):
        print(f"note: {a.bin_dir}/aloe-replay not found: the replay invariant is skipped")
    work = a.out or tempfile.mkdtemp(prefix="aloe-soak-")
    os.makedirs(work, exist_ok=True)
    start = time.monotonic()
    corpus = make_corpus(a.bin_dir, work)
    model_proc, wrong_model = start_wrong_model(work)
    # Each checkpointed update is local_steps * batch_size * seq_len tokens (runner.CONFIG).
    checks.TOKENS_PER_UPDATE = 8 * 4 * 32
    summary = {}
    failed = False
    for scenario, seconds, base_seconds, counts in plans(a):
        baseline = 0
        if base_seconds:
            run, stopped = one_run(a, work, corpus, scenario, base_seconds, {}, "baseline", None)
            _, _, baseline = checks.figures(run, checks.check(run, a.bin_dir, stopped)[1],
                                            run.t_stop)
            print(f"  goodput without faults: {baseline:.0f} tokens learned/s")
        if model_proc is not None:
            model_proc.wait()
            if model_proc.returncode != 0 or not os.path.exists(wrong_model):
                wrong_model = None
            model_proc = None
        run, stopped = one_run(a, work, corpus, scenario, seconds, counts, "faulted",
                               wrong_model)
        summary[scenario] = report(run, stopped, baseline)
        failed |= any(r["status"] == "FAIL" for r in summary[scenario]["invariants"])
    with open(os.path.join(work, "results.json"), "w") as f:
        json.dump(summary, f, indent=1, default=str)
    print(f"soak {'FAILED' if failed else 'passed'} in {time.monotonic() - start:.0f} s; "
          f"results in {work}")
    if not failed and a.out is None and not a.keep:
        shutil.rmtree(work, ignore_errors=True)
    return 1 if failed else 0
