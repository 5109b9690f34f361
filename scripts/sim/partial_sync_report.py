"""Outputs of scripts/simulate-partial-sync: runs.csv, curves.csv, PNG plots and summary.md with
the two findings checked (paper 003 Tables 1-2; Streaming DiLoCo's K-fold lower peak bandwidth).

Cells of one key (policy, link rate, K, schedule, bubble filling) differ only by seed; tables and
findings use the mean over seeds and leave a key out when any of its runs did not finish.
"""

import math
import os
import statistics

from . import report as straggler_report

RUN_COLUMNS = [
    "run_id", "status", "policy", "schedule", "groups", "fill_bubbles", "merge_delay_steps",
    "mixing_alpha", "link", "rate_mbit", "latency_ms", "peak_window", "workers", "step_seconds",
    "local_steps_h", "seed", "trainer", "stop_reason", "wall_seconds", "local_steps", "versions",
    "virtual_seconds", "final_eval_loss", "final_perplexity", "tail_perplexity", "target_loss",
    "target_perplexity", "time_to_target", "peak_up_bytes_per_second", "peak_up_max",
    "peak_down_max", "bytes_up_mean", "updates_mean", "utilization", "utilization_mean", "note",
]
CURVE_COLUMNS = ["run_id", "policy", "schedule", "groups", "fill_bubbles", "rate_mbit", "seed",
                 "virtual_time", "local_steps", "version", "eval_loss", "perplexity"]

# Perplexity tolerances of the findings: "the same or better" (a) and "within 2%" (b).
SAME_PPL = 0.01
STREAMING_PPL = 0.02
# (b): "about K x lower" peak bandwidth = at least this share of K.
PEAK_SHARE = 0.75

HOLDS, FAILS, UNCHECKED = "holds", "does not hold", "not checked"

K_COLORS = {1: "black", 2: "tab:blue", 4: "tab:green", 8: "tab:red", 16: "tab:purple"}
SCHEDULE_STYLE = {"full": "-", "strided": "-", "enp": "--", "dreamddp": ":"}


def _ppl(loss):
    return math.exp(min(loss, 700))


def write_csvs(out_dir, results):
    straggler_report.write_csv(os.path.join(out_dir, "runs.csv"), RUN_COLUMNS,
                               [r["row"] for r in results])
    curves = []
    for r in results:
        row = r["row"]
        base = {c: row[c] for c in CURVE_COLUMNS[:7]}
        for t, steps, version, loss in r["curve"]:
            curves.append(dict(base, virtual_time=t, local_steps=steps, version=version,
                               eval_loss=loss, perplexity=_ppl(loss)))
    straggler_report.write_csv(os.path.join(out_dir, "curves.csv"), CURVE_COLUMNS, curves)


def key_of(row):
    return (row["policy"], row["rate_mbit"], row["groups"], row["schedule"],
            bool(row["fill_bubbles"]))


def by_key(results):
    keys = {}
    for r in results:
        keys.setdefault(key_of(r["row"]), []).append(r["row"])
    return keys


def mean(rows, metric):
    """Mean of `metric` over the seeds of one key; None if a run is not ok or lacks it."""
    if not rows or any(r["status"] != "ok" or r.get(metric) is None for r in rows):
        return None
    return statistics.fmean(r[metric] for r in rows)


def _label(row_or_key):
    policy, rate, k, schedule, fill = (row_or_key if isinstance(row_or_key, tuple)
                                       else key_of(row_or_key))
    if schedule == "full":
        return "K=1 full model"
    return f"K={k} {schedule}{'+fill' if fill else ''}"


def _rate(rate):
    return "inf" if math.isinf(rate) else f"{rate:g} Mbit/s"


def _order(keys):
    sched = ["full", "strided", "enp", "dreamddp"]
    pol = ["sync", "async-dn-dylu"]
    return sorted(keys, key=lambda k: (pol.index(k[0]) if k[0] in pol else 9, k[1], k[2] != 1,
                                       sched.index(k[3]) if k[3] in sched else 9, k[2], k[4]))


def _pct(a, b):
    return f"{100 * (a / b - 1):+.1f}%"


# ---------------------------------------------------------------------------------------------
# Plots


def _finish(ax, xlabel, ylabel, title):
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    if ax.lines:
        ax.legend(fontsize=7)


def write_plots(out_dir, results):
    """Writes the four PNGs; returns their file names."""
    written = []
    plt, save = straggler_report.plot_saver(out_dir, written)
    seed = min((r["row"]["seed"] for r in results), default=1)
    ok = [r for r in results if r["row"]["status"] == "ok" and r["row"]["seed"] == seed]
    policies = [p for p in ("sync", "async-dn-dylu") if any(r["row"]["policy"] == p for r in ok)]
    rates = sorted(set(r["row"]["rate_mbit"] for r in results))

    def style(row):
        return (K_COLORS.get(row["groups"], "grey"),
                "-." if row["fill_bubbles"] else SCHEDULE_STYLE.get(row["schedule"], "-"))

    rows_n = max(1, len(policies))
    for xkey, name, xlabel in ((1, "perplexity_vs_local_steps.png", "local steps (all workers)"),
                               (0, "perplexity_vs_time.png", "virtual wall-clock (s)")):
        fig, axes = plt.subplots(rows_n, len(rates), figsize=(4.2 * len(rates), 3.4 * rows_n),
                                 sharey=True, squeeze=False)
        for i, policy in enumerate(policies or [""]):
            for j, rate in enumerate(rates):
                ax = axes[i][j]
                for r in ok:
                    row = r["row"]
                    if row["policy"] != policy or row["rate_mbit"] != rate:
                        continue
                    color, ls = style(row)
                    ax.plot([p[xkey] for p in r["curve"]], [_ppl(p[3]) for p in r["curve"]], ls,
                            color=color, lw=1.3, label=_label(row))
                ax.set_yscale("log")
                _finish(ax, xlabel, "held-out perplexity" if j == 0 else "",
                        f"{policy}, links {_rate(rate)}")
        save(fig, name)

    fig, axes = plt.subplots(1, max(1, len(policies)), figsize=(5 * max(1, len(policies)), 3.6),
                             squeeze=False)
    for ax, policy in zip(axes[0], policies or [""]):
        for rate in rates:
            pts = sorted((r["row"]["groups"], r["row"]["peak_up_max"]) for r in ok
                         if r["row"]["policy"] == policy and r["row"]["rate_mbit"] == rate
                         and r["row"]["schedule"] in ("full", "strided"))
            if pts:
                ax.plot([p[0] for p in pts], [p[1] / 1e6 for p in pts], "o-",
                        label=f"links {_rate(rate)}")
        top = [r["row"]["peak_up_max"] for r in ok if r["row"]["policy"] == policy
               and r["row"]["rate_mbit"] == rates[-1] and r["row"]["groups"] == 1]
        ks = sorted(set(r["row"]["groups"] for r in ok if r["row"]["schedule"] in ("full",
                                                                                   "strided")))
        if top and ks:
            ax.plot(ks, [top[0] / 1e6 / k for k in ks], ":", color="grey",
                    label="K=1 peak / K")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        _finish(ax, "layer groups K (strided)", "peak upload per worker (MB/s)",
                f"{policy}: peak bytes/s vs K")
    save(fig, "peak_bandwidth_vs_k.png")

    fig, axes = plt.subplots(1, max(1, len(policies)), figsize=(5 * max(1, len(policies)), 3.6),
                             squeeze=False)
    for ax, policy in zip(axes[0], policies or [""]):
        keys = _order(set(key_of(r["row"]) for r in ok if r["row"]["policy"] == policy))
        for variant in dict.fromkeys(k[2:] for k in keys):
            pts = sorted((r["row"]["rate_mbit"], r["row"]["utilization_mean"]) for r in ok
                         if r["row"]["policy"] == policy and key_of(r["row"])[2:] == variant)
            finite = [p for p in pts if not math.isinf(p[0])]
            if finite:
                color, ls = style({"groups": variant[0], "schedule": variant[1],
                                   "fill_bubbles": variant[2]})
                ax.plot([p[0] for p in finite], [p[1] for p in finite], "o" + ls, color=color,
                        label=_label((policy, 0, *variant)))
        ax.set_xscale("log")
        ax.set_ylim(0, 1.05)
        _finish(ax, "link rate per worker (Mbit/s)", "mean compute utilization",
                f"{policy}: utilization vs bandwidth")
    save(fig, "utilization_vs_bandwidth.png")
    return written


# ---------------------------------------------------------------------------------------------
# Findings


def _verdict(oks):
    if not oks:
        return UNCHECKED
    return HOLDS if all(oks) else FAILS


def _missing(keys, cells):
    out = []
    for k in keys:
        rows = cells.get(k)
        if not rows:
            out.append(f"{_label(k)} ({k[0]}, {_rate(k[1])}) not in the grid")
        elif any(r["status"] != "ok" for r in rows):
            bad = next(r for r in rows if r["status"] != "ok")
            out.append(f"{_label(k)} ({k[0]}, {_rate(k[1])}) {bad['status']}")
    return out


def finding_a(results, compare_k):
    """Paper 003 Tables 1-2 at the lowest link rate: (name, verdict, text)."""
    cells = by_key(results)
    name = ("(a) paper 003 Tables 1-2: PLSGD-ENP and DreamDDP beat full-model local SGD (K = 1) "
            "in wall-clock at the lowest bandwidth, with the same or better perplexity at equal "
            f"local steps (tail perplexity at most {100 * SAME_PPL:g}% above), and DreamDDP is at "
            "least as good as PLSGD-ENP (wall-clock no later, perplexity at most "
            f"{100 * SAME_PPL:g}% above); DreamDDP with bubble filling under async aggregation")
    if not results:
        return name, UNCHECKED, "no runs"
    if compare_k <= 1:
        return name, UNCHECKED, "no ENP or DreamDDP cells in the grid (--compare_k)"
    low = min(r["row"]["rate_mbit"] for r in results)
    parts, oks = [], []
    for policy in dict.fromkeys(r["row"]["policy"] for r in results):
        is_async = any(r["row"]["policy"] == policy and r["row"]["fill_bubbles"]
                       for r in results)
        keys = [(policy, low, 1, "full", False), (policy, low, compare_k, "enp", False),
                (policy, low, compare_k, "dreamddp", is_async)]
        missing = _missing(keys, cells)
        if missing:
            parts.append(f"{policy}: not compared ({'; '.join(missing)})")
            continue
        base, enp, dd = (cells[k] for k in keys)
        t = [mean(c, "virtual_seconds") for c in (base, enp, dd)]
        p = [mean(c, "tail_perplexity") for c in (base, enp, dd)]
        tt = [mean(c, "time_to_target") for c in (base, enp, dd)]
        if None in t or None in p:
            parts.append(f"{policy}: not compared (a run has no time or perplexity)")
            continue
        ok = (t[1] < t[0] and t[2] < t[0] and p[1] <= (1 + SAME_PPL) * p[0]
              and p[2] <= (1 + SAME_PPL) * p[0] and t[2] <= t[1] * 1.001
              and p[2] <= (1 + SAME_PPL) * p[1])
        oks.append(ok)
        dd_name = "DreamDDP" + ("+fill" if is_async else "")
        steps = mean(base, "local_steps")
        parts.append(
            f"{policy}, K = {compare_k}, links {_rate(low)}: virtual s to {steps:.0f} local steps "
            f"K=1 {t[0]:.1f}, ENP {t[1]:.1f} (x{t[0] / t[1]:.2f} faster), {dd_name} {t[2]:.1f} "
            f"(x{t[0] / t[2]:.2f}); to the target "
            + ", ".join(f"{n} {'never' if v is None else f'{v:.1f}'}"
                        for n, v in zip(("K=1", "ENP", dd_name), tt))
            + f"; tail perplexity K=1 {p[0]:.3f}, ENP {p[1]:.3f} ({_pct(p[1], p[0])}), "
            f"{dd_name} {p[2]:.3f} ({_pct(p[2], p[0])}; vs ENP {_pct(p[2], p[1])})")
    return name, _verdict(oks), "; ".join(parts)


def finding_b(results):
    """Streaming DiLoCo: strided K groups within 2% of K = 1 in perplexity at equal steps at
    every link rate, and about K x lower peak upload bytes/s at the fastest link."""
    cells = by_key(results)
    name = (f"(b) streaming (strided) with K groups stays within {100 * STREAMING_PPL:g}% of "
            "K = 1 in perplexity at equal local steps (tail perplexity, at every link rate) with "
            f"about K x lower peak upload bytes/s per worker (at least {PEAK_SHARE:g} K, "
            "measured at the fastest link)")
    if not results:
        return name, UNCHECKED, "no runs"
    rates = sorted(set(r["row"]["rate_mbit"] for r in results))
    high = rates[-1]
    parts, oks = [], []
    for policy in dict.fromkeys(r["row"]["policy"] for r in results):
        ks = sorted(set(r["row"]["groups"] for r in results if r["row"]["policy"] == policy
                        and r["row"]["schedule"] == "strided"))
        for k in ks:
            keys = [(policy, rate, g, s, False) for rate in rates
                    for g, s in ((1, "full"), (k, "strided"))]
            missing = _missing(keys, cells)
            if missing:
                parts.append(f"{policy} K={k}: not compared ({'; '.join(missing)})")
                continue
            ppl = {(rate, g): mean(cells[(policy, rate, g, s, False)], "tail_perplexity")
                   for rate in rates for g, s in ((1, "full"), (k, "strided"))}
            peak1 = mean(cells[(policy, high, 1, "full", False)], "peak_up_max")
            peakk = mean(cells[(policy, high, k, "strided", False)], "peak_up_max")
            if None in ppl.values() or None in (peak1, peakk):
                parts.append(f"{policy} K={k}: not compared (a run has no perplexity or peak)")
                continue
            deltas = [ppl[(rate, k)] / ppl[(rate, 1)] - 1 for rate in rates]
            cut = peak1 / peakk if peakk else math.inf
            ok = all(d <= STREAMING_PPL for d in deltas) and cut >= PEAK_SHARE * k
            oks.append(ok)
            parts.append(
                f"{policy} K={k}: perplexity vs K=1 "
                + ", ".join(f"{100 * d:+.1f}%" for d in deltas)
                + f" (at {', '.join(_rate(r) for r in rates)}); peak upload at {_rate(high)} "
                f"{peak1 / 1e6:.2f} -> {peakk / 1e6:.2f} MB/s (x{cut:.2f} lower, K = {k})")
    if not parts:
        return name, UNCHECKED, "no strided cells with K > 1 in the grid (--groups)"
    cap = _cap_note(cells, high)
    return name, _verdict(oks), "; ".join(parts) + (f". {cap}" if cap else "")


def _cap_note(cells, high):
    """Whether the fastest link could have capped the K = 1 peak: a full-model upload that takes
    longer than the peak window is measured at the link rate, not at the model's burst."""
    for (policy, rate, k, schedule, _), rows in cells.items():
        if rate != high or k != 1 or mean(rows, "bytes_up_mean") is None:
            continue
        per_push = mean(rows, "bytes_up_mean") / max(1.0, mean(rows, "updates_mean"))
        window = rows[0]["peak_window"]
        if math.isinf(high):
            return (f"Links 'inf': every upload is instant, so the peak is the bytes of the "
                    f"uploads in one window ({per_push / 1e6:.2f} MB per full-model push)")
        seconds = per_push * 8 / (high * 1e6)
        text = (f"A full-model push ({per_push / 1e6:.2f} MB) takes {seconds * 1e3:.1f} ms at "
                f"{_rate(high)}")
        text += (f", {'within' if seconds <= window else 'longer than'} the "
                 f"{window * 1e3:.0f} ms peak window"
                 + ("" if seconds <= window else ": the link caps the K=1 peak at its rate, so "
                    "the measured cut understates the burst cut"))
        return text
    return ""


def findings(results, compare_k):
    return [finding_a(results, compare_k), finding_b(results)]


# ---------------------------------------------------------------------------------------------
# summary.md


def _table(results):
    cells = by_key(results)
    header = ["policy", "links", "K", "schedule", "status", "local steps",
              "tail ppl (vs K=1)", "final ppl", "virtual s (vs K=1)", "s to target",
              "peak up MB/s", "utilization"]
    body = []
    for k in _order(cells):
        rows = cells[k]
        base = cells.get((k[0], k[1], 1, "full", False))
        status = "/".join(dict.fromkeys(r["status"] for r in rows))

        def rel(metric, digits):
            v = mean(rows, metric)
            if v is None:
                return "-"
            b = mean(base, metric) if base else None
            return f"{v:.{digits}f}" + (f" ({_pct(v, b)})" if b and k[2] != 1 else "")

        peak = mean(rows, "peak_up_max")
        body.append([k[0], _rate(k[1]), k[2], k[3] + (" + fill" if k[4] else ""), status,
                     straggler_report._f(mean(rows, "local_steps"), 0), rel("tail_perplexity", 3),
                     straggler_report._f(mean(rows, "final_perplexity"), 3),
                     rel("virtual_seconds", 1),
                     straggler_report._f(mean(rows, "time_to_target"), 1),
                     "-" if peak is None else f"{peak / 1e6:.2f}",
                     straggler_report._f(mean(rows, "utilization_mean"), 2)])
    return straggler_report._table(header, body)


def write_summary(out_dir, results, meta, plots):
    s = meta["settings"]
    checks = findings(results, s.compare_k)
    ok = [r for r in results if r["row"]["status"] == "ok"]
    targets = sorted(set((r["row"]["policy"], round(r["row"]["target_perplexity"], 3))
                         for r in ok if r["row"].get("target_perplexity")))
    lines = [
        "# Partial synchronization simulations", "",
        f"Command: `{meta['command']}`  ",
        f"Host: {meta['machine']}; date: {meta['date']}; simulator: `{meta['binary']}`; "
        f"{len(results)} runs ({len(ok)} ok) in {meta['wall_seconds']:.0f} s wall, "
        f"{meta['jobs']} at a time.", "",
        "## Setup", "",
        f"{len(s.speeds)} workers at {', '.join(f'{v:g}' for v in s.speeds)} steps/s, "
        f"H = {s.local_steps}, trainer {s.trainer}, every run stopped at {s.steps} local steps "
        f"(all workers together). Each worker's link: {', '.join(_rate(r) for r in s.rates)}, "
        f"{s.latency_ms:g} ms one way; no overlap of whole-model rounds (`--overlap off`). "
        f"Strided cells merge after tau = {s.merge_delay_steps} step(s) with mixing alpha "
        f"{s.mixing_alpha:g}; ENP and DreamDDP cells synchronize in place (tau 0, alpha 0). "
        f"Peak bytes/s: the most bytes uploaded in any {s.window():g} s window. Tail perplexity: "
        "mean over the evaluations in the last 10% of the local steps. Target: "
        + (", ".join(f"{p} perplexity {t:g}" for p, t in targets) or "none")
        + " (the policy's K = 1 final loss + ln 1.02 unless --target_loss).", "",
        _table(results), "",
    ]
    for status, what in (("refused", "were refused by this aloe-sim"),
                         ("rejected", "ran without a single push applied")):
        bad = [r["row"] for r in results if r["row"]["status"] == status]
        if bad:
            lines += [f"{len(bad)} runs {what} (it does not simulate layer-group pushes), e.g. "
                      f"{bad[0]['run_id']}: {bad[0]['note']}", ""]
    straggler_report.write_markdown(os.path.join(out_dir, "summary.md"), lines, "Findings",
                                    [(v, name, text) for name, v, text in checks], plots)
    return checks
