#!/usr/bin/env python3
"""Every command line the deploy recipes ship is one the built daemons accept.

Covers the systemd units (with the defaults of their Environment= lines, then the example
settings files beside them), and the Kubernetes manifests of deploy/k8s (base, and with the
layer-sharded component's patches applied). Each command line runs with --version appended,
which the daemons answer only after parsing every flag: an unknown flag, a value of the wrong
type or a variable left unexpanded fails here instead of on a user's hosts.

Usage: deploy_flags_test.py SOURCE_DIR BIN_DIR
"""
import re
import shlex
import subprocess
import sys
from pathlib import Path

import yaml

DAEMONS = ("aloe-server", "aloe-worker")


def run(binary_dir, argv, where):
    """Runs argv (argv[0] a daemon name) from binary_dir with --version; returns an error or ""."""
    name = Path(argv[0]).name
    if name not in DAEMONS:
        return f"{where}: runs {argv[0]}, not one of {DAEMONS}"
    left = [a for a in argv if re.search(r"\$\(|\$\{|\$[A-Z_]|%[a-zA-Z]", a)]
    if left:
        return f"{where}: unexpanded {left}"
    cmd = [str(Path(binary_dir) / name)] + argv[1:] + ["--version"]
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
    lines = [l for l in unit_text.splitlines() if l.startswith("ExecStart=")]
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
    cases = [
        ("aloe-server.service", "", [], {}),
        ("aloe-server.service", "", [], {"ALOE_SERVER_FLAGS": "--role=coordinator"}),
        ("aloe-worker@.service", "9465", ["worker.env"], {}),
        ("aloe-worker@.service", "9470", ["worker.env"], {"ALOE_ROLE": "evaluator"}),
        ("aloe-shard@.service", "0", [], {}),
        ("aloe-shard@.service", "1", ["shard.env"], {}),
    ]
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
        env.update(extra)
        argv = systemd_command(text, env, instance)
        error = run(binary_dir, argv, f"deploy/systemd/{unit} ({instance or 'no instance'})")
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


def check_k8s(source, binary_dir):
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
                error = run(binary_dir, argv, f"{label}: {obj['kind']} {obj['metadata']['name']}")
                if error:
                    errors.append(error)
                checked += 1
    return errors, checked


def main():
    if len(sys.argv) != 3:
        print(__doc__)
        return 2
    source, binary_dir = Path(sys.argv[1]), sys.argv[2]
    errors, checked = [], 0
    for check in (check_systemd, check_k8s):
        e, n = check(source, binary_dir)
        errors += e
        checked += n
    for e in errors:
        print("FAIL", e)
    print(f"deploy_flags_test: {checked} command lines, {len(errors)} refused")
    # Guards against a test that silently checks nothing.
    if checked < 10:
        print(f"FAIL only {checked} command lines found")
        return 1
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
