"""Outputs of scripts/simulate-stragglers: CSV files, PNG plots and summary.md.

Files written into the output directory (columns in RUN_COLUMNS and the *_COLUMNS below):
  <family>.csv         one row per run of that family (heterogeneity, consistent, random, elastic)
  summary.csv          every run of every family (the same columns)
  curves.csv           every evaluation of every run (perplexity vs local steps and time)
  staleness.csv        staleness histogram of every run
  elastic_phases.csv   elastic runs: throughput of each phase of the 1-2-4-8-4-2-1 schedule
  *.png, summary.md    plots and tables (see write_plots / write_summary)
"""

import csv
import math
import os
import statistics

from . import grid

RUN_COLUMNS = [
    "family", "backend", "trainer", "run_id", "policy", "seed", "level", "workers", "speeds",
    "lag", "straggle_p", "phase_seconds", "local_steps_h", "stop_reason", "wall_seconds",
    "virtual_seconds", "versions", "local_steps", "applied_steps", "updates", "rejected",
    "final_eval_loss", "final_perplexity", "tail_perplexity", "steps_per_second",
    "tokens_per_second",
    "capacity_steps_per_second", "utilization", "throughput_retention", "staleness_mean",
    "staleness_p50", "staleness_p90", "staleness_max", "target_perplexity", "time_to_target",
]
CURVE_COLUMNS = ["family", "run_id", "policy", "seed", "virtual_time", "local_steps", "version",
                 "eval_loss", "perplexity"]
STALENESS_COLUMNS = ["family", "run_id", "policy", "seed", "staleness", "count"]
PHASE_COLUMNS = ["run_id", "policy", "seed", "phase", "start", "end", "workers",
                 "steps_per_second", "utilization"]

POLICY_STYLE = {
    "sync": ("tab:blue", "-"),
    "async-nesterov": ("tab:red", "--"),
    "async-dn-dylu": ("tab:green", "-"),
    "async-dn-dylu-grace-inf": ("tab:olive", "-"),
    "a-edit": ("tab:purple", "-."),
    "a-edit-penalty": ("tab:orange", ":"),
}


def fmt(v, digits=4):
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return ""
    if isinstance(v, float):
        return f"{v:.{digits}g}" if abs(v) < 1e5 else f"{v:.0f}"
    return str(v)


def write_csv(path, columns, rows):
    with open(path, "w", newline="") as f:
        w = csv.writer(f, lineterminator="\n")
        w.writerow(columns)
        for r in rows:
            w.writerow([fmt(r.get(c), 6) if isinstance(r.get(c), float) else
                        ("" if r.get(c) is None else r.get(c)) for c in columns])


def write_csvs(out_dir, results, families):
    for family in families:
        write_csv(os.path.join(out_dir, f"{family}.csv"), RUN_COLUMNS,
                  [r["row"] for r in results if r["row"]["family"] == family])
    write_csv(os.path.join(out_dir, "summary.csv"), RUN_COLUMNS, [r["row"] for r in results])
    curves, stale, phases = [], [], []
    for r in results:
        row = r["row"]
        base = {"family": row["family"], "run_id": row["run_id"], "policy": row["policy"],
                "seed": row["seed"]}
        for t, steps, version, loss in r["curve"]:
            curves.append(dict(base, virtual_time=t, local_steps=steps, version=version,
                               eval_loss=loss, perplexity=math.exp(min(loss, 700))))
        for s, n in r["staleness"].items():
            stale.append(dict(base, staleness=s, count=n))
        for i, (start, end, workers, sps, util) in enumerate(r.get("phases") or []):
            phases.append({"run_id": row["run_id"], "policy": row["policy"], "seed": row["seed"],
                           "phase": i, "start": start, "end": end, "workers": workers,
                           "steps_per_second": sps, "utilization": util})
    write_csv(os.path.join(out_dir, "curves.csv"), CURVE_COLUMNS, curves)
    write_csv(os.path.join(out_dir, "staleness.csv"), STALENESS_COLUMNS, stale)
    if "elastic" in families:
        write_csv(os.path.join(out_dir, "elastic_phases.csv"), PHASE_COLUMNS, phases)


def _mean(values):
    values = [v for v in values if v is not None and not (isinstance(v, float) and
                                                          math.isnan(v))]
    return statistics.fmean(values) if values else None


def _cell(results, family, policy, **where):
    rows = [r["row"] for r in results if r["row"]["family"] == family and
            r["row"]["policy"] == policy and all(r["row"].get(k) == v for k, v in where.items())]
    return rows


def _policies(results, family):
    seen = []
    for r in results:
        if r["row"]["family"] == family and r["row"]["policy"] not in seen:
            seen.append(r["row"]["policy"])
    order = list(grid.POLICIES)
    return sorted(seen, key=lambda p: order.index(p) if p in order else 99)


def _values(results, family, key):
    seen = []
    for r in results:
        if r["row"]["family"] == family and r["row"][key] not in seen:
            seen.append(r["row"][key])
    return seen


# ---------------------------------------------------------------------------------------------
# Plots


def plot_saver(out_dir, written):
    """pyplot on the Agg back end, and save(fig, name): writes `fig` to out_dir/name at the
    plots' resolution, closes it and appends name to `written`. Returns (pyplot, save)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def save(fig, name):
        fig.tight_layout()
        fig.savefig(os.path.join(out_dir, name), dpi=90)
        plt.close(fig)
        written.append(name)

    return plt, save


def write_plots(out_dir, results):
    """Writes the PNGs for the families present; returns their file names."""
    written = []
    plt, save = plot_saver(out_dir, written)

    first_seed = min((r["row"]["seed"] for r in results), default=1)
    het = [r for r in results if r["row"]["family"] == "heterogeneity"
           and r["row"]["seed"] == first_seed]
    if het:
        levels = [lv for lv in grid.LEVEL_ORDER if any(r["row"]["level"] == lv for r in het)]
        for xkey, name, xlabel in ((1, "perplexity_vs_local_steps.png",
                                    "local steps (all workers)"),
                                   (0, "perplexity_vs_time.png", "virtual wall-clock (s)")):
            fig, axes = plt.subplots(1, len(levels), figsize=(4.2 * len(levels), 3.6),
                                     sharey=True, squeeze=False)
            for ax, level in zip(axes[0], levels):
                for r in het:
                    if r["row"]["level"] != level:
                        continue
                    pts = r["curve"]
                    color, ls = POLICY_STYLE.get(r["row"]["policy"], (None, "-"))
                    ax.plot([p[xkey] for p in pts], [math.exp(min(p[3], 700)) for p in pts],
                            ls, color=color, label=r["row"]["policy"], lw=1.4)
                ax.set_title(f"{level} heterogeneity")
                ax.set_xlabel(xlabel)
                ax.set_yscale("log")
                ax.grid(alpha=0.3)
            axes[0][0].set_ylabel("held-out perplexity")
            axes[0][-1].legend(fontsize=8)
            save(fig, name)

        fig, axes = plt.subplots(1, len(levels), figsize=(4.2 * len(levels), 3.2), sharey=True,
                                 squeeze=False)
        for ax, level in zip(axes[0], levels):
            cells = [r for r in het if r["row"]["level"] == level and r["staleness"]]
            width = 0.8 / max(1, len(cells))
            for j, r in enumerate(cells):
                hist = r["staleness"]
                total = sum(hist.values())
                xs = sorted(hist)
                color, _ = POLICY_STYLE.get(r["row"]["policy"], (None, "-"))
                ax.bar([x + (j - (len(cells) - 1) / 2) * width for x in xs],
                       [hist[x] / total for x in xs], width=width, color=color,
                       label=r["row"]["policy"])
            ax.set_title(f"staleness, {level} heterogeneity")
            ax.set_xlabel("staleness (versions)")
            ax.grid(alpha=0.3, axis="y")
        axes[0][0].set_ylabel("fraction of updates")
        axes[0][-1].legend(fontsize=8)
        save(fig, "staleness.png")

    cons = [r for r in results if r["row"]["family"] == "consistent"]
    rand = [r for r in results if r["row"]["family"] == "random"]
    if cons or rand:
        fig, axes = plt.subplots(1, 2 if (cons and rand) else 1, figsize=(11 if cons and rand
                                                                          else 5.5, 4),
                                 squeeze=False)
        col = 0
        if cons:
            ax = axes[0][col]
            col += 1
            lags = sorted(set(r["row"]["lag"] for r in cons))
            k = cons[0]["row"]["workers"]
            for policy in _policies(results, "consistent"):
                ys = [_mean(x["throughput_retention"] for x in
                            _cell(results, "consistent", policy, lag=lag)) for lag in lags]
                color, ls = POLICY_STYLE.get(policy, (None, "-"))
                ax.plot(lags, ys, ls, marker="o", color=color, label=policy)
            fine = [i / 20 for i in range(0, int(max(lags) * 20) + 1)]
            ax.plot(fine, [1 / (1 + x) for x in fine], color="grey", lw=0.8, ls=":",
                    label="1/(1+lag)")
            ax.plot(fine, [(k - 1 + 1 / (1 + x)) / k for x in fine], color="black", lw=0.8,
                    ls=":", label=f"(k-1+1/(1+lag))/k, k={k}")
            ax.set_xlabel("lag of one worker (x its step time)")
            ax.set_ylabel("throughput retention (tokens/s vs lag 0)")
            ax.set_title(f"consistent straggler, {k} workers")
            ax.set_ylim(0, 1.05)
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
        if rand:
            ax = axes[0][col]
            cells = sorted(set((r["row"]["straggle_p"], r["row"]["lag"]) for r in rand))
            lags = sorted(set(lag for p, lag in cells if p > 0 and lag > 0))
            k = rand[0]["row"]["workers"]
            for policy in _policies(results, "random"):
                color, _ = POLICY_STYLE.get(policy, (None, "-"))
                for j, lag in enumerate(lags):
                    ps = [0.0] + sorted(p for p, lg in cells if lg == lag and p > 0)
                    ys = []
                    for p in ps:
                        where = {"straggle_p": p, "lag": lag} if p > 0 else {}
                        rows = _cell(results, "random", policy, **where)
                        if p == 0:
                            rows = [x for x in rows if x["straggle_p"] == 0 or x["lag"] == 0]
                        ys.append(_mean(x["throughput_retention"] for x in rows))
                    ax.plot(ps, ys, ["-", "--", "-.", ":"][j % 4], marker="o", color=color,
                            label=f"{policy}, lag {lag:g}")
            for j, lag in enumerate(lags):
                fine = [i / 100 for i in range(0, 31)]
                ax.plot(fine, [1 / (1 + p * lag) for p in fine], color="grey", lw=0.8, ls=":")
            ax.set_xlabel("probability that a step is delayed")
            ax.set_ylabel("throughput retention (tokens/s vs p = 0)")
            ax.set_title(f"random stragglers, {k} workers (dotted: 1/(1+p lag))")
            ax.set_ylim(0, 1.05)
            ax.grid(alpha=0.3)
            ax.legend(fontsize=6, ncol=2)
        save(fig, "throughput_retention.png")

    ela = [r for r in results if r["row"]["family"] == "elastic" and r["row"]["seed"] == first_seed]
    if ela:
        fig, axes = plt.subplots(1, 2, figsize=(11, 3.8))
        phases = ela[0].get("phases") or []
        for r in ela:
            color, ls = POLICY_STYLE.get(r["row"]["policy"], (None, "-"))
            xs, ys = [], []
            for start, end, workers, sps, util in r.get("phases") or []:
                xs += [start, end]
                ys += [sps, sps]
            axes[0].plot(xs, ys, ls, color=color, label=r["row"]["policy"])
            pts = r["curve"]
            axes[1].plot([p[0] for p in pts], [math.exp(min(p[3], 700)) for p in pts], ls,
                         color=color, label=r["row"]["policy"])
        xs, ys = [], []
        for start, end, workers, _, _ in phases:
            xs += [start, end]
            ys += [workers, workers]
        if all(p[4] is not None for p in phases):
            axes[0].plot(xs, ys, color="grey", lw=0.8, ls=":",
                         label="capacity (workers x 1 step/s)")
        axes[0].set_xlabel("time (s)")
        axes[0].set_ylabel("applied local steps per second")
        axes[0].set_title("elastic 1-2-4-8-4-2-1 workers")
        axes[0].legend(fontsize=7)
        axes[0].grid(alpha=0.3)
        for start, end, workers, _, _ in phases:
            axes[1].axvline(start, color="grey", lw=0.5)
        axes[1].set_yscale("log")
        axes[1].set_xlabel("virtual time (s)")
        axes[1].set_ylabel("held-out perplexity")
        axes[1].set_title("elastic: perplexity")
        axes[1].grid(alpha=0.3)
        save(fig, "elastic.png")
    return written


# ---------------------------------------------------------------------------------------------
# summary.md


def _table(header, rows):
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def _f(v, digits=2, pct=False):
    if v is None:
        return "-"
    return f"{100 * v:.{digits}f}%" if pct else f"{v:.{digits}f}"


def findings(results, backend="sim"):
    """The papers' qualitative findings checked on these results: [(name, holds or None, text)].
    None = not enough runs to check. Loopback runs are bounded by wall time, not local steps,
    so the equal-update comparisons (paper 002 Table 1) are left out for them."""
    out = []
    levels = [lv for lv in grid.LEVEL_ORDER if _cell(results, "heterogeneity", "sync", level=lv)]
    if backend != "sim":
        levels = []

    def ppl(policy, level, key="tail_perplexity"):
        return _mean(x[key] for x in _cell(results, "heterogeneity", policy, level=level))

    def ttt(policy, level):
        return _mean(x["time_to_target"]
                     for x in _cell(results, "heterogeneity", policy, level=level))

    if levels and _cell(results, "heterogeneity", "async-nesterov"):
        parts, ok = [], True
        for lv in levels:
            s, a = ppl("sync", lv), ppl("async-nesterov", lv)
            if s is None or a is None:
                continue
            ok = ok and a > 1.01 * s
            fin = (ppl("async-nesterov", lv, "final_perplexity") /
                   ppl("sync", lv, "final_perplexity") - 1)
            parts.append(f"{lv}: {a:.3f} vs {s:.3f} ({100 * (a / s - 1):+.1f}%; final "
                         f"{100 * fin:+.1f}%)")
        out.append(("paper 002 Table 1: async Nesterov is worse than sync DiLoCo at equal local "
                    "updates (perplexity averaged over the last 10% of the steps, async-nesterov "
                    "vs sync; holds if more than 1% worse at every level)", ok, "; ".join(parts)))
    for dn in ("async-dn-dylu", "async-dn-dylu-grace-inf"):
        if not (levels and _cell(results, "heterogeneity", dn)):
            continue
        parts, ok = [], True
        for lv in levels:
            s, d = ppl("sync", lv), ppl(dn, lv)
            if s is None or d is None:
                continue
            rel = d / s - 1
            ok = ok and rel <= 0.02
            fin = ppl(dn, lv, "final_perplexity") / ppl("sync", lv, "final_perplexity") - 1
            parts.append(f"{lv}: {d:.3f} vs {s:.3f} ({100 * rel:+.1f}%; final {100 * fin:+.1f}%)")
        out.append((f"paper 002 Table 1: async DN+DyLU ({dn}) is within 1-2% of sync DiLoCo at "
                    "every heterogeneity level (perplexity averaged over the last 10% of the "
                    "steps; holds if no more than 2% worse)", ok, "; ".join(parts)))
    dns = [d for d in ("async-dn-dylu-grace-inf", "async-dn-dylu")
           if _cell(results, "heterogeneity", d)]
    if levels and dns:
        dn = dns[0]
        parts, speedups = [], []
        for lv in levels:
            s, d = ttt("sync", lv), ttt(dn, lv)
            if s is None or d is None:
                parts.append(f"{lv}: sync {_f(s, 0)} s, {dn} {_f(d, 0)} s")
                continue
            speedups.append(s / d)
            parts.append(f"{lv}: sync {s:.0f} s, {dn} {d:.0f} s (x{s / d:.2f})")
        ok = None
        if len(speedups) >= 2:
            ok = all(b >= a - 0.05 for a, b in zip(speedups, speedups[1:])) and speedups[-1] > 1
        out.append((f"paper 002: async DN+DyLU ({dn}) beats sync in virtual time to a target "
                    "perplexity and the gap grows with heterogeneity (target: the worse of the "
                    "two final perplexities at that level)", ok, "; ".join(parts)))
    cons = [r["row"] for r in results if r["row"]["family"] == "consistent"]
    if cons:
        lags = sorted(set(r["lag"] for r in cons if r["lag"] > 0))
        k = cons[0]["workers"]
        parts, ok = [], True
        for policy in _policies(results, "consistent"):
            vals = []
            for lag in lags:
                v = _mean(x["throughput_retention"] for x in _cell(results, "consistent", policy,
                                                                   lag=lag))
                vals.append(v)
                if v is None:
                    continue
                if policy == "sync":
                    ok = ok and abs(v - 1 / (1 + lag)) <= 0.05
                else:
                    # Paper 000's lags are 0.3-1x of a step; beyond that even a perfect
                    # policy loses the straggler's own compute: (k-1+1/(1+lag))/k.
                    ideal = (k - 1 + 1 / (1 + lag)) / k
                    ok = ok and v >= 0.98 * ideal and (lag > 1 or v >= 0.9)
            parts.append(f"{policy}: " + ", ".join(
                f"lag {lag:g}: {_f(v, 3)}" for lag, v in zip(lags, vals)))
        parts.append("ideal async: " + ", ".join(
            f"lag {lag:g}: {(k - 1 + 1 / (1 + lag)) / k:.3f}" for lag in lags))
        out.append((f"paper 000 Table 6: with one consistent straggler ({k} workers) sync "
                    "throughput falls to ~1/(1+lag) (within 0.05) while A-EDiT and async keep "
                    ">= 90% (checked at lags <= 1x, the paper's range; at every lag they must "
                    "keep >= 98% of the ideal (k-1+1/(1+lag))/k, which is 0.9 at lag 4x for "
                    "k = 8)", ok, "; ".join(parts)))
    return out


def write_summary(out_dir, results, meta, plots, backend="sim"):
    lines = ["# Straggler simulations", ""]
    lines.append(f"Command: `{meta['command']}`  ")
    lines.append(f"Back end: {meta['backend']}; machine: {meta['machine']}; date: {meta['date']}; "
                 f"wall time: {meta['wall_seconds']:.0f} s for {len(results)} runs "
                 f"({meta['reused']} reused from an earlier invocation; the runs themselves "
                 f"took {sum(r['row']['wall_seconds'] or 0 for r in results):.0f} s of "
                 f"process time, {meta['jobs']} at a time).")
    lines.append("")
    fam = lambda f: [r for r in results if r["row"]["family"] == f]  # noqa: E731

    if fam("heterogeneity"):
        rows0 = fam("heterogeneity")[0]["row"]
        levels = [lv for lv in grid.LEVEL_ORDER if _values(results, "heterogeneity", "level")
                  .count(lv)]
        lines += ["## Heterogeneity x policy", "",
                  f"{rows0['workers']} workers, H = {rows0['local_steps_h']}, "
                  f"trainer {rows0['trainer']}; speeds (steps/s): " +
                  "; ".join(f"{lv} ({', '.join(f'{v:g}' for v in grid.LEVELS[lv])})"
                            for lv in levels) +
                  ". " + (f"All runs stop at the same number of local steps "
                          f"({rows0['local_steps']} in all). " if backend == "sim" else
                          "Loopback: every run lasts the same wall time (--real-seconds), so "
                          "they compare at equal time, not equal local steps. ") +
                  "Target perplexity: the worse of sync's and "
                  "DN+DyLU's (grace inf) final values at that level. Utilization: steps/s "
                  "applied over the sum of the speeds.", ""]

        def table(title, metric, digits, with_rel=False):
            sync_ref = {lv: _mean(x[metric] for x in _cell(results, "heterogeneity", "sync",
                                                           level=lv)) for lv in levels}
            body = []
            for policy in _policies(results, "heterogeneity"):
                row = [policy]
                for lv in levels:
                    v = _mean(x[metric] for x in _cell(results, "heterogeneity", policy,
                                                       level=lv))
                    rel = ""
                    if with_rel and v and sync_ref.get(lv) and policy != "sync":
                        rel = f" ({100 * (v / sync_ref[lv] - 1):+.1f}%)"
                    row.append(_f(v, digits) + rel)
                body.append(row)
            return [f"{title}:", "", _table(["policy"] + levels, body), ""]

        lines += table("Final held-out perplexity (vs sync)", "final_perplexity", 3, True)
        lines += table("Mean perplexity over the last 10% of the steps (vs sync)",
                       "tail_perplexity", 3, True)
        lines += table("Virtual seconds to the target perplexity", "time_to_target", 0)
        lines += table("Utilization", "utilization", 2)
        lines += table("Mean staleness (versions)", "staleness_mean", 2)

    if fam("consistent"):
        r0 = fam("consistent")[0]["row"]
        lags = sorted(set(r["row"]["lag"] for r in fam("consistent")))
        lines += ["## Consistent straggler", "",
                  f"{r0['workers']} workers at 1 step/s, the last one slowed to 1/(1+lag), "
                  f"H = {r0['local_steps_h']}, {r0['virtual_seconds']:.0f} virtual s per run, "
                  f"trainer {r0['trainer']}. Throughput retention = tokens/s vs the same policy "
                  f"at lag 0 (absolute tokens/s at lag 0 in the last column). Ideal with one "
                  f"worker slowed: sync 1/(1+lag); async (k-1+1/(1+lag))/k.", ""]
        header = ["policy"] + [f"lag {lag:g}x" for lag in lags] + ["tokens/s at lag 0"]
        body = []
        for policy in _policies(results, "consistent"):
            row = [policy]
            for lag in lags:
                row.append(_f(_mean(x["throughput_retention"] for x in _cell(
                    results, "consistent", policy, lag=lag)), 3))
            row.append(_f(_mean(x["tokens_per_second"] for x in _cell(
                results, "consistent", policy, lag=lags[0])), 0))
            body.append(row)
        ideal_sync = ["ideal sync"] + [_f(1 / (1 + lag), 3) for lag in lags] + [""]
        k = r0["workers"]
        ideal_async = ["ideal async"] + [_f((k - 1 + 1 / (1 + lag)) / k, 3) for lag in lags] + [""]
        lines += [_table(header, body + [ideal_sync, ideal_async]), ""]

    if fam("random"):
        r0 = fam("random")[0]["row"]
        cells = sorted(set((r["row"]["straggle_p"], r["row"]["lag"]) for r in fam("random")))
        lines += ["## Random stragglers", "",
                  f"{r0['workers']} workers at 1 step/s; every step of every worker is delayed "
                  f"by lag seconds with probability p (seeded step-time traces), H = "
                  f"{r0['local_steps_h']}, {r0['virtual_seconds']:.0f} virtual s per run. "
                  "Throughput retention vs p = 0; every worker's mean speed falls to "
                  "1/(1+p lag), the ideal for any policy.", ""]
        header = ["policy"] + [f"p {p:g}, lag {lag:g}" for p, lag in cells]
        body = []
        for policy in _policies(results, "random"):
            body.append([policy] + [_f(_mean(x["throughput_retention"] for x in _cell(
                results, "random", policy, straggle_p=p, lag=lag)), 3) for p, lag in cells])
        body.append(["ideal 1/(1+p lag)"] + [_f(1 / (1 + p * lag), 3) for p, lag in cells])
        lines += [_table(header, body), ""]

    if fam("elastic"):
        r0 = fam("elastic")[0]
        phases = r0.get("phases") or []
        lines += ["## Elastic 1-2-4-8-4-2-1", "",
                  f"8 workers at 1 step/s join and leave (graceful; work in flight is lost) "
                  f"every {r0['row']['phase_seconds']:g} virtual s (inside rounds), H = "
                  f"{r0['row']['local_steps_h']}, trainer {r0['row']['trainer']}. Utilization of "
                  "each phase: local steps computed in it that ended up applied (each update's "
                  "steps spread over the time they were computed) / (workers x phase length); "
                  "and the final perplexity.", ""]
        util = all(p[4] is not None for p in phases)
        if not util:
            lines += ["(Loopback: steps/s applied in each phase instead of utilization.)", ""]
        header = ["policy"] + [f"{w} workers" for _, _, w, _, _ in phases] + ["final ppl"]
        body = []
        for r in fam("elastic"):
            body.append([r["row"]["policy"]] + [_f(p[4] if util else p[3], 2)
                                                for p in r.get("phases") or []]
                        + [_f(r["row"]["final_perplexity"], 3)])
        lines += [_table(header, body), ""]

    checks = findings(results, backend)
    verdicts = [("holds" if ok else ("not checked" if ok is None else "DOES NOT HOLD"), name,
                 text) for name, ok, text in checks]
    write_markdown(os.path.join(out_dir, "summary.md"), lines, "Paper findings", verdicts, plots)
    return checks


def write_markdown(path, lines, findings_title, verdicts, plots):
    """Writes `lines`, then a section `findings_title` with one bullet per (verdict, name, text)
    (none without verdicts), then the plots' images, to `path`."""
    lines = list(lines)
    if verdicts:
        lines += [f"## {findings_title}", ""]
        lines += [f"- **{verdict}**: {name}. {text}." for verdict, name, text in verdicts]
        lines.append("")
    if plots:
        lines += ["## Plots", ""] + [f"![{p}]({p})" for p in plots] + [""]
    with open(path, "w") as f:
        f.write("\n".join(lines))
