"""Command line, grid and runner of scripts/simulate-partial-sync (see HELP). The outputs are
written by partial_sync_report; configs, the aloe-sim back end and the run metrics come from the
straggler study's modules."""

import argparse
import concurrent.futures
import dataclasses
import datetime
import importlib.util
import math
import os
import re
import shlex
import subprocess
import sys
import time

from . import analysis
from . import backends
from . import cli
from . import grid
from . import partial_sync_report as report
from . import textproto

PROG = "scripts/simulate-partial-sync"

HELP = """\
Partial synchronization by layer group (docs/algorithms.md, "Partial synchronization") on
aloe-sim's network model: the model's layers are split into K groups and each group is pushed
at the local step its schedule names, instead of the whole model once per round. Writes CSV
files, PNG plots and summary.md, which checks two findings with numbers:
  (a) paper 003 Tables 1-2: PLSGD-ENP and DreamDDP beat full-model local SGD (K = 1) in
      wall-clock at the lowest bandwidth, with the same or better perplexity at equal local
      steps, and DreamDDP is at least as good as PLSGD-ENP;
  (b) Streaming DiLoCo: strided streaming with K groups stays within 2% of K = 1 in perplexity
      at equal local steps, with about K x lower peak upload bytes/s per worker.

Grid (default; --quick in brackets):
  policies   sync (sync DiLoCo: round barrier, outer Nesterov lr 0.7 beta 0.9) and
             async-dn-dylu (async Delayed Nesterov N = workers, DyLU, grace = half a step)
             [sync]; the straggler study's configs (deploy/configs/sim-small*.textproto)
  links      every worker's link: 10, 100, 1000 Mbit/s, 10 ms one way [10]
  K          1, 2, 4, 8 with the strided schedule (Streaming DiLoCo: merge after tau = 1 step,
             mixing alpha 0.5) [1, 2]; K = 1 is full-model local SGD (no partial_sync block)
  schedules  at K = 4 [2] also PLSGD-ENP and DreamDDP, both in place (tau 0, alpha 0: paper
             003), and under async DreamDDP with bubble filling (paper 003 Sec. 3.4)
  workers    4 workers at 20, 18.4, 14.4, 11 steps/s (the straggler study's 'slight' level x
             20; 0.05 s per step is about this small LM's step on one CPU core), H = 20, the
             same seed in every cell; every run stops at the same number of local steps
             (--steps, default 3200 [240]), so perplexity compares at equal steps. Equal speeds
             (--speeds 20,20,20,20) make async DN+DyLU repeat sync DiLoCo exactly: all four
             pushes land in one grace window and Delayed Nesterov's N = 4 buffer applies them
             as one step
  model      the straggler study's byte-level LM made deeper and thinner (d_model 64, 6
             blocks, ~0.34M parameters): embed + 6 blocks + head = 8 layers, so K = 8 groups
             exist (the study's 2-block model has 4 layers)
The model is 1.35 MB as float32: at 10 Mbit/s a K = 1 round's push and pull take 2.2 s, more
than its compute (1.0 s for the fastest worker, 1.8 s for the slowest); at 1000 Mbit/s 0.04 s.

Outputs in --out (default out/partial-sync):
  runs.csv     one row per cell: run_id status policy schedule groups fill_bubbles
               merge_delay_steps mixing_alpha link rate_mbit latency_ms peak_window workers
               step_seconds
               local_steps_h seed trainer stop_reason wall_seconds local_steps versions
               virtual_seconds final_eval_loss final_perplexity tail_perplexity target_loss
               target_perplexity time_to_target peak_up_bytes_per_second peak_up_max
               peak_down_max bytes_up_mean updates_mean utilization utilization_mean note
  curves.csv   run_id policy schedule groups fill_bubbles rate_mbit seed virtual_time
               local_steps version eval_loss perplexity (every evaluation)
  perplexity_vs_local_steps.png, perplexity_vs_time.png, peak_bandwidth_vs_k.png,
  utilization_vs_bandwidth.png, summary.md
  runs/<run_id>/   config.textproto, sim.csv, workers.csv, log.txt

Metrics: status ok | refused (aloe-sim rejected a K > 1 config) | rejected (it ran, but no
push was applied: e.g. whole-model pushes against a server with layer groups) | failed |
skipped (--max_minutes passed before it started); only ok runs have metrics. tail_perplexity = mean
perplexity of the evaluations in the last 10% of the local steps (what the findings use: single
evaluations of a small model move by a few percent). time_to_target = virtual seconds to the
first evaluation at or below target_loss = the policy's K = 1 final loss + ln(1.02) (2%
perplexity slack; --target_loss overrides). peak_up_bytes_per_second = each worker's most bytes
uploaded in any --peak_window (default one step time), divided by it (';' per worker);
utilization = compute seconds / present seconds per worker (aloe-sim --workers_out).
"""

# Deeper than deploy/configs/sim-small.textproto's model (same vocabulary, context, width ratio
# and optimizer) so that it has the 8 layers K = 8 groups need.
MODEL = "{ vocab_size: 256 seq_len: 64 d_model: 64 num_layers: 6 num_heads: 4 ffn_mult: 4 }"

SCHEDULES = {
    "full": None,  # K = 1: full-model local SGD, no partial_sync block
    "strided": "SYNC_SCHEDULE_STRIDED",
    "enp": "SYNC_SCHEDULE_EQUAL_NUMBER",
    "dreamddp": "SYNC_SCHEDULE_DREAMDDP",
}
POLICIES = ("sync", "async-dn-dylu")
# Steps/s of the 4 workers: the straggler study's 'slight' heterogeneity at 20 steps/s.
SPEEDS = tuple(round(20 * v, 6) for v in grid.LEVELS["slight"])


@dataclasses.dataclass
class Settings:
    policies: list
    groups: list  # K of the strided sweep
    rates: list  # Mbit/s per worker link, math.inf allowed
    latency_ms: float
    compare_k: int  # K of the ENP / DreamDDP cells; 0 or 1 = none
    steps: int  # local steps of every run
    speeds: list  # steps/s per worker
    local_steps: int = 20  # H
    merge_delay_steps: int = 1  # strided: tau
    mixing_alpha: float = 0.5  # strided: alpha
    peak_window: float = 0  # 0 = one step of the fastest worker
    trainer: str = "torch"

    def step_seconds(self):
        return 1.0 / max(self.speeds)

    def window(self):
        return self.peak_window or self.step_seconds()


def default_settings(quick):
    if quick:
        return Settings(policies=["sync"], groups=[1, 2], rates=[10.0], latency_ms=10,
                        compare_k=2, steps=240, speeds=list(SPEEDS))
    return Settings(policies=list(POLICIES), groups=[1, 2, 4, 8], rates=[10.0, 100.0, 1000.0],
                    latency_ms=10, compare_k=4, steps=3200, speeds=list(SPEEDS))


@dataclasses.dataclass
class Cell(grid.Run):
    """One aloe-sim run of the grid: a grid.Run plus its layer groups and link."""
    groups: int = 1
    schedule: str = "full"
    fill_bubbles: bool = False
    merge_delay_steps: int = 0
    mixing_alpha: float = 0.0
    rate_mbit: float = math.inf
    latency_ms: float = 0.0
    peak_window: float = 1.0

    def link_flag(self):
        rate = "inf" if math.isinf(self.rate_mbit) else grid._fmt(self.rate_mbit)
        return f"{rate}:{grid._fmt(self.latency_ms)}"


def rate_label(rate):
    return "inf" if math.isinf(rate) else f"{grid._fmt(rate)} Mbit/s"


def _config(configs_dir, corpus_dir, s, policy, groups, schedule, fill, tau, alpha, header):
    """The policy's straggler-study config with this grid's model and the cell's layer groups."""
    p = grid.POLICIES[policy]
    k = len(s.speeds)
    base = grid.make_config(configs_dir, p, workers=k, min_workers=k, local_steps=s.local_steps,
                            budget_seconds=s.local_steps * s.step_seconds(), dn_buffer=0,
                            trainer="torch", corpus_dir=corpus_dir, header="")
    overrides = {"model": MODEL}
    if p.mode == "async":
        # The study's grace is 0.5 s at 1 step/s: half a step. Keep it half a step here, so that
        # a group's window does not hold its workers for several steps.
        agg = textproto.field(base, "aggregation")
        grace = float(textproto.scalar(agg, "grace_seconds", "0.5"))
        overrides["aggregation"] = ("{ mode: AGGREGATION_ASYNC grace_seconds: "
                                    f"{grid._fmt(grace * s.step_seconds())} }}")
    if groups > 1:
        overrides["partial_sync"] = (
            f"{{ groups: {groups} schedule: {SCHEDULES[schedule]} merge_delay_steps: {tau} "
            f"mixing_alpha: {grid._fmt(alpha)}" + (" fill_bubbles: true" if fill else "") + " }")
    return textproto.merge(base, overrides, header=header)


def build_cells(s, seeds, configs_dir, corpus_dir):
    """Every cell of the grid for every seed; K = 1 cells first (the others compare with them)."""
    cells = []
    workers = len(s.speeds)
    for seed in seeds:
        for policy in s.policies:
            for rate in s.rates:
                variants = [(k, "full" if k == 1 else "strided", False) for k in s.groups]
                if s.compare_k > 1:
                    variants += [(s.compare_k, "enp", False), (s.compare_k, "dreamddp", False)]
                    if grid.POLICIES[policy].mode == "async":
                        variants.append((s.compare_k, "dreamddp", True))
                for k, schedule, fill in variants:
                    tau, alpha = ((s.merge_delay_steps, s.mixing_alpha) if schedule == "strided"
                                  else (0, 0.0))
                    rid = (f"{policy}-{rate_label(rate).replace(' Mbit/s', 'mbit')}-k{k}-"
                           f"{schedule}{'-fill' if fill else ''}-s{seed}")
                    header = (f"{rid}: {grid.POLICIES[policy].description}; K = {k}, schedule "
                              f"{schedule}{' with bubble filling' if fill else ''}, links "
                              f"{rate_label(rate)}")
                    if grid.POLICIES[policy].mode == "async":
                        header += "\nhere the grace is half a step (aggregation below)"
                    per_round = k if grid.POLICIES[policy].mode == "sync" else workers * k
                    cells.append(Cell(
                        "partial-sync", rid, policy, seed, s.trainer, workers, s.local_steps,
                        _config(configs_dir, corpus_dir, s, policy, k, schedule, fill, tau,
                                alpha, header),
                        speeds=list(s.speeds), max_local_steps=s.steps, eval_every=per_round,
                        groups=k, schedule=schedule, fill_bubbles=fill, merge_delay_steps=tau,
                        mixing_alpha=alpha, rate_mbit=rate, latency_ms=s.latency_ms,
                        peak_window=s.window()))
    return sorted(cells, key=lambda c: c.groups > 1)


class NetworkSimBackend(backends.SimBackend):
    """aloe-sim with each worker behind its link, per-worker stats in workers.csv."""

    def command(self, run, run_dir):
        return super().command(run, run_dir) + [
            f"--links={run.link_flag()}", "--overlap=off",
            f"--peak_window={grid._fmt(run.peak_window)}",
            f"--workers_out={run_dir}/workers.csv"]


def has_network_model(binary):
    try:
        out = subprocess.run([binary, "--help"], stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True, timeout=60).stdout
    except (OSError, subprocess.TimeoutExpired):
        return False
    return "--links" in out and "--workers_out" in out


def _why(error):
    """The error line of an aloe-sim failure (its status message, log prefix cut), else the
    last line."""
    lines = [ln.strip() for ln in str(error).splitlines() if ln.strip()]
    errors = [ln for ln in lines if ln.startswith("E ")] or lines[-1:] or ["no output"]
    return re.sub(r"^E [0-9:.]+ \[\w+\] ", "", errors[0])[:240]


def _first_rejection(log_path):
    try:
        with open(log_path, errors="replace") as f:
            for line in f:
                m = re.search(r"rejected push: (.*)$", line)
                if m:
                    return m.group(1)[:240]
    except OSError:
        pass
    return "no push was applied"


def run_cells(backend, cells, out_dir, jobs, reuse, deadline):
    """Runs every cell (`jobs` at a time) with progress lines; returns [(cell, run_dir, info)]
    in grid order. info["status"]: ok, refused (a K > 1 config aloe-sim rejected), failed or
    skipped (not started before `deadline`, a time.monotonic() value or None); collect() may
    turn ok into rejected."""
    start = time.monotonic()
    done = [0]

    def execute(cell):
        run_dir = os.path.join(out_dir, "runs", cell.run_id)
        if deadline is not None and time.monotonic() > deadline:
            info = {"status": "skipped", "note": "--max_minutes passed before it started"}
        else:
            try:
                info = dict(backend.run(cell, run_dir, reuse=reuse), status="ok", note="")
            except RuntimeError as e:
                info = {"status": "refused" if cell.groups > 1 else "failed", "note": _why(e)}
        done[0] += 1
        took = f"{info['wall_seconds']:.0f} s" if "wall_seconds" in info else info["note"]
        print(f"  [{done[0]}/{len(cells)}] {cell.run_id}: {info['status']}, {took}"
              f"{' (reused)' if info.get('reused') else ''}; {time.monotonic() - start:.0f} s "
              "elapsed", flush=True)
        return cell, run_dir, info

    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        return list(pool.map(execute, cells))


def collect(cell, run_dir, info):
    """The runs.csv row (partial_sync_report.RUN_COLUMNS) and eval curve of one finished cell."""
    row = {
        "run_id": cell.run_id, "status": info["status"], "policy": cell.policy,
        "schedule": cell.schedule, "groups": cell.groups, "fill_bubbles": int(cell.fill_bubbles),
        "merge_delay_steps": cell.merge_delay_steps, "mixing_alpha": cell.mixing_alpha,
        "link": cell.link_flag(), "rate_mbit": cell.rate_mbit, "latency_ms": cell.latency_ms,
        "peak_window": cell.peak_window, "workers": cell.workers,
        "step_seconds": 1.0 / max(cell.speeds),
        "local_steps_h": cell.local_steps, "seed": cell.seed, "trainer": cell.trainer,
        "stop_reason": info.get("stop_reason", ""), "wall_seconds": info.get("wall_seconds"),
        "note": info.get("note", ""),
    }
    if info["status"] != "ok":
        return row, []
    rows = analysis.read_rows(os.path.join(run_dir, "sim.csv"))
    m = analysis.run_metrics(rows, cell.capacity(), cli.tokens_per_step(cell.config_text))
    if m["versions"] == 0:
        # Nothing to compare: e.g. an aloe-sim whose workers push the whole model to a server
        # with layer groups, which rejects every push.
        row.update(status="rejected", note=_first_rejection(os.path.join(run_dir, "log.txt")))
        return row, []
    for key in ("local_steps", "versions", "virtual_seconds", "final_eval_loss",
                "final_perplexity", "tail_perplexity"):
        row[key] = m[key]
    per_worker = analysis.read_rows(os.path.join(run_dir, "workers.csv"))
    peaks = [float(w["peak_up_bytes_per_second"]) for w in per_worker]
    utils = [float(w["utilization"]) for w in per_worker]
    row.update({
        "peak_up_bytes_per_second": ";".join(f"{p:.0f}" for p in peaks),
        "peak_up_max": max(peaks, default=None),
        "peak_down_max": max((float(w["peak_down_bytes_per_second"]) for w in per_worker),
                             default=None),
        "bytes_up_mean": (sum(float(w["bytes_up"]) for w in per_worker) / len(per_worker)
                          if per_worker else None),
        "updates_mean": (sum(int(w["updates"]) for w in per_worker) / len(per_worker)
                         if per_worker else None),
        "utilization": ";".join(f"{u:.4f}" for u in utils),
        "utilization_mean": sum(utils) / len(utils) if utils else None,
    })
    return row, analysis.curve(rows)


def add_targets(results, target_loss=None):
    """time_to_target for every ok row: the target is `target_loss`, else per policy and seed
    the worst final loss of its K = 1 cells plus ln(1.02) (every cell within 2% of K = 1 in
    perplexity reaches it)."""
    base = {}
    for r in results:
        row = r["row"]
        if row["status"] == "ok" and row["groups"] == 1 and row["final_eval_loss"] is not None:
            k = (row["policy"], row["seed"])
            base[k] = max(base.get(k, -math.inf), row["final_eval_loss"])
    for r in results:
        row = r["row"]
        target = target_loss
        if target is None and (row["policy"], row["seed"]) in base:
            target = base[(row["policy"], row["seed"])] + math.log(1.02)
        if target is None or row["status"] != "ok":
            continue
        row["target_loss"] = target
        row["target_perplexity"] = math.exp(target)
        row["time_to_target"] = analysis.time_to_target(r["curve"], target)


def _floats(text, what):
    try:
        values = [math.inf if x.strip() == "inf" else float(x) for x in text.split(",")
                  if x.strip()]
    except ValueError:
        values = []
    if not values or any(v <= 0 for v in values):
        raise SystemExit(f"{PROG}: {what} wants positive numbers ('inf' allowed), got '{text}'")
    return values


def parse_args(argv):
    p = argparse.ArgumentParser(prog=PROG, description=HELP,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true",
                   help="a tiny grid for tests: sync, one link, K = 1 and 2, 240 local steps")
    p.add_argument("--out", default=os.path.join(cli.ROOT, "out", "partial-sync"),
                   help="output directory (default: out/partial-sync, git-ignored)")
    p.add_argument("--bin_dir", "--bin-dir", dest="bin_dir", default=None,
                   help="where aloe-sim is (default: build/bin of this checkout, built first)")
    p.add_argument("--jobs", type=int, default=2, help="aloe-sim runs in parallel (default 2)")
    p.add_argument("--policies", default="", help="comma-separated subset of "
                   + ",".join(POLICIES))
    p.add_argument("--groups", default="", help="K of the strided sweep, e.g. 1,2,4,8")
    p.add_argument("--compare_k", type=int, default=0,
                   help="K of the ENP and DreamDDP cells (default 4, quick 2; 1 = none)")
    p.add_argument("--links_mbit", default="",
                   help="per-worker link rates in Mbit/s, e.g. 10,100,1000 ('inf' allowed)")
    p.add_argument("--latency_ms", type=float, default=-1,
                   help="one-way latency of every link (default 10)")
    p.add_argument("--steps", type=int, default=0,
                   help="local steps of every run, all workers together (default 3200, quick "
                        "240)")
    p.add_argument("--speeds", default="",
                   help="steps/s of each worker (default 20, 18.4, 14.4, 11)")
    p.add_argument("--merge_delay_steps", type=int, default=-1,
                   help="strided cells: tau, steps between a group's push and its merge "
                        "(default 1)")
    p.add_argument("--mixing_alpha", type=float, default=-1,
                   help="strided cells: Streaming DiLoCo's alpha (default 0.5)")
    p.add_argument("--peak_window", type=float, default=0,
                   help="aloe-sim --peak_window, virtual seconds (default one step time)")
    p.add_argument("--target_loss", type=float, default=None,
                   help="held-out loss of time_to_target (default: per policy, K = 1's final "
                        "loss + ln 1.02)")
    p.add_argument("--trainer", choices=["torch", "synthetic"], default="torch",
                   help="torch: the LM over the corpus; synthetic: quadratics, for tests")
    p.add_argument("--seeds", default="1", help="comma-separated seeds (tables average them)")
    p.add_argument("--max_minutes", type=float, default=0,
                   help="start no run after this many minutes (0 = no limit); runs not started "
                        "are reported as skipped")
    p.add_argument("--corpus_dir", "--corpus-dir", dest="corpus_dir",
                   default=os.path.join(cli.ROOT, "data", "sotu"))
    p.add_argument("--configs_dir", "--configs-dir", dest="configs_dir",
                   default=os.path.join(cli.ROOT, "deploy", "configs"))
    p.add_argument("--reuse", action="store_true",
                   help="keep runs whose sim.csv exists with the same command and config")
    return p.parse_args(argv)


def settings_from(args):
    s = default_settings(args.quick)
    if args.policies:
        s.policies = [x for x in args.policies.split(",") if x]
        bad = [x for x in s.policies if x not in POLICIES]
        if bad:
            raise SystemExit(f"{PROG}: unknown policies {bad}; use {','.join(POLICIES)}")
    if args.groups:
        s.groups = [int(x) for x in args.groups.split(",") if x]
        if any(k < 1 for k in s.groups):
            raise SystemExit(f"{PROG}: --groups wants K >= 1, got '{args.groups}'")
    # Numeric flags whose "not given" value is outside their range.
    for name, given in (("compare_k", args.compare_k > 0), ("latency_ms", args.latency_ms >= 0),
                        ("steps", args.steps > 0),
                        ("merge_delay_steps", args.merge_delay_steps >= 0),
                        ("mixing_alpha", args.mixing_alpha >= 0)):
        if given:
            setattr(s, name, getattr(args, name))
    if args.links_mbit:
        s.rates = _floats(args.links_mbit, "--links_mbit")
    if args.speeds:
        s.speeds = _floats(args.speeds, "--speeds")
    s.peak_window = args.peak_window
    s.trainer = args.trainer
    return s


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if importlib.util.find_spec("matplotlib") is None:
        print(f"{PROG}: python3-matplotlib is missing (scripts/install-deps.sh installs it)",
              file=sys.stderr)
        return 3
    s = settings_from(args)
    seeds = [int(x) for x in args.seeds.split(",") if x]
    bin_dir = cli.bin_dir_of(args.bin_dir, ["aloe-sim", "aloe-corpus"], PROG)
    corpus_dir = os.path.abspath(args.corpus_dir)
    backend = NetworkSimBackend(bin_dir, corpus_dir)
    if not has_network_model(backend.binary):
        print(f"{PROG}: {backend.binary} has no network model (--links, --workers_out): build "
              "aloe-sim from a tree that has it", file=sys.stderr)
        return 2
    if s.trainer == "torch":
        cli.ensure_corpus(corpus_dir, bin_dir)
    cells = build_cells(s, seeds, args.configs_dir,
                        corpus_dir if s.trainer == "torch" else "/nonexistent")
    out_dir = os.path.abspath(args.out)
    os.makedirs(out_dir, exist_ok=True)
    start = time.monotonic()
    deadline = start + 60 * args.max_minutes if args.max_minutes > 0 else None
    print(f"{PROG}: {len(cells)} runs of {s.steps} local steps, {args.jobs} at a time, "
          f"{backend.binary} -> {out_dir}", flush=True)
    finished = run_cells(backend, cells, out_dir, args.jobs, args.reuse, deadline)
    results = []
    for cell, run_dir, info in finished:
        row, curve = collect(cell, run_dir, info)
        results.append({"cell": cell, "row": row, "curve": curve})
    add_targets(results, args.target_loss)
    meta = {
        "command": PROG + "".join(" " + shlex.quote(a) for a in argv),
        "machine": cli.machine(),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "binary": backend.binary,
        "wall_seconds": time.monotonic() - start,
        "jobs": args.jobs,
        "settings": s,
    }
    report.write_csvs(out_dir, results)
    plots = report.write_plots(out_dir, results)
    checks = report.write_summary(out_dir, results, meta, plots)
    print(f"{PROG}: done in {meta['wall_seconds']:.0f} s; {out_dir}/summary.md")
    for name, verdict, text in checks:
        print(f"  {verdict}: {name}: {text}")
    failed = [r["row"]["run_id"] for r in results if r["row"]["groups"] == 1
              and r["row"]["status"] not in ("ok", "skipped")]
    if failed:
        print(f"{PROG}: {len(failed)} K = 1 run(s) failed: {', '.join(failed)} (see their "
              "log.txt)", file=sys.stderr)
        return 1
    return 0
