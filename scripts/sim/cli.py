"""Command line of scripts/simulate-stragglers (see HELP)."""

import argparse
import concurrent.futures
import datetime
import importlib.util
import math
import os
import platform
import shlex
import subprocess
import sys
import time

from . import analysis
from . import backends
from . import grid
from . import report
from . import textproto

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

HELP = """\
Runs straggler experiments against ALOE's real server logic and writes CSV files, PNG plots
and a markdown summary. Policies are server configs (deploy/configs/sim-small*.textproto with
the experiment's overrides); every run's config is kept next to its results.

Policies:
  sync            sync DiLoCo: round barrier, outer Nesterov lr 0.7 beta 0.9, fixed H
                  (sim-small.textproto)
  async-nesterov  naive async DiLoCo: each push is one outer Nesterov step, lr 0.07, grace
                  0.5 s, fixed H (sim-small-async-nesterov.textproto)
  async-dn-dylu   async Delayed Nesterov (N = workers) + DyLU + grace 0.5 s
                  (sim-small-async-dn-dylu.textproto); the server keeps DyLU's tasks in rounds
                  that end together and a round's window waits for the round (README)
  async-dn-dylu-grace-inf
                  the same with grace_seconds inf: a window closes once every live trainer
                  has pushed, so DyLU's equal-duration tasks start from one version
  a-edit          A-EDiT: sync rounds, every worker trains for a time budget of H steps of the
                  fastest worker (local_work LOCAL_WORK_TIME_BUDGET)
  a-edit-penalty  A-EDiT plus the EDiT pseudo-gradient penalty (penalty { enabled: true })

Families (--families):
  heterogeneity   4 workers at each heterogeneity level x every policy, H = 20, all runs stop
                  at the same number of local steps (--steps; default 3200, quick 1200).
                  Speeds, steps per second of workers 0..3:
                    no        1, 1, 1, 1
                    slight    1, 0.92, 0.72, 0.55   (= very ** (1/3))
                    moderate  1, 0.84, 0.53, 0.31   (= very ** (2/3))
                    very      1, 0.77, 0.38, 0.17   (paper 002 Fig. 4 device speeds)
                  Trainer: torch (the real byte-level LM of sim-small.textproto).
  consistent      8 workers at 1 step/s, the last one's step time x (1 + lag), lag in 0, 1, 2,
                  4 (quick: 0, 1, 4); sync vs async vs A-EDiT; H = 100; 6000 virtual s
                  (quick 3000). Throughput retention vs lag 0 (paper 000 Table 6).
  random          8 workers at 1 step/s; each step of each worker is delayed by lag s with
                  probability p (a seeded aloe-sim --trace cycle); (p, lag) in (0.05, 0.125,
                  0.25) x (1, 4) plus p = 0 (quick: 0.125 x (1, 4)).
  elastic         8 workers at 1 step/s joining and leaving so that 1, 2, 4, 8, 4, 2, 1 are
                  present, --phase-seconds each (default 97, quick 33: joins and leaves fall
                  inside H = 20 s rounds); Delayed Nesterov N = 4; throughput per phase.
  consistent and random use the synthetic trainer (throughput does not depend on the model;
  a tiny model keeps them cheap); --trainer overrides the trainer of every family.

Back ends (--backend):
  sim        build/bin/aloe-sim: virtual clock, deterministic, --jobs runs in parallel;
             --link gives every simulated worker that link (aloe-sim --links, one-way
             latency half the round trip).
  loopback   real aloe-server + evaluator + one aloe-worker per worker on 127.0.0.1; speeds
             become --slowdown (fastest speed / own speed), step-time traces (random
             stragglers) aloe-worker --step_trace with the same trace file, joins/leaves
             process starts and SIGTERMs; each run lasts --real-seconds wall seconds (A-EDiT's
             budget is H steps of a calibrated unslowed worker); --link puts every trainer
             behind an aloe-linkemu of its own. Runs one at a time, always
             with the torch trainer; runs are bounded by time, not local steps, so the
             equal-update comparisons are not made, and utilization is left empty (real
             steps/s of an unslowed worker are not known).

Outputs in --out (default out/stragglers):
  heterogeneity.csv, consistent.csv, random.csv, elastic.csv   one row per run
  summary.csv         all runs; columns:
    family backend trainer run_id policy seed level workers speeds lag straggle_p
    phase_seconds local_steps_h stop_reason wall_seconds virtual_seconds versions local_steps
    applied_steps updates rejected final_eval_loss final_perplexity tail_perplexity
    steps_per_second tokens_per_second capacity_steps_per_second utilization
    throughput_retention staleness_mean staleness_p50 staleness_p90 staleness_max
    target_perplexity time_to_target
  curves.csv          family run_id policy seed virtual_time local_steps version eval_loss
                      perplexity (every evaluation)
  staleness.csv       family run_id policy seed staleness count
  elastic_phases.csv  run_id policy seed phase start end workers steps_per_second utilization
  perplexity_vs_local_steps.png, perplexity_vs_time.png, staleness.png,
  throughput_retention.png, elastic.png, summary.md (tables + the papers' findings checked)
  runs/<family>/<run_id>/   config.textproto, trace.csv, sim.csv (aloe-sim CSV), log.txt

Metrics: steps_per_second = local steps of updates applied between the first and the last
outer step / that time span (whole rounds for sync; work still in flight at the end is left
out); tokens_per_second = steps_per_second x batch x seq_len; utilization = steps_per_second /
sum of the workers' speeds; throughput_retention = steps_per_second / the same policy's run
without stragglers (lag 0, p = 0, heterogeneity 'no'); staleness = versions applied between an
update's base and its own outer step; perplexity = exp(held-out loss) (for the synthetic
trainer a transform of its quadratic loss, not a language-model perplexity); tail_perplexity =
mean perplexity of the evaluations in the last 10% of the local steps (single evaluations of
the small model move by a few percent; the findings use this).
"""


def _floats(text):
    return [float(x) for x in text.split(",") if x.strip()]


def parse_args(argv):
    p = argparse.ArgumentParser(
        prog="scripts/simulate-stragglers", description=HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true",
                   help="a small grid (< 10 minutes on 2 cores)")
    p.add_argument("--out", default=os.path.join(ROOT, "out", "stragglers"),
                   help="output directory (default: out/stragglers, git-ignored)")
    p.add_argument("--backend", choices=["sim", "loopback"], default="sim")
    p.add_argument("--families", default=",".join(grid.FAMILIES),
                   help="comma-separated subset of " + ",".join(grid.FAMILIES))
    p.add_argument("--policies", default="",
                   help="comma-separated subset of " + ",".join(grid.POLICIES) +
                   " (default: each family's own list)")
    p.add_argument("--levels", default="", help="heterogeneity levels, e.g. no,very")
    p.add_argument("--steps", type=int, default=0,
                   help="heterogeneity: local steps of every run (all workers together)")
    p.add_argument("--lags", default="", help="consistent: lags, e.g. 0,1,2,4")
    p.add_argument("--link", default="",
                   help="RATE_MBIT:RTT_MS: loopback puts each trainer behind an aloe-linkemu of "
                        "its own with this link, sim gives every worker this link (e.g. 100:100)")
    p.add_argument("--workers", type=int, default=0,
                   help="consistent and random: workers per run (default 8)")
    p.add_argument("--local-steps", type=int, default=0,
                   help="consistent and random: H, local steps per round (default 100)")
    p.add_argument("--random-cells", default="",
                   help="random: p:lag pairs, e.g. 0:0,0.125:1,0.125:4 (include a p = 0 cell "
                        "as the retention baseline)")
    p.add_argument("--virtual-seconds", type=float, default=0,
                   help="consistent/random: virtual seconds per run")
    p.add_argument("--phase-seconds", type=float, default=0,
                   help="elastic: virtual seconds per phase")
    p.add_argument("--real-seconds", type=float, default=0,
                   help="loopback: wall seconds per run (default per family: 90, elastic 140; "
                        "quick 40, elastic 70)")
    p.add_argument("--trainer", choices=["auto", "torch", "synthetic"], default="auto",
                   help="auto: torch for heterogeneity and elastic, synthetic for consistent "
                        "and random")
    p.add_argument("--seeds", default="1",
                   help="comma-separated seeds; every cell runs once per seed and the tables "
                        "average them")
    p.add_argument("--jobs", type=int, default=os.cpu_count() or 1,
                   help="aloe-sim runs in parallel (default: the number of cores)")
    p.add_argument("--bin-dir", default=None,
                   help="where the binaries are; default: build/bin of this checkout, built "
                        "first (as scripts/bench.sh does)")
    p.add_argument("--corpus-dir", default=os.path.join(ROOT, "data", "sotu"),
                   help="prepared corpus (scripts/prepare-corpus.sh runs when it is missing "
                        "and a torch run needs it)")
    p.add_argument("--configs-dir", default=os.path.join(ROOT, "deploy", "configs"))
    p.add_argument("--reuse", action="store_true",
                   help="keep runs whose sim.csv exists with the same command and config")
    return p.parse_args(argv)


def _link(text):
    if not text:
        return None
    rate, sep, rtt = text.partition(":")
    try:
        link = (float(rate), float(rtt))
    except ValueError:
        link = None
    if not sep or link is None or link[0] <= 0 or link[1] < 0:
        raise SystemExit(f"simulate-stragglers: --link wants RATE_MBIT:RTT_MS, got '{text}'")
    return link


def settings_from(args):
    settings = grid.default_settings(args.quick)
    if args.levels:
        bad = [lv for lv in args.levels.split(",") if lv not in grid.LEVELS]
        if bad:
            raise SystemExit(f"simulate-stragglers: unknown level(s) {bad}; use "
                             + ",".join(grid.LEVEL_ORDER))
        settings["heterogeneity"].levels = args.levels.split(",")
    if args.steps:
        settings["heterogeneity"].total_steps = args.steps
    if args.lags:
        settings["consistent"].lags = _floats(args.lags)
    if args.random_cells:
        cells = []
        for item in args.random_cells.split(","):
            p_, _, lag = item.partition(":")
            cells.append((float(p_), float(lag or 1)))
        settings["random"].random_cells = cells
    for family in ("consistent", "random"):
        if args.workers:
            settings[family].workers = args.workers
        if args.local_steps:
            settings[family].local_steps = args.local_steps
    if args.virtual_seconds:
        settings["consistent"].virtual_seconds = args.virtual_seconds
        settings["random"].virtual_seconds = args.virtual_seconds
    if args.phase_seconds:
        settings["elastic"].phase_seconds = args.phase_seconds
    if args.real_seconds:
        for s in settings.values():
            s.real_seconds = args.real_seconds
    return settings


def machine():
    cpu = platform.processor() or "unknown CPU"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    distro = ""
    try:
        with open("/etc/os-release") as f:
            for line in f:
                if line.startswith("PRETTY_NAME="):
                    distro = line.split("=", 1)[1].strip().strip('"')
    except OSError:
        pass
    return f"{os.cpu_count()} cores ({cpu}), {distro or platform.system()}"


def bin_dir_of(given, targets, prog):
    """The bin directory to use: `given` (--bin-dir, else $ALOE_BIN_DIR) as is; without either,
    that of the checkout's build directory after building `targets` there, as scripts/bench.sh
    does (scripts/lib.sh aloe_build; missing dependencies are installed first)."""
    given = given or os.environ.get("ALOE_BIN_DIR")
    if given:
        return os.path.abspath(given)
    print(f"{prog}: building {' '.join(targets)}", flush=True)
    script = ('set -e; . "$1/scripts/lib.sh"; "$1/scripts/install-deps.sh" >/dev/null; '
              'mkdir -p "$ALOE_BUILD_DIR"; log="$ALOE_BUILD_DIR/.simulate-build.log"; '
              'aloe_build "${@:2}" >"$log" 2>&1 || { tail -n 30 "$log" >&2; exit 1; }; '
              'echo "$ALOE_BIN_DIR"')
    built = subprocess.run(["bash", "-c", script, "_", ROOT, *targets], stdout=subprocess.PIPE,
                           text=True)
    if built.returncode != 0:
        sys.exit(f"{prog}: building {' '.join(targets)} failed (see above)")
    return built.stdout.strip().splitlines()[-1]


def ensure_corpus(corpus_dir, bin_dir):
    if os.path.exists(os.path.join(corpus_dir, "manifest.tsv")):
        return
    print(f"simulate-stragglers: preparing the corpus in {corpus_dir}", flush=True)
    env = dict(os.environ, ALOE_BIN_DIR=bin_dir)
    subprocess.run([os.path.join(ROOT, "scripts", "prepare-corpus.sh"), corpus_dir], check=True,
                   env=env)


def tokens_per_step(config_text):
    batch = textproto.scalar(textproto.field(config_text, "inner_optimizer"), "batch_size", "8")
    seq = textproto.scalar(textproto.field(config_text, "model"), "seq_len", "128")
    return int(batch) * int(seq)


def row_for(run, backend_name, info, metrics):
    row = {
        "family": run.family, "backend": backend_name, "trainer": run.trainer,
        "run_id": run.run_id, "policy": run.policy, "seed": run.seed, "level": run.level,
        "workers": run.workers,
        "speeds": ";".join(grid._fmt(v) for v in run.speeds) if run.speeds else "",
        "lag": run.lag, "straggle_p": run.straggle_p, "phase_seconds": run.phase_seconds,
        "local_steps_h": run.local_steps, "stop_reason": info.get("stop_reason", ""),
        "wall_seconds": info.get("wall_seconds"),
        "throughput_retention": None, "target_perplexity": None, "time_to_target": None,
    }
    row.update(metrics)
    return row


def cross_run_metrics(results):
    baselines = {}
    for r in results:
        if r["run"].is_baseline and r["run"].baseline_key is not None:
            baselines[r["run"].baseline_key] = r["row"]["steps_per_second"]
    for r in results:
        base = baselines.get(r["run"].baseline_key)
        sps = r["row"]["steps_per_second"]
        if base and sps is not None:
            r["row"]["throughput_retention"] = sps / base
    # Time to target (heterogeneity): target = the worse of sync's and DN+DyLU's final
    # perplexity at that level and seed (both reach it; DN+DyLU = the grace-inf variant when
    # present); else sync's, else the best final perplexity there.
    cells = {}
    for r in results:
        if r["run"].family == "heterogeneity":
            cells.setdefault((r["run"].level, r["run"].seed), []).append(r)
    for cell in cells.values():
        finals = {r["run"].policy: r["row"]["final_eval_loss"] for r in cell
                  if r["row"]["final_eval_loss"] is not None}
        dn = next((p for p in ("async-dn-dylu-grace-inf", "async-dn-dylu") if p in finals), None)
        if "sync" in finals and dn:
            target = max(finals["sync"], finals[dn])
        elif finals:
            target = finals.get("sync", min(finals.values()))
        else:
            continue
        for r in cell:
            r["row"]["target_perplexity"] = math.exp(target)
            r["row"]["time_to_target"] = analysis.time_to_target(r["curve"], target)


def _names(text, known, what):
    """The comma-separated names in `text`, or None (after saying why) if one is not in `known`."""
    names = [n for n in text.split(",") if n]
    bad = [n for n in names if n not in known]
    if bad:
        print(f"simulate-stragglers: unknown {what} {bad}; use {','.join(known)}",
              file=sys.stderr)
        return None
    return names


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if importlib.util.find_spec("matplotlib") is None:
        print("simulate-stragglers: python3-matplotlib is missing (scripts/install-deps.sh "
              "installs it)", file=sys.stderr)
        return 3
    families = _names(args.families, grid.FAMILIES, "family")
    policies = _names(args.policies, grid.POLICIES, "policy")
    if families is None or policies is None:
        return 2
    seeds = [int(s) for s in args.seeds.split(",") if s]
    settings = settings_from(args)
    trainer = None if args.trainer == "auto" else args.trainer
    if args.backend == "loopback" and trainer is None:
        trainer = "torch"  # real workers always train the real model
    corpus_dir = os.path.abspath(args.corpus_dir)
    bin_dir = bin_dir_of(args.bin_dir, ["aloe-sim", "aloe-corpus"] if args.backend == "sim" else
                         ["aloe-server", "aloe-worker", "aloe-corpus", "aloe-linkemu"],
                         "simulate-stragglers")
    runs = grid.build_runs(settings, families, seeds, args.configs_dir, corpus_dir, trainer,
                           policies)
    if not runs:
        print("simulate-stragglers: nothing to run", file=sys.stderr)
        return 2
    if args.backend == "loopback" or any(r.trainer == "torch" for r in runs):
        ensure_corpus(corpus_dir, bin_dir)

    out_dir = os.path.abspath(args.out)
    os.makedirs(out_dir, exist_ok=True)
    if args.backend == "sim":
        backend = backends.SimBackend(bin_dir, corpus_dir, link=_link(args.link))
        jobs = max(1, args.jobs)
    else:
        backend = backends.LoopbackBackend(
            bin_dir, corpus_dir, {f: s.real_seconds for f, s in settings.items()},
            link=_link(args.link))
        jobs = 1
        kept = []
        for r in runs:
            why = backend.supports(r)
            if why:
                print(f"simulate-stragglers: skipping {r.run_id}: {why}", flush=True)
            else:
                kept.append(r)
        runs = kept
        if not runs:
            return 2

    start = time.monotonic()
    print(f"simulate-stragglers: {len(runs)} runs on the {backend.name} back end, {jobs} at a "
          f"time -> {out_dir}", flush=True)
    done = [0]

    def execute(run):
        run_dir = os.path.join(out_dir, "runs", run.family, run.run_id)
        info = backend.run(run, run_dir, reuse=args.reuse)
        done[0] += 1
        print(f"  [{done[0]}/{len(runs)}] {run.run_id}: {info['wall_seconds']:.1f} s"
              f"{' (reused)' if info.get('reused') else ''}", flush=True)
        return run, run_dir, info

    finished = []
    with concurrent.futures.ThreadPoolExecutor(max_workers=jobs) as pool:
        # Longest runs first (torch before synthetic) keeps both cores busy to the end.
        order = sorted(runs, key=lambda r: (r.trainer != "torch", r.family != "heterogeneity"))
        futures = [pool.submit(execute, r) for r in order]
        for f in concurrent.futures.as_completed(futures):
            finished.append(f.result())

    results = []
    index = {r.run_id: i for i, r in enumerate(runs)}
    finished.sort(key=lambda x: index[x[0].run_id])
    for run, run_dir, info in finished:
        rows = analysis.read_rows(os.path.join(run_dir, "sim.csv"))
        # Speeds are virtual steps/s; real workers' absolute speed is not known, so loopback
        # runs have no capacity (and no utilization).
        capacity = run.capacity() if args.backend == "sim" else None
        metrics = analysis.run_metrics(rows, capacity, tokens_per_step(run.config_text))
        result = {"run": run, "row": row_for(run, backend.name, info, metrics),
                  "curve": analysis.curve(rows),
                  "staleness": analysis.staleness_histogram(rows)}
        if run.family == "elastic":
            _, phases = grid.elastic_schedule(run.phase_seconds, run.workers)
            if args.backend == "loopback":
                scale = info.get("real_seconds", 0) / run.max_virtual_seconds
                phases = [(a * scale, b * scale, w) for a, b, w in phases]
            result["phases"] = analysis.phase_throughput(
                rows, phases, run.speeds if args.backend == "sim" else None)
            if args.backend != "sim":
                result["phases"] = [(a, b, w, sps, None) for a, b, w, sps, _ in
                                    result["phases"]]
        results.append(result)
    cross_run_metrics(results)
    report.write_csvs(out_dir, results, families)
    plots = report.write_plots(out_dir, results)
    meta = {
        "command": "scripts/simulate-stragglers " + " ".join(shlex.quote(a) for a in argv),
        "backend": args.backend,
        "machine": machine(),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "wall_seconds": time.monotonic() - start,
        "reused": sum(1 for _, _, i in finished if i.get("reused")),
        "jobs": jobs,
    }
    checks = report.write_summary(out_dir, results, meta, plots, args.backend)
    print(f"simulate-stragglers: done in {meta['wall_seconds']:.0f} s; {out_dir}/summary.md")
    for name, ok, text in checks:
        verdict = "holds" if ok else ("not checked" if ok is None else "DOES NOT HOLD")
        print(f"  {verdict}: {name}: {text}")
    return 0
