"""Command line, cells, runner and report of scripts/simulate-compression (see HELP): the quality
of compressed pushes, a small LM trained through aloe-sim once per codec, with and without error
feedback. aloe-sim encodes every push as aloe-worker does and applies what the server decodes
(sim/push_codec.h), so the final held-out loss shows what each codec costs."""

import argparse
import concurrent.futures
import csv
import dataclasses
import datetime
import os
import shlex
import subprocess
import sys
import time

from . import backends
from . import cli
from . import textproto

PROG = "scripts/simulate-compression"

HELP = """\
Quality of compressed pushes (docs/compression.md): the same small LM trained through aloe-sim
with every push codec, each with and without error feedback, and the final held-out loss set
against the bytes pushed. aloe-sim encodes each simulated worker's pseudo-gradient as aloe-worker
does (per-worker error-feedback residuals, per-worker low-rank warm starts) and the server core
applies what the server decodes from those bytes.

Cells (default; --quick in brackets):
  float32                     the baseline (error feedback has nothing to keep: run once)
  bf16, int8, int4            every layer blockwise (int8 blocks of 256, int4 of 64) [int8, int4]
  low-rank r, fp32 factors    every layer CODEC_LOWRANK at rank r in 4, 16, 64 [none]; 1-D
                              tensors (biases, norms) go as float32
  low-rank r, int4 factors    the same with int4 factors [r = 4, 16]
  adaptive                    low-rank + int4 factors with transport.adaptive_rank (paper 001
                              Alg. 3: window 5, energy share 0.9) from r = 16, when this aloe-sim
                              has it (left out otherwise); adapt_local_steps off, so that every
                              cell trains the same local steps
  each with error feedback off and on [off and on for int4 and r = 16 + int4; off for the rest]
Setup: sync DiLoCo (outer Nesterov lr 0.7, beta 0.9; every round averages all workers), 2
workers of equal speed, H = 20 local steps, 12 rounds [H = 10, 8 rounds]; the
byte-level LM of deploy/configs/sim-small.textproto (d_model 128, 2 blocks, ~0.47M parameters)
[d_model 64, 1 block, ~87k] over the corpus in --corpus_dir (prepared when missing). The
same seed everywhere, so only the codec differs between cells. Evaluations: version 0 and the
final version, on --eval_sequences held-out sequences.

Outputs in --out (default out/compression):
  runs.csv    one row per cell: run_id codec rank factor_codec error_feedback status
              final_eval_loss loss_change_pct pushed_bytes bytes_ratio compression local_steps
              versions wall_seconds note
              (loss_change_pct = 100 (loss / float32's - 1); bytes_ratio = bytes / float32's
              bytes; compression = its inverse)
  table.md    the table (markdown) with the host, date and command
  runs/<run_id>/   config.textproto, sim.csv, log.txt
"""

BASE_CONFIG = "sim-small.textproto"
MODEL_FULL = "{ vocab_size: 256 seq_len: 64 d_model: 128 num_layers: 2 num_heads: 4 ffn_mult: 4 }"
MODEL_QUICK = "{ vocab_size: 256 seq_len: 64 d_model: 64 num_layers: 1 num_heads: 4 ffn_mult: 4 }"


def layer_names(num_layers):
    """The layers of the built-in transformer (common/model_spec.cc)."""
    return ["embed"] + [f"blocks.{i}" for i in range(num_layers)] + ["head"]


RUN_COLUMNS = ("run_id codec rank factor_codec error_feedback status final_eval_loss "
               "loss_change_pct pushed_bytes bytes_ratio compression local_steps versions "
               "wall_seconds note").split()


@dataclasses.dataclass
class Cell:
    run_id: str
    codec: str  # fp32 bf16 int8 int4 lowrank adaptive
    rank: int = 0
    factor_codec: str = ""  # fp32 or int4 for low-rank
    error_feedback: bool = False

    def label(self):
        if self.codec == "lowrank":
            return f"low-rank r={self.rank}, {self.factor_codec} factors"
        if self.codec == "adaptive":
            return f"adaptive (from r={self.rank}), {self.factor_codec} factors"
        return {"fp32": "float32", "bf16": "bf16", "int8": "int8", "int4": "int4"}[self.codec]


@dataclasses.dataclass
class Settings:
    workers: int
    local_steps: int
    rounds: int
    model: str
    num_layers: int
    ranks: list
    int4_ranks: list
    blockwise: list
    ef_cells: object  # None = every cell both ways, else the run_id stems that also run with EF
    eval_sequences: int
    adaptive_rank: int = 16


def default_settings(quick):
    if quick:
        return Settings(workers=2, local_steps=10, rounds=8, model=MODEL_QUICK, num_layers=1,
                        ranks=[], int4_ranks=[4, 16], blockwise=["int8", "int4"],
                        ef_cells={"int4", "lr16-int4"}, eval_sequences=32)
    return Settings(workers=2, local_steps=20, rounds=12, model=MODEL_FULL, num_layers=2,
                    ranks=[4, 16, 64], int4_ranks=[4, 16, 64], blockwise=["bf16", "int8", "int4"],
                    ef_cells=None, eval_sequences=128)


CODEC_ENUM = {"fp32": "CODEC_FP32", "bf16": "CODEC_BF16", "int8": "CODEC_INT8_BLOCKWISE",
              "int4": "CODEC_INT4_BLOCKWISE"}


def transport(cell, s):
    """The transport block of a cell (text format)."""
    ef = " error_feedback: true" if cell.error_feedback else ""
    blocks = " int8_block_size: 256 int4_block_size: 64"
    if cell.codec in CODEC_ENUM:
        return f"{{ codec: {CODEC_ENUM[cell.codec]}{blocks}{ef} }}"
    layers = " ".join(
        f"layer_codecs {{ layer: \"{name}\" codec: CODEC_LOWRANK rank: {cell.rank} "
        f"factor_codec: {CODEC_ENUM[cell.factor_codec]} }}" for name in layer_names(s.num_layers))
    adaptive = ""
    if cell.codec == "adaptive":
        adaptive = " adaptive_rank { enabled: true }"
    return f"{{ codec: CODEC_FP32{blocks}{ef} {layers}{adaptive} }}"


def config_text(base, cell, s, corpus_dir):
    overrides = {
        "corpus_dir": f': "{corpus_dir}"',
        "model": s.model,
        "aggregation": f"{{ mode: AGGREGATION_SYNC min_workers: {s.workers} }}",
        "local_steps": f": {s.local_steps}",
        "max_versions": f": {s.rounds}",
        "eval_every": ": 0",
        "transport": transport(cell, s),
    }
    return textproto.merge(base, overrides, header=f"{cell.run_id}: {cell.label()}"
                           f"{', error feedback' if cell.error_feedback else ''}")


def build_cells(s, adaptive):
    stems = [Cell("fp32", "fp32")]
    stems += [Cell(c, c) for c in s.blockwise]
    stems += [Cell(f"lr{r}-fp32", "lowrank", r, "fp32") for r in s.ranks]
    stems += [Cell(f"lr{r}-int4", "lowrank", r, "int4") for r in s.int4_ranks]
    if adaptive:
        stems.append(Cell(f"adaptive{s.adaptive_rank}-int4", "adaptive", s.adaptive_rank, "int4"))
    cells = []
    for c in stems:
        cells.append(dataclasses.replace(c, run_id=f"{c.run_id}-noef"))
        # float32 leaves no residual: error feedback would repeat the same run.
        if c.codec != "fp32" and (s.ef_cells is None or c.run_id in s.ef_cells):
            cells.append(dataclasses.replace(c, run_id=f"{c.run_id}-ef", error_feedback=True))
    return cells


def parse_summary(text):
    """The key=value fields of aloe-sim's summary line."""
    for line in text.splitlines():
        if line.startswith("aloe-sim: stop="):
            return dict(f.split("=", 1) for f in line.split()[1:] if "=" in f)
    return {}


def sim_features(binary):
    """(has lossy pushes, has adaptive rank) of this aloe-sim, from its --help."""
    try:
        out = subprocess.run([binary, "--help"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             text=True, timeout=60).stdout
    except (OSError, subprocess.TimeoutExpired):
        return False, False
    return "pushed bytes" in out, "adaptive rank" in out


def run_cell(binary, cell, s, run_dir, corpus_dir, base, seed, trainer):
    os.makedirs(run_dir, exist_ok=True)
    config = config_text(base, cell, s, corpus_dir)
    with open(os.path.join(run_dir, "config.textproto"), "w") as f:
        f.write(config)
    cmd = [binary, f"--config={run_dir}/config.textproto", f"--trainer={trainer}",
           f"--out={run_dir}/sim.csv", f"--seed={seed}", "--eval_every=0",
           f"--eval_sequences={s.eval_sequences}", "--speeds=" + ",".join(["1"] * s.workers),
           "--torch_threads=1"]
    if trainer == "torch":
        cmd.append(f"--corpus_dir={corpus_dir}")
    start = time.monotonic()
    with open(os.path.join(run_dir, "log.txt"), "w") as log:
        log.write(" ".join(cmd) + "\n")
        log.flush()
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=log, env=backends.blas_env(),
                              text=True)
        log.write(proc.stdout)
    info = {"wall_seconds": time.monotonic() - start}
    summary = parse_summary(proc.stdout)
    if proc.returncode != 0 or not summary:
        with open(os.path.join(run_dir, "log.txt"), errors="replace") as f:
            tail = [ln.strip() for ln in f if ln.strip()][-1:]
        info.update(status="failed", note=(tail[0] if tail else "no output")[:240])
        return info
    # The loss as aloe-sim printed it (6 decimals): runs.csv keeps every digit.
    info.update(status="ok", note="", final_eval_loss=float(summary["final_eval_loss"]),
                pushed_bytes=int(summary["pushed_bytes"]), local_steps=int(summary["local_steps"]),
                versions=int(summary["versions"]))
    if int(summary.get("rejected", "0")) > 0:
        info["note"] = f"{summary['rejected']} pushes rejected"
    return info


def run_all(binary, cells, s, out_dir, corpus_dir, base, seed, trainer, jobs):
    start = time.monotonic()
    done = [0]

    def execute(cell):
        info = run_cell(binary, cell, s, os.path.join(out_dir, "runs", cell.run_id), corpus_dir,
                        base, seed, trainer)
        done[0] += 1
        loss = (f"loss {info['final_eval_loss']:.4f}, {info['pushed_bytes']} bytes"
                if info["status"] == "ok" else info["note"])
        print(f"  [{done[0]}/{len(cells)}] {cell.run_id}: {info['status']}, {loss}, "
              f"{info['wall_seconds']:.0f} s; {time.monotonic() - start:.0f} s elapsed",
              flush=True)
        return cell, info

    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        return list(pool.map(execute, cells))


def rows_of(finished):
    base = next((i for c, i in finished if c.codec == "fp32" and i["status"] == "ok"), None)
    rows = []
    for cell, info in finished:
        row = {"run_id": cell.run_id, "codec": cell.codec, "rank": cell.rank or "",
               "factor_codec": cell.factor_codec, "error_feedback": int(cell.error_feedback),
               "status": info["status"], "wall_seconds": f"{info['wall_seconds']:.1f}",
               "note": info.get("note", "")}
        if info["status"] == "ok":
            row.update(final_eval_loss=info["final_eval_loss"], pushed_bytes=info["pushed_bytes"],
                       local_steps=info["local_steps"], versions=info["versions"])
            if base is not None:
                row["loss_change_pct"] = 100 * (info["final_eval_loss"] /
                                                base["final_eval_loss"] - 1)
                row["bytes_ratio"] = info["pushed_bytes"] / base["pushed_bytes"]
                row["compression"] = base["pushed_bytes"] / info["pushed_bytes"]
        rows.append((cell, row))
    return rows


def _fmt_bytes(n):
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"


def table_markdown(rows):
    lines = ["| codec | error feedback | final held-out loss | vs float32 | bytes pushed | "
             "bytes / float32 | x fewer bytes |",
             "|---|---|---|---|---|---|---|"]
    for cell, r in rows:
        ef = "-" if cell.codec == "fp32" else ("on" if cell.error_feedback else "off")
        if r["status"] != "ok":
            lines.append(f"| {cell.label()} | {ef} | {r['status']}: {r['note']} | | | | |")
            continue
        change = f"{r['loss_change_pct']:+.2f}%" if "loss_change_pct" in r else ""
        ratio = f"{r['bytes_ratio']:.4f}" if "bytes_ratio" in r else ""
        fewer = f"{r['compression']:.1f}" if "compression" in r else ""
        lines.append(f"| {cell.label()} | {ef} | {r['final_eval_loss']:.4f} | {change} | "
                     f"{_fmt_bytes(r['pushed_bytes'])} | {ratio} | {fewer} |")
    return "\n".join(lines)


def write_outputs(out_dir, rows, meta):
    with open(os.path.join(out_dir, "runs.csv"), "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(RUN_COLUMNS)
        for _, r in rows:
            w.writerow([_csv_value(r.get(c, "")) for c in RUN_COLUMNS])
    s = meta["settings"]
    text = [f"# Push compression quality ({PROG})", "",
            f"Command: `{meta['command']}`  ",
            f"Host: {meta['machine']}; date: {meta['date']}; wall time "
            f"{meta['wall_seconds']:.0f} s ({meta['jobs']} runs at a time)  ",
            f"Setup: {s.workers} workers, sync DiLoCo, H = {s.local_steps}, {s.rounds} rounds "
            f"({s.workers * s.local_steps * s.rounds} local steps), model {s.model}, trainer "
            f"{meta['trainer']}, seed {meta['seed']}, {s.eval_sequences} held-out sequences",
            "", table_markdown(rows), ""]
    if not meta["adaptive"]:
        text.append("Adaptive rank: not in the table (this aloe-sim does not choose ranks).")
        text.append("")
    with open(os.path.join(out_dir, "table.md"), "w") as f:
        f.write("\n".join(text))


def _csv_value(v):
    if isinstance(v, float):
        return f"{v:.8g}"
    return v


def _ints(text, what):
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        values = []
    if any(v < 1 for v in values):
        raise SystemExit(f"{PROG}: {what} wants positive integers, got '{text}'")
    return values


def parse_args(argv):
    p = argparse.ArgumentParser(prog=PROG, description=HELP,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true",
                   help="a small grid for tests: 8 cells, a 1-block model, 160 local steps")
    p.add_argument("--out", default=os.path.join(cli.ROOT, "out", "compression"),
                   help="output directory (default: out/compression, git-ignored)")
    p.add_argument("--bin_dir", "--bin-dir", dest="bin_dir", default=None,
                   help="where aloe-sim is (default: build/bin of this checkout, built first)")
    p.add_argument("--jobs", type=int, default=2, help="aloe-sim runs in parallel (default 2)")
    p.add_argument("--rounds", type=int, default=0, help="outer rounds (default 12, quick 8)")
    p.add_argument("--local_steps", type=int, default=0, help="H (default 20, quick 10)")
    p.add_argument("--workers", type=int, default=0, help="simulated workers (default 2)")
    p.add_argument("--ranks", default=None,
                   help="low-rank ranks with float32 factors, e.g. 4,16,64 ('' = none)")
    p.add_argument("--int4_ranks", default=None,
                   help="low-rank ranks with int4 factors, e.g. 4,16,64 ('' = none)")
    p.add_argument("--no_adaptive", action="store_true", help="leave the adaptive cells out")
    p.add_argument("--only", default="",
                   help="run only these cells (comma-separated run ids, e.g. "
                        "fp32-noef,lr16-int4-ef); float32 is always run, as the baseline")
    p.add_argument("--eval_sequences", type=int, default=0,
                   help="held-out sequences of the final evaluation (default 128, quick 32)")
    p.add_argument("--trainer", choices=["torch", "synthetic"], default="torch",
                   help="torch: the LM over the corpus; synthetic: quadratics, for tests")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--corpus_dir", "--corpus-dir", dest="corpus_dir",
                   default=os.path.join(cli.ROOT, "data", "sotu"))
    p.add_argument("--configs_dir", "--configs-dir", dest="configs_dir",
                   default=os.path.join(cli.ROOT, "deploy", "configs"))
    return p.parse_args(argv)


def settings_from(args):
    s = default_settings(args.quick)
    for name in ("rounds", "local_steps", "workers", "eval_sequences"):
        if getattr(args, name) > 0:
            setattr(s, name, getattr(args, name))
    if args.ranks is not None:
        s.ranks = _ints(args.ranks, "--ranks")
    if args.int4_ranks is not None:
        s.int4_ranks = _ints(args.int4_ranks, "--int4_ranks")
    return s


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    s = settings_from(args)
    args.bin_dir = cli.bin_dir_of(args.bin_dir, ["aloe-sim", "aloe-corpus"], PROG)
    binary = os.path.join(args.bin_dir, "aloe-sim")
    if not os.access(binary, os.X_OK):
        print(f"{PROG}: aloe-sim not found: build it first (cmake --build build --target "
              f"aloe-sim; looked for {binary})", file=sys.stderr)
        return 2
    lossy, adaptive = sim_features(binary)
    if not lossy:
        print(f"{PROG}: {binary} does not simulate lossy pushes (no pushed bytes in its "
              "summary): build aloe-sim from a tree that has sim/push_codec.h", file=sys.stderr)
        return 2
    adaptive = adaptive and not args.no_adaptive
    corpus_dir = os.path.abspath(args.corpus_dir)
    if args.trainer == "torch":
        cli.ensure_corpus(corpus_dir, os.path.abspath(args.bin_dir))
    with open(os.path.join(args.configs_dir, BASE_CONFIG)) as f:
        base = f.read()
    cells = build_cells(s, adaptive)
    if args.only:
        only = set(x for x in args.only.split(",") if x) | {"fp32-noef"}
        unknown = only - set(c.run_id for c in cells)
        if unknown:
            raise SystemExit(f"{PROG}: --only names unknown cells {sorted(unknown)}; cells: "
                             + ",".join(c.run_id for c in cells))
        cells = [c for c in cells if c.run_id in only]
    out_dir = os.path.abspath(args.out)
    os.makedirs(out_dir, exist_ok=True)
    start = time.monotonic()
    print(f"{PROG}: {len(cells)} runs of {s.workers * s.local_steps * s.rounds} local steps, "
          f"{args.jobs} at a time, {binary} -> {out_dir}", flush=True)
    finished = run_all(binary, cells, s, out_dir,
                       corpus_dir if args.trainer == "torch" else "/nonexistent", base, args.seed,
                       args.trainer, args.jobs)
    rows = rows_of(finished)
    meta = {
        "command": PROG + "".join(" " + shlex.quote(a) for a in argv),
        "machine": cli.machine(),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "wall_seconds": time.monotonic() - start,
        "jobs": args.jobs, "settings": s, "trainer": args.trainer, "seed": args.seed,
        "adaptive": adaptive,
    }
    write_outputs(out_dir, rows, meta)
    print(table_markdown(rows))
    print(f"{PROG}: done in {meta['wall_seconds']:.0f} s; {out_dir}/table.md")
    failed = [r["run_id"] for _, r in rows if r["status"] != "ok"]
    if failed:
        print(f"{PROG}: {len(failed)} run(s) failed: {', '.join(failed)} (see their log.txt)",
              file=sys.stderr)
        return 1
    return 0
