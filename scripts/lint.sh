#!/usr/bin/env bash
# Static checks: the layout of the C++ and CUDA sources (clang-format 14, Debian 12's, with the
# repository's .clang-format; another version formats differently, so it is skipped), shell
# scripts (shellcheck), Python (flake8, settings in .flake8), YAML under deploy/ and .github/
# (yamllint, settings in .yamllint), the Prometheus configs, recording rules and rule tests
# (promtool), the Grafana dashboard (JSON) and the Kubernetes manifests (kubectl kustomize).
# Prints one line per check, then `lint: N passed, M failed`, and exits 1 when a check failed.
# A tool that is not installed is skipped with a message (scripts/install-deps.sh installs all
# but the optional kubectl). scripts/test.sh runs this before building.
# Usage: scripts/lint.sh [--help]
set -euo pipefail

if [ $# -gt 0 ]; then
  case "$1" in
    -h|--help) sed -n '2,10p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "lint.sh: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
fi
# Paths in the output and in shellcheck's source= directives are relative to the root.
cd "$(dirname "${BASH_SOURCE[0]}")/.."

passed=0
failed=0
# check NAME COMMAND...: runs COMMAND; one PASS line, or a FAIL line and its indented output.
check() {
  local name="$1" out
  shift
  if out="$("$@" 2>&1)"; then
    passed=$((passed + 1))
    echo "PASS  $name"
  else
    failed=$((failed + 1))
    echo "FAIL  $name"
    printf '%s\n' "$out" | sed 's/^/      /'
  fi
}
# have TOOL WHAT [WHERE]: true if TOOL is installed, else says which checks are skipped.
have() {
  command -v "$1" >/dev/null 2>&1 && return 0
  echo "SKIP  $2: $1 is not installed (${3:-scripts/install-deps.sh installs it})"
  return 1
}

# C++ and CUDA: every tracked source as clang-format would write it.
cpp_format() {
  local f bad=()
  for f in "$@"; do clang-format --dry-run --Werror "$f" >/dev/null 2>&1 || bad+=("$f"); done
  [ ${#bad[@]} -eq 0 ] && return 0
  printf '%s\n' "${bad[@]}" "(clang-format -i on these files formats them)"
  return 1
}
mapfile -t cpp_files < <(git ls-files '*.cc' '*.h' '*.cu' '*.cuh' 2>/dev/null)
if have clang-format "C++ layout"; then
  if clang-format --version | grep -q 'version 14\.'; then
    check "clang-format (${#cpp_files[@]} C++ and CUDA files)" cpp_format "${cpp_files[@]}"
  else
    echo "SKIP  C++ layout: $(clang-format --version | head -n 1) is not the clang-format 14 the" \
      "layout is kept with"
  fi
fi

# Shell: *.sh and *.sbatch files, and extensionless files whose first line is a sh/bash shebang.
mapfile -t shell_files < <(
  find scripts deploy .ci -type f 2>/dev/null |
    while read -r f; do
      case "${f##*/}" in
        *.sh|*.sbatch) echo "$f" ;;
        *.*) ;;
        *) if head -n 1 "$f" | grep -qE '^#!.*[/ ](ba)?sh$'; then echo "$f"; fi ;;
      esac
    done | sort)
if have shellcheck "shell scripts"; then
  for f in "${shell_files[@]}"; do check "shellcheck $f" shellcheck -x "$f"; done
fi

mapfile -t yaml_files < <(find deploy .github -type f \( -name '*.yml' -o -name '*.yaml' \) \
  2>/dev/null | sort)
if have yamllint "YAML files"; then
  for f in "${yaml_files[@]}"; do check "yamllint $f" yamllint --strict -c .yamllint "$f"; done
fi

if have promtool "Prometheus configuration"; then
  for f in deploy/prometheus/prometheus*.yml; do
    check "promtool check config $f" promtool check config "$f"
  done
  for f in deploy/prometheus/rules/*.yml; do
    case "$f" in
      *.test.yml) check "promtool test rules $f" promtool test rules "$f" ;;  # rule unit tests
      *) check "promtool check rules $f" promtool check rules "$f" ;;
    esac
  done
fi

# Python: *.py under scripts/, tests/, deploy/ and worker/python/, and extensionless scripts with a python
# shebang; flake8 (pyflakes and pycodestyle) with the settings in .flake8, in one run.
mapfile -t python_files < <(
  { git ls-files 'scripts/*.py' 'tests/*.py' 'deploy/*.py' 'worker/python/*.py' 2>/dev/null
    git ls-files scripts 2>/dev/null | while read -r f; do
      case "${f##*/}" in
        *.*) ;;
        *) if head -n 1 "$f" | grep -qE '^#!.*python'; then echo "$f"; fi ;;
      esac
    done; } | sort -u)
if have flake8 "Python"; then
  check "flake8 (${#python_files[@]} Python files)" flake8 "${python_files[@]}"
fi

if have python3 "JSON files"; then
  for f in deploy/grafana/*.json; do check "json $f" python3 -m json.tool "$f" /dev/null; done
fi

# Optional: Debian 12 has no current kubectl, so install-deps.sh does not install one.
if have kubectl "kubectl kustomize deploy/k8s" "optional: Kubernetes' own packages"; then
  check "kubectl kustomize deploy/k8s" kubectl kustomize deploy/k8s
  # The layer-sharded component, on a copy of the base with it switched on.
  sharded_k8s() {
    local tmp rc=0
    tmp="$(mktemp -d)"
    cp -r deploy/k8s "$tmp/k8s"
    sed -i 's/^# components:/components:/; s/^#   - sharded/  - sharded/' "$tmp/k8s/kustomization.yaml"
    grep -q '^  - sharded' "$tmp/k8s/kustomization.yaml" && kubectl kustomize "$tmp/k8s" || rc=1
    rm -rf "$tmp"
    return "$rc"
  }
  check "kubectl kustomize deploy/k8s with components: sharded" sharded_k8s
fi

echo "lint: $passed passed, $failed failed"
[ "$failed" -eq 0 ]
