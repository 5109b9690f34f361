#!/usr/bin/env python3
"""deploy/slurm/aloe-train.sbatch, run for real on this machine under a stand-in for Slurm.

`srun`, `scontrol` and `scancel` are replaced by small scripts on PATH: srun runs its command on
this host (every node of the allocation is "localhost") with --output honoured and records the
process, scancel --signal=TERM signals every recorded process, scontrol show hostnames prints the
node list. The script then starts the real aloe-server, evaluator and worker daemons exactly as
on a cluster. Two jobs of 10 s (max_seconds): one process, and a layer-sharded server
(ALOE_SHARDS=2). Each must train, evaluate, write its summary, end every daemon by itself and
exit 0, and the sharded one's shard processes must end with the job at its final version.

Usage: slurm_recipe_test.py SOURCE_DIR BIN_DIR
"""
import os
import socket
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

FAKE_SRUN = r"""#!/bin/bash
# Stand-in for srun: runs the command here, as every "node" is this host.
output=""
while [ $# -gt 0 ]; do
  case "$1" in
    --output=*) output="${1#--output=}"; shift ;;
    --*) shift ;;
    *) break ;;
  esac
done
echo "$$" >"$FAKE_SLURM_DIR/steps/$$"
if [ -n "$output" ]; then exec "$@" >"${output//%N/localhost}" 2>&1; fi
exec "$@"
"""

FAKE_SCANCEL = r"""#!/bin/bash
# Stand-in for scancel --signal=TERM JOBID: signals every step started by the fake srun.
sig=TERM
for a in "$@"; do case "$a" in --signal=*) sig="${a#--signal=}" ;; esac; done
for f in "$FAKE_SLURM_DIR"/steps/*; do kill -s "$sig" "$(cat "$f")" 2>/dev/null || true; done
"""

FAKE_SCONTROL = r"""#!/bin/bash
# Stand-in for scontrol show hostnames LIST.
[ "$1 $2" = "show hostnames" ] || exit 1
tr ',' '\n' <<<"$3"
"""


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def free_ports_in_a_row(count):
    """The first of `count` consecutive ports that were all free a moment ago (the script gives
    shard i the port base + i)."""
    for _ in range(100):
        socks = [socket.socket()]
        try:
            socks[0].bind(("127.0.0.1", 0))
            base = socks[0].getsockname()[1]
            for i in range(1, count):
                socks.append(socket.socket())
                socks[-1].bind(("127.0.0.1", base + i))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError(f"no {count} consecutive free ports")


def run_job(source, bin_dir, work, name, extra_env):
    """Runs the sbatch script as Slurm would start it; returns (exit code, its output, run dir)."""
    job = work / name
    fake = job / "fake-slurm"
    (fake / "steps").mkdir(parents=True)
    for tool, text in (("srun", FAKE_SRUN), ("scancel", FAKE_SCANCEL),
                       ("scontrol", FAKE_SCONTROL)):
        (fake / tool).write_text(text)
        (fake / tool).chmod(0o755)
    env = dict(os.environ)
    env.update({
        "PATH": f"{fake}:{env['PATH']}",
        "FAKE_SLURM_DIR": str(fake),
        "SLURM_JOB_ID": "4242",
        "SLURM_JOB_NODELIST": "localhost",
        "SLURM_SUBMIT_DIR": str(source),
        "SLURM_CPUS_ON_NODE": "1",
        "ALOE_CONFIG": str(work / "server.textproto"),
        "ALOE_BIN_DIR": str(bin_dir),
        "ALOE_CORPUS_DIR": str(work / "corpus"),
        "ALOE_STATE_DIR": str(job / "state"),
        "ALOE_NPROC": "1",
        "ALOE_PORT": str(free_port()),
        "ALOE_METRICS_PORT": str(free_port()),
        "ALOE_WORKER_METRICS_PORT": str(free_port()),
        "ALOE_EVALUATOR_METRICS_PORT": str(free_port()),
        # Listening on every interface without TLS, as on a trusted cluster network.
        "ALOE_SERVER_FLAGS": "--insecure",
        "ALOE_DRAIN_SECONDS": "10",
        "OMP_NUM_THREADS": "1",
    })
    env.update(extra_env)
    try:
        done = subprocess.run(["bash", str(source / "deploy/slurm/aloe-train.sbatch")], env=env,
                              capture_output=True, text=True, timeout=180)
        code, output = done.returncode, done.stdout + done.stderr
    except subprocess.TimeoutExpired as e:
        code, output = -1, f"timed out after 180 s\n{e.stdout or ''}{e.stderr or ''}"
    # Nothing may outlive the job (the fake scancel with SIGKILL, as Slurm ends an allocation).
    subprocess.run([str(fake / "scancel"), "--signal=KILL", "4242"], env=env, check=False)
    return code, output, job / "state" / "job-4242"


def main():
    if len(sys.argv) != 3:
        print(__doc__)
        return 2
    source, bin_dir = Path(sys.argv[1]).resolve(), Path(sys.argv[2]).resolve()
    failures = []
    with tempfile.TemporaryDirectory(prefix="aloe_slurm_") as tmp:
        work = Path(tmp)
        # A small corpus of real text through aloe-corpus.
        (work / "text").mkdir()
        lines = ["Four score and seven years ago our fathers brought forth on this continent "
                 "a new nation, conceived in Liberty. " * 40,
                 "Now we are engaged in a great civil war, testing whether that nation can "
                 "long endure. " * 40]
        for i, text in enumerate(lines):
            (work / "text" / f"part{i}.txt").write_text(text)
        subprocess.run([str(bin_dir / "aloe-corpus"), f"--input_dir={work / 'text'}",
                        f"--output_dir={work / 'corpus'}", "--heldout_fraction=0.2"],
                       check=True, capture_output=True, timeout=60)
        (work / "server.textproto").write_text(textwrap.dedent("""\
            corpus_dir: "unused: the script passes --corpus_dir"
            model { vocab_size: 256 seq_len: 16 d_model: 32 num_layers: 2 num_heads: 2 }
            inner_optimizer { batch_size: 2 }
            aggregation { mode: AGGREGATION_ASYNC }
            local_steps: 3
            max_seconds: 10
            eval_every: 20
            lease_seconds: 20
            """))
        # Ports picked right before each job (shard i listens on base + i): picked earlier,
        # another test's connection could take one meanwhile.
        jobs = [("single", lambda: {}, 0),
                ("sharded", lambda: {"ALOE_SHARDS": "2",
                                     "ALOE_SHARD_PORT": str(free_ports_in_a_row(2)),
                                     "ALOE_SHARD_METRICS_PORT": str(free_ports_in_a_row(2))}, 2)]
        for name, env_of, shards in jobs:
            code, output, run_dir = run_job(source, bin_dir, work, name, env_of())
            logs = output
            for log in sorted(run_dir.glob("*.log")) if run_dir.exists() else []:
                logs += f"\n==== {log.name}\n" + log.read_text()[-3000:]
            summary = (run_dir / "summary").read_text() if (run_dir / "summary").exists() else ""
            version = next((int(line[8:]) for line in summary.splitlines()
                            if line.startswith("version=")), 0)
            checks = [
                (code == 0, f"the script exited {code}"),
                (version >= 2, f"summary {summary!r}: the job trained fewer than 2 versions"),
                ("eval=" in summary, "no evaluation in the summary"),
                ("workers exited with status 0, evaluator 0" in output,
                 "the workers or the evaluator did not exit 0"),
            ]
            for i in range(shards):
                shard_log = (run_dir / f"shard{i}.log").read_text()
                checks.append((f"the job is over: shard {i} stops at version {version}\n"
                               in shard_log, f"shard {i} did not end with the job at {version}"))
            if shards:
                checks.append(("shard processes exited with status 0" in output,
                               "the shard processes did not exit 0"))
                server_log = (run_dir / "server.log").read_text()
                checks.append((f"the job is over at version {version}; the 2 shard processes stop"
                               in server_log, "the coordinator did not tell both shards"))
            bad = [message for ok, message in checks if not ok]
            if bad:
                failures.append(f"job {name}: " + "; ".join(bad) + "\n" + logs)
            print(f"slurm_recipe_test: job {name}: exit {code}, "
                  f"{'OK' if not bad else 'FAILED'}")
    for f in failures:
        print("FAIL", f)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
