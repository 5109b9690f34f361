"""The experiment grid of scripts/simulate-stragglers: heterogeneity levels, policies and the four
experiment families, turned into a list of Run specifications (one aloe-sim or loopback run each).

Everything here is deterministic: the same arguments give the same runs, configs and traces.
"""

import dataclasses
import math
import os
import random
import re

from . import textproto

# Steps per second of the 4 workers of the heterogeneity family (worker 0 is the fastest).
# 'very' is paper 002's device speeds (Fig. 4; the asyncdiloco toy's 0.58, 0.75, 1.51, 3.33 s per
# step, normalised to the fastest). The paper shows 'slight' and 'moderate' only as curves
# (Fig. 10), so ALOE interpolates geometrically: speed_i = very_i ** (1/3) and very_i ** (2/3).
LEVELS = {
    "no": (1.0, 1.0, 1.0, 1.0),
    "slight": (1.0, 0.92, 0.72, 0.55),
    "moderate": (1.0, 0.84, 0.53, 0.31),
    "very": (1.0, 0.77, 0.38, 0.17),
}
LEVEL_ORDER = ["no", "slight", "moderate", "very"]

FAMILIES = ["heterogeneity", "consistent", "random", "elastic"]


@dataclasses.dataclass(frozen=True)
class Policy:
    name: str
    base: str  # config file under deploy/configs whose settings define the policy
    description: str
    mode: str  # "sync" or "async": how the base config aggregates (after the overrides)
    time_budget: bool = False
    penalty: bool = False
    dn: bool = False
    grace: str = ""  # overrides the base config's aggregation.grace_seconds when set


POLICIES = {
    p.name: p
    for p in [
        Policy("sync", "sim-small.textproto",
               "sync DiLoCo: round barrier over all live trainers, outer Nesterov lr 0.7 "
               "beta 0.9, fixed H", "sync"),
        Policy("async-nesterov", "sim-small-async-nesterov.textproto",
               "naive async DiLoCo: every push is its own outer Nesterov step (lr 0.07 beta 0.9), "
               "grace 0.5 s, fixed H", "async"),
        Policy("async-dn-dylu", "sim-small-async-dn-dylu.textproto",
               "async Delayed Nesterov (N = workers, lr 0.7 beta 0.9) + DyLU + grace 0.5 s",
               "async", dn=True),
        Policy("async-dn-dylu-grace-inf", "sim-small-async-dn-dylu.textproto",
               "async-dn-dylu with grace_seconds inf: a window closes once every live trainer "
               "has pushed into it, so DyLU's equal-duration tasks are applied from one base "
               "(paper 002 Alg. 2 with speeds known)", "async", dn=True, grace="inf"),
        Policy("a-edit", "sim-small.textproto",
               "A-EDiT: sync rounds, each worker trains for a time budget of H x the fastest "
               "step time (fast workers do more steps), outer Nesterov lr 0.7 beta 0.9", "sync",
               time_budget=True),
        Policy("a-edit-penalty", "sim-small.textproto",
               "A-EDiT plus the EDiT pseudo-gradient penalty (anomaly z-test, norm-softmax "
               "weights, clip 10; paper 000 Alg. 2)", "sync", time_budget=True, penalty=True),
    ]
}

# A tiny model for the synthetic trainer: its cost is linear in the parameter count and only
# virtual time matters for throughput; tokens per step (batch x seq_len) stay those of the base.
TINY_MODEL = "{ vocab_size: 256 seq_len: 64 d_model: 8 num_layers: 1 num_heads: 1 ffn_mult: 1 }"


@dataclasses.dataclass
class FamilySettings:
    """Knobs of one family (defaults in default_settings(); --quick shrinks them)."""
    policies: list
    workers: int = 4
    local_steps: int = 20  # H
    levels: list = dataclasses.field(default_factory=list)  # heterogeneity
    total_steps: int = 0  # heterogeneity: stop at this many pushed local steps
    lags: list = dataclasses.field(default_factory=list)  # consistent: step time x (1 + lag)
    random_cells: list = dataclasses.field(default_factory=list)  # random: (p, lag)
    virtual_seconds: float = 0  # consistent / random: run length
    # elastic: length of each phase of 1-2-4-8-4-2-1 workers; not a multiple of H step times,
    # so that joins and leaves fall inside rounds (sync joiners wait, leavers lose their work)
    phase_seconds: float = 0
    dn_buffer: int = 0  # elastic: Delayed Nesterov N (0 = workers)
    trainer: str = "torch"
    real_seconds: float = 60  # loopback back end: run length


def default_settings(quick):
    all_policies = ["sync", "async-nesterov", "async-dn-dylu", "async-dn-dylu-grace-inf",
                    "a-edit", "a-edit-penalty"]
    throughput_policies = ["sync", "async-nesterov", "async-dn-dylu", "a-edit"]
    if quick:
        return {
            "heterogeneity": FamilySettings(
                policies=["sync", "async-nesterov", "async-dn-dylu", "async-dn-dylu-grace-inf"],
                levels=["no", "very"], total_steps=1200, real_seconds=40),
            "consistent": FamilySettings(
                policies=["sync", "async-dn-dylu", "a-edit"], workers=8, local_steps=100,
                lags=[0, 1, 4], virtual_seconds=3000, trainer="synthetic", real_seconds=40),
            "random": FamilySettings(
                policies=["sync", "async-dn-dylu", "a-edit"], workers=8, local_steps=100,
                random_cells=[(0, 0), (0.125, 1), (0.125, 4)], virtual_seconds=3000,
                trainer="synthetic"),
            "elastic": FamilySettings(
                policies=["sync", "async-dn-dylu", "a-edit"], workers=8, local_steps=20,
                phase_seconds=33, dn_buffer=4, real_seconds=70),
        }
    return {
        "heterogeneity": FamilySettings(
            policies=all_policies, levels=list(LEVEL_ORDER), total_steps=3200, real_seconds=90),
        "consistent": FamilySettings(
            policies=throughput_policies, workers=8, local_steps=100, lags=[0, 1, 2, 4],
            virtual_seconds=6000, trainer="synthetic", real_seconds=90),
        "random": FamilySettings(
            policies=throughput_policies, workers=8, local_steps=100,
            random_cells=[(0, 0), (0.05, 1), (0.125, 1), (0.25, 1), (0.05, 4), (0.125, 4),
                          (0.25, 4)],
            virtual_seconds=6000, trainer="synthetic"),
        "elastic": FamilySettings(
            policies=throughput_policies, workers=8, local_steps=20, phase_seconds=97,
            dn_buffer=4, real_seconds=140),
    }


@dataclasses.dataclass
class Run:
    family: str
    run_id: str
    policy: str
    seed: int
    trainer: str
    workers: int
    local_steps: int
    config_text: str
    speeds: list = None  # steps/s per worker (constant); None when `trace` is set
    trace: dict = None  # worker -> list of seconds per step (a cycle)
    events: list = dataclasses.field(default_factory=list)  # (kind, at_seconds, worker)
    max_local_steps: int = 0
    max_virtual_seconds: float = 0
    eval_every: int = 0
    level: str = ""
    lag: float = float("nan")
    straggle_p: float = float("nan")
    phase_seconds: float = float("nan")
    baseline_key: tuple = None  # runs with the same key and is_baseline give throughput_retention
    is_baseline: bool = False

    def capacity(self):
        """Mean steps/s the present workers could do together (time-averaged for elastic)."""
        if self.trace is not None:
            per_worker = [len(c) / sum(c) for _, c in sorted(self.trace.items())]
        else:
            per_worker = list(self.speeds)
        if not self.events:
            return sum(per_worker)
        horizon = self.max_virtual_seconds
        total = 0.0
        for i, v in enumerate(per_worker):
            total += v * presence_seconds(self.events, i, horizon) / horizon
        return total

    def fastest_speed(self):
        """Steps/s of the fastest step any worker takes (what real hardware runs unslowed)."""
        if self.trace is not None:
            return 1.0 / min(min(c) for c in self.trace.values())
        return max(self.speeds)

    def events_flag(self):
        return ",".join(f"{k}@{_fmt(t)}:{w}" for k, t, w in self.events)


def presence_seconds(events, worker, horizon):
    """Seconds in [0, horizon) that `worker` is present under `events`."""
    mine = sorted((t, k) for k, t, w in events if w == worker)
    present_since = None if (mine and mine[0][1] == "join") else 0.0
    total = 0.0
    for t, k in mine:
        t = min(t, horizon)
        if k == "join":
            present_since = t
        elif present_since is not None:
            total += t - present_since
            present_since = None
    if present_since is not None:
        total += horizon - present_since
    return total


def elastic_schedule(phase_seconds, workers=8):
    """Events for 1-2-4-8-4-2-1 workers (paper 000 Sec. 4.5 scaling, up and back down), phases
    of `phase_seconds`: [(kind, at_seconds, worker)], and the phases [(start, end, count)]."""
    counts = [1, 2, 4, 8, 4, 2, 1]
    assert workers == 8
    events = []
    for phase in range(1, len(counts)):
        t = phase * phase_seconds
        before, after = counts[phase - 1], counts[phase]
        if after > before:
            events += [("join", t, w) for w in range(before, after)]
        else:
            events += [("leave", t, w) for w in range(after, before)]
    phases = [(i * phase_seconds, (i + 1) * phase_seconds, c) for i, c in enumerate(counts)]
    return events, phases


def random_trace(workers, cycle_steps, p, lag, seed):
    """Step-time cycles for `workers` workers at 1 step/s where each step is delayed by `lag`
    seconds with probability p (independently per worker and step; random.Random(seed))."""
    rng = random.Random(f"aloe-stragglers:{seed}:{p}:{lag}")
    return {w: [1.0 + (lag if rng.random() < p else 0.0) for _ in range(cycle_steps)]
            for w in range(workers)}


def _fmt(x):
    return ("%.6f" % x).rstrip("0").rstrip(".") if x != int(x) else str(int(x))


def _policy_overrides(policy, workers, min_workers, local_steps, budget_seconds, dn_buffer):
    """Top-level fields replacing the base config's for this experiment."""
    o = {"local_steps": f": {local_steps}", "max_versions": None, "max_seconds": None,
         "eval_every": None}
    if policy.mode == "sync":
        o["aggregation"] = f"{{ mode: AGGREGATION_SYNC min_workers: {min_workers} }}"
    if policy.grace:
        o["aggregation"] = f"{{ mode: AGGREGATION_ASYNC grace_seconds: {policy.grace} }}"
    if policy.time_budget:
        o["local_work"] = (f"{{ mode: LOCAL_WORK_TIME_BUDGET time_budget_seconds: "
                           f"{_fmt(budget_seconds)} }}")
    if policy.penalty:
        o["penalty"] = "{ enabled: true }"
    return o, (dn_buffer or workers) if policy.dn else None


def make_config(configs_dir, policy, *, workers, min_workers, local_steps, budget_seconds,
                dn_buffer, trainer, corpus_dir, header):
    path = os.path.join(configs_dir, policy.base)
    with open(path) as f:
        base = f.read()
    overrides, dn = _policy_overrides(policy, workers, min_workers, local_steps, budget_seconds,
                                      dn_buffer)
    if dn is not None:
        outer = textproto.field(base, "outer_optimizer")
        if outer is None or "dn_buffer_size" not in outer:
            raise ValueError(f"{path}: expected an outer_optimizer with dn_buffer_size")
        overrides["outer_optimizer"] = re.sub(r"dn_buffer_size:\s*\d+", f"dn_buffer_size: {dn}",
                                              outer)
    if trainer == "synthetic":
        overrides["model"] = TINY_MODEL
    if corpus_dir:
        overrides["corpus_dir"] = f': "{corpus_dir}"'
    return textproto.merge(base, overrides, header=header)


def build_runs(settings, families, seeds, configs_dir, corpus_dir, trainer_override,
               policies_filter=None):
    """All runs of the selected families, for every seed."""
    runs = []
    for family in families:
        s = settings[family]
        trainer = trainer_override or s.trainer
        policies = [p for p in s.policies if not policies_filter or p in policies_filter]
        for seed in seeds:
            runs += _family_runs(family, s, policies, seed, configs_dir, corpus_dir, trainer)
    return runs


def _family_runs(family, s, policies, seed, configs_dir, corpus_dir, trainer):
    runs = []
    h = s.local_steps

    def config(policy, workers, min_workers, budget, header):
        return make_config(configs_dir, POLICIES[policy], workers=workers,
                           min_workers=min_workers, local_steps=h, budget_seconds=budget,
                           dn_buffer=s.dn_buffer, trainer=trainer,
                           corpus_dir=corpus_dir if trainer == "torch" else "/nonexistent",
                           header=header)

    def eval_every(policy, k):
        # About one evaluation per round of work: a sync round is one version, async makes one
        # version per push. Throughput families (synthetic) only evaluate first and last.
        if trainer == "synthetic" and family in ("consistent", "random"):
            return 0
        return 1 if POLICIES[policy].mode == "sync" else k

    if family == "heterogeneity":
        k = s.workers
        for level in s.levels:
            speeds = list(LEVELS[level])
            budget = h / max(speeds)
            for policy in policies:
                rid = f"het-{level}-{policy}-s{seed}"
                runs.append(Run(
                    family, rid, policy, seed, trainer, k, h,
                    config(policy, k, k, budget, f"{rid}: {POLICIES[policy].description}"),
                    speeds=speeds, max_local_steps=s.total_steps,
                    eval_every=eval_every(policy, k), level=level,
                    baseline_key=(family, policy, seed), is_baseline=(level == "no")))
    elif family == "consistent":
        k = s.workers
        for lag in s.lags:
            speeds = [1.0] * (k - 1) + [1.0 / (1.0 + lag)]
            for policy in policies:
                rid = f"cons-lag{_fmt(lag)}-{policy}-s{seed}"
                runs.append(Run(
                    family, rid, policy, seed, trainer, k, h,
                    config(policy, k, k, h / 1.0, f"{rid}: {POLICIES[policy].description}"),
                    speeds=speeds, max_virtual_seconds=s.virtual_seconds,
                    eval_every=eval_every(policy, k), lag=lag,
                    baseline_key=(family, policy, seed), is_baseline=(lag == 0)))
    elif family == "random":
        k = s.workers
        cycle = int(math.ceil(s.virtual_seconds)) + 1
        for p, lag in s.random_cells:
            for policy in policies:
                rid = f"rand-p{_fmt(p)}-lag{_fmt(lag)}-{policy}-s{seed}"
                runs.append(Run(
                    family, rid, policy, seed, trainer, k, h,
                    config(policy, k, k, h / 1.0, f"{rid}: {POLICIES[policy].description}"),
                    trace=random_trace(k, cycle, p, lag, seed),
                    max_virtual_seconds=s.virtual_seconds, eval_every=eval_every(policy, k),
                    lag=lag, straggle_p=p, baseline_key=(family, policy, seed),
                    is_baseline=(p == 0 or lag == 0)))
    elif family == "elastic":
        events, phases = elastic_schedule(s.phase_seconds, s.workers)
        for policy in policies:
            rid = f"elastic-{policy}-s{seed}"
            runs.append(Run(
                family, rid, policy, seed, trainer, s.workers, h,
                config(policy, s.workers, 1, h / 1.0, f"{rid}: {POLICIES[policy].description}"),
                speeds=[1.0] * s.workers, events=events,
                # Two more rounds after the last phase, so that the work of its end is
                # applied and counted (spread over the time it was computed).
                max_virtual_seconds=len(phases) * s.phase_seconds + 2 * h,
                eval_every=eval_every(policy, 4), phase_seconds=s.phase_seconds))
    else:
        raise ValueError(f"unknown family {family}")
    return runs
