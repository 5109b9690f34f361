"""The seeded fault schedule of scripts/soak: which fault, when, against which process.

A schedule is a list of Fault(time, kind, target, hold) sorted by time. Server-side faults (a
shard, coordinator or single-process server going away, a drain, a full checkpoint directory)
are spaced so that each recovers before the next starts; worker and link faults fall anywhere in
the fault phase. The same seed gives the same schedule."""

import random

# Kinds, with what they do (scripts/soak --help lists them too).
WORKER_KILL = "worker_kill"          # SIGKILL a trainer, start it again
WORKER_FREEZE = "worker_freeze"      # SIGSTOP a trainer for longer than the lease, SIGCONT
LINK_CUT = "link_cut"                # reset every connection through the link emulator
LINK_STALL = "link_stall"            # hold every byte in the link emulator, then resume
SHARD_KILL = "shard_kill"            # SIGKILL a shard process, restart it with --resume
COORDINATOR_KILL = "coordinator_kill"  # SIGKILL the coordinator, restart it with --resume
SERVER_KILL = "server_kill"          # single scenario: SIGKILL the server, restart --resume
DRAIN = "drain"                      # SIGTERM the coordinator/server, wait, restart --resume
# SIGKILL a server process, damage its newest checkpoint, restart it with --resume.
CORRUPT_CHECKPOINT = "corrupt_checkpoint"
DISK_FULL = "disk_full"              # fill the checkpoint directory for a while
BAD_TOKEN = "bad_token"              # a worker with a wrong access token tries to join
WRONG_MODEL = "wrong_model"          # a worker with another model's fingerprint tries to join

WORKER_SIDE = (WORKER_KILL, WORKER_FREEZE, LINK_CUT, LINK_STALL, BAD_TOKEN, WRONG_MODEL)
SERVER_SIDE = (SHARD_KILL, COORDINATOR_KILL, SERVER_KILL, DRAIN, CORRUPT_CHECKPOINT, DISK_FULL)
# Kinds that take a server process away (the "server-side kills" of the full run).
SERVER_KILLS = (SHARD_KILL, COORDINATOR_KILL, SERVER_KILL, DRAIN, CORRUPT_CHECKPOINT)


class Fault:
    __slots__ = ("time", "kind", "target", "hold", "variant")

    def __init__(self, time, kind, target=0, hold=0.0, variant=""):
        self.time = time        # seconds after the trainers started
        self.kind = kind
        self.target = target    # trainer index or shard index
        self.hold = hold        # seconds: down time before a restart, freeze or stall length
        self.variant = variant  # corrupt_checkpoint: "truncate" or "flip"

    def __repr__(self):
        extra = f" {self.variant}" if self.variant else ""
        return f"{self.time:7.2f}s {self.kind} target={self.target} hold={self.hold:.2f}{extra}"


def counts_for(scenario, worker_kills, server_kills, others, only=None):
    """How many faults of each kind: `worker_kills` SIGKILLs of trainers, `server_kills` server
    processes taken away (spread over the kinds the scenario has), `others` of every other kind;
    with `only` (a set of kinds), of those kinds alone."""
    if scenario == "sharded":
        kill_kinds = [SHARD_KILL, COORDINATOR_KILL, DRAIN, CORRUPT_CHECKPOINT]
    else:
        kill_kinds = [SERVER_KILL, DRAIN, CORRUPT_CHECKPOINT]
    if only:
        kill_kinds = [k for k in kill_kinds if k in only] or kill_kinds
    counts = {WORKER_KILL: worker_kills}
    for i in range(server_kills):
        k = kill_kinds[i % len(kill_kinds)]
        counts[k] = counts.get(k, 0) + 1
    for k in (WORKER_FREEZE, LINK_CUT, LINK_STALL, DISK_FULL, BAD_TOKEN, WRONG_MODEL):
        counts[k] = others
    if only:
        counts = {k: n for k, n in counts.items() if k in only}
    return counts


def make(seed, scenario, start, end, trainers, shards, counts, lease_seconds, server_gap,
         shard_down=None):
    """The schedule: faults of `counts` in [start, end) seconds. Server-side faults are at least
    `server_gap` seconds apart (and their holds fit inside the gap); worker-side ones are placed
    uniformly. shard_down: the seconds a killed shard process stays down (default 1-2.4 s,
    drawn). Raises ValueError when the server-side faults do not fit."""
    rng = random.Random(seed)
    faults = []
    server = []
    for kind in SERVER_SIDE:
        server += [kind] * counts.get(kind, 0)
    rng.shuffle(server)
    if server:
        slots = int((end - start) // server_gap)
        if slots < len(server):
            raise ValueError(f"{len(server)} server-side faults need {len(server) * server_gap:.0f}"
                             f" s of fault phase, there are {end - start:.0f} s")
        chosen = sorted(rng.sample(range(slots), len(server)))
        for slot, kind in zip(chosen, server):
            t = start + slot * server_gap + rng.uniform(0, server_gap * 0.2)
            if kind == SHARD_KILL:
                # The operator's scenario: down for a couple of seconds, then back.
                down = rng.uniform(1.0, 2.4)
                faults.append(Fault(t, kind, rng.randrange(shards),
                                    down if shard_down is None else shard_down))
            elif kind == CORRUPT_CHECKPOINT:
                target = rng.randrange(shards) if scenario == "sharded" else 0
                faults.append(Fault(t, kind, target, rng.uniform(0.5, 1.5),
                                    rng.choice(["truncate", "flip"])))
            elif kind == DISK_FULL:
                faults.append(Fault(t, kind, 0, rng.uniform(3.0, 5.0)))
            else:
                faults.append(Fault(t, kind, 0, rng.uniform(0.5, 1.5)))
    for kind in WORKER_SIDE:
        for _ in range(counts.get(kind, 0)):
            t = rng.uniform(start, end)
            if kind == WORKER_KILL:
                faults.append(Fault(t, kind, rng.randrange(trainers), rng.uniform(0.2, 1.0)))
            elif kind == WORKER_FREEZE:
                faults.append(Fault(t, kind, rng.randrange(trainers),
                                    lease_seconds + rng.uniform(1.0, 2.5)))
            elif kind == LINK_STALL:
                faults.append(Fault(t, kind, 0, rng.uniform(1.0, 3.0)))
            else:
                faults.append(Fault(t, kind))
    faults.sort(key=lambda f: f.time)
    return faults
