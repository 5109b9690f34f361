#!/usr/bin/env python3
"""Every command line and server config the deploy recipes ship is one the built daemons accept.

Covers the systemd units (with the defaults of their Environment= lines, then the example
settings files beside them), the Kubernetes manifests of deploy/k8s (base, and with the
layer-sharded component's patches applied) and the configs of deploy/configs. An aloe-server
command line runs with --check (its config file taken from the repository: the unit's example or
the ConfigMap's text), which validates the config and the flags as a start would; an aloe-worker
one with --version, which it answers only after parsing every flag. An unknown flag, a value of
the wrong type, a variable left unexpanded or a config field out of range fails here instead of
on a user's hosts.

Usage: deploy_flags_test.py SOURCE_DIR BIN_DIR
"""
import re
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

DAEMONS = ("aloe-server", "aloe-worker")


def run(binary_dir, argv, where, configs=None):
    """Runs argv (argv[0] a daemon name) from binary_dir: aloe-server with --check and every
    --config path in `configs` replaced by its value, aloe-worker with --version. Returns an
    error or ""."""
    name = Path(argv[0]).name
    if name not in DAEMONS:
        return f"{where}: runs {argv[0]}, not one of {DAEMONS}"
    left = [a for a in argv if re.search(r"\$\(|\$\{|\$[A-Z_]|%[a-zA-Z]", a)]
    if left:
        return f"{where}: unexpanded {left}"
    args = list(argv[1:])
    if name == "aloe-server":
        for i, a in enumerate(args):
            if a.startswith("--config="):
                path = a[len("--config="):]
                if path not in (configs or {}):
                    return f"{where}: --config={path}, which this test cannot map to a file"
                args[i] = "--config=" + str(configs[path])
        args.append("--check")
    else:
        args.append("--version")
    cmd = [str(Path(binary_dir) / name)] + args
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    if done.returncode != 0:
        return f"{where}: {shlex.join(argv)}\n  -> exit {done.returncode}: {done.stderr.strip()}"
    return ""


def parse_env_file(path):
    env = {}
    for line in Path(path).read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        key, _, value = line.partition("=")
        env[key] = value
    return env


def systemd_command(unit_text, env, instance):
    """The ExecStart of a unit as systemd would run it: ${VAR} one word, $VAR split at spaces,
    %i the instance, %H the host name."""
    lines = [line for line in unit_text.splitlines() if line.startswith("ExecStart=")]
    assert len(lines) == 1, "one ExecStart per unit"
    words = []
    for word in lines[0][len("ExecStart="):].split():
        word = word.replace("%i", instance).replace("%H", "host")
        whole = re.fullmatch(r"\$([A-Z_][A-Z0-9_]*)", word)
        if whole:
            words += env.get(whole.group(1), "").split()
            continue
        words.append(re.sub(r"\$\{([A-Z_][A-Z0-9_]*)\}", lambda m: env.get(m.group(1), ""), word))
    return words


def check_systemd(source, binary_dir):
    errors, checked = [], 0
    unit_dir = source / "deploy/systemd"
    # (unit, instance, example settings files, extra settings)
    # The layer-sharded cases give every process the shard count, as README.md in that folder
    # has users set shard_processes in server.textproto.
    sharded = "--shard_processes=2"
    cases = [
        ("aloe-server.service", "", [], {}),
        ("aloe-server.service", "", [], {"ALOE_SERVER_FLAGS": "--role=coordinator " + sharded}),
        ("aloe-worker@.service", "9465", ["worker.env"], {}),
        ("aloe-worker@.service", "9470", ["worker.env"], {"ALOE_ROLE": "evaluator"}),
        ("aloe-shard@.service", "0", [], {"ALOE_SHARD_FLAGS": sharded}),
        ("aloe-shard@.service", "1", ["shard.env"], {"+ALOE_SHARD_FLAGS": " " + sharded}),
    ]
    configs = {"/etc/aloe/server.textproto": unit_dir / "server.textproto"}
    covered = set()
    for unit, instance, env_files, extra in cases:
        text = (unit_dir / unit).read_text()
        env = {}
        for line in text.splitlines():
            if line.startswith("Environment="):
                key, _, value = line[len("Environment="):].partition("=")
                env[key] = value
        for f in env_files:
            env.update(parse_env_file(unit_dir / f))
        for key, value in extra.items():
            if key.startswith("+"):
                env[key[1:]] = env.get(key[1:], "") + value
            else:
                env[key] = value
        argv = systemd_command(text, env, instance)
        error = run(binary_dir, argv, f"deploy/systemd/{unit} ({instance or 'no instance'})",
                    configs)
        if error:
            errors.append(error)
        checked += 1
        covered.add(unit)
    missing = {p.name for p in unit_dir.glob("*.service")} - covered
    if missing:
        errors.append(f"deploy/systemd: units this test does not run: {sorted(missing)}")
    return errors, checked


def expand_k8s(arg, env):
    return re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: env.get(m.group(1), m.group(0)), arg)


# What the downward API gives the pods (fieldRef paths) in a namespace "aloe".
FIELD_VALUES = {
    "metadata.name": "aloe-shard-1",
    "metadata.namespace": "aloe",
    "metadata.labels['apps.kubernetes.io/pod-index']": "1",
}


def apply_component_patches(objects, component):
    """The component's JSON patches (only "add" to a path ending in /-, all this test needs)."""
    for patch in component.get("patches", []):
        target = patch["target"]
        for obj in objects:
            if obj.get("kind") != target.get("kind") or obj["metadata"]["name"] != target["name"]:
                continue
            for op in yaml.safe_load(patch["patch"]):
                assert op["op"] == "add" and op["path"].endswith("/-"), op
                node = obj
                for part in op["path"].strip("/").split("/")[:-1]:
                    node = node[int(part)] if isinstance(node, list) else node[part]
                node.append(op["value"])


def check_k8s(source, binary_dir, scratch):
    errors, checked = [], 0
    base = source / "deploy/k8s"
    kustomization = yaml.safe_load((base / "kustomization.yaml").read_text())

    def load(directory, files):
        objects = []
        for f in files:
            objects += [o for o in yaml.safe_load_all((directory / f).read_text()) if o]
        return objects

    base_objects = load(base, kustomization["resources"])
    config_maps = {o["metadata"]["name"]: o.get("data", {}) for o in base_objects
                   if o["kind"] == "ConfigMap"}
    # The server pods mount ConfigMap aloe-server-config at /etc/aloe/config.
    server_config = Path(scratch) / "server.textproto"
    server_config.write_text(config_maps["aloe-server-config"]["server.textproto"])
    configs = {"/etc/aloe/config/server.textproto": server_config}
    component = yaml.safe_load((base / "sharded/kustomization.yaml").read_text())
    sharded_objects = load(base, kustomization["resources"]) + load(base / "sharded",
                                                                    component["resources"])
    apply_component_patches(sharded_objects, component)
    for label, objects in (("deploy/k8s", base_objects),
                           ("deploy/k8s with components: sharded", sharded_objects)):
        for obj in objects:
            if obj["kind"] not in ("StatefulSet", "Deployment"):
                continue
            for c in obj["spec"]["template"]["spec"]["containers"]:
                env = {}
                for ref in c.get("envFrom", []):
                    env.update(config_maps[ref["configMapRef"]["name"]])
                for e in c.get("env", []):
                    if "value" in e:
                        env[e["name"]] = e["value"]
                    else:
                        env[e["name"]] = FIELD_VALUES[e["valueFrom"]["fieldRef"]["fieldPath"]]
                argv = [c["image"]] + [expand_k8s(a, env) for a in c.get("args", [])]
                error = run(binary_dir, argv, f"{label}: {obj['kind']} {obj['metadata']['name']}",
                            configs)
                if error:
                    errors.append(error)
                checked += 1
    return errors, checked


def check_configs(source, binary_dir):
    """Every example config of deploy/configs, as the one process it describes."""
    errors, checked = [], 0
    for config in sorted((source / "deploy/configs").glob("*.textproto")):
        error = run(binary_dir, ["aloe-server", "--config=c"], f"deploy/configs/{config.name}",
                    {"c": config})
        if error:
            errors.append(error)
        checked += 1
    return errors, checked


def check_the_check(binary_dir, scratch):
    """--check refuses what a start would: else every case above would pass for nothing."""
    errors = []
    bad = Path(scratch) / "bad.textproto"
    bad.write_text('corpus_dir: "x"\nlease_seconds: -1\n')
    cases = [
        (["--config=" + str(bad)], "lease_seconds must be > 0, got -1"),
        (["--config=" + str(Path(scratch) / "server.textproto"), "--role=shard",
          "--shard_processes=2", "--shard_index=0", "--listen=0.0.0.0:7071"],
         "listens on every interface"),
    ]
    for args, message in cases:
        done = subprocess.run([str(Path(binary_dir) / "aloe-server")] + args + ["--check"],
                              capture_output=True, text=True, timeout=60)
        if done.returncode != 1 or message not in done.stderr:
            errors.append(f"aloe-server --check {shlex.join(args)}: exit {done.returncode}, "
                          f"expected 1 and '{message}': {done.stderr.strip()}")
    return errors, len(cases)


def main():
    if len(sys.argv) != 3:
        print(__doc__)
        return 2
    source, binary_dir = Path(sys.argv[1]), sys.argv[2]
    errors, checked = [], 0
    with tempfile.TemporaryDirectory() as scratch:
        for e, n in (check_systemd(source, binary_dir), check_k8s(source, binary_dir, scratch),
                     check_configs(source, binary_dir), check_the_check(binary_dir, scratch)):
            errors += e
            checked += n
    for e in errors:
        print("FAIL", e)
    print(f"deploy_flags_test: {checked} command lines, {len(errors)} refused")
    # Guards against a test that silently checks nothing.
    if checked < 20:
        print(f"FAIL only {checked} command lines found")
        return 1
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
