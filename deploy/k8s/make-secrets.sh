#!/usr/bin/env bash
# Creates (or replaces) the two Secrets the manifests in deploy/k8s mount:
#   aloe-tls   ca.crt, and tls.crt + tls.key: a server certificate for the aloe-server Service
#              names, signed by a fresh CA whose key is thrown away;
#   aloe-auth  tokens (the server's token file, identities "workers" and "shards"), token (the
#              workers') and shard-token (the shard processes' of a layer-sharded job).
# Run it once before `kubectl apply -k deploy/k8s`; run it again to rotate both, then restart
# the pods. Needs kubectl (pointed at the cluster) and openssl.
# Usage: deploy/k8s/make-secrets.sh [NAMESPACE]   (default: aloe)
set -euo pipefail
if [ "${1:-}" = "-h" ] || [ "${1:-}" = "--help" ]; then
  sed -n '2,9p' "$0" | sed 's/^# \{0,1\}//'; exit 0
fi
ns="${1:-aloe}"
for tool in kubectl openssl; do
  command -v "$tool" >/dev/null || { echo "make-secrets.sh: $tool is not installed" >&2; exit 1; }
done

work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
cd "$work"
openssl req -x509 -newkey rsa:2048 -nodes -days 365 -subj "/CN=aloe-ca-$ns" \
  -keyout ca.key -out ca.crt 2>/dev/null
openssl req -newkey rsa:2048 -nodes -subj "/CN=aloe-server" -keyout tls.key -out tls.csr \
  2>/dev/null
# Every name a worker or shard may dial: the Service, short and qualified, the pods of the
# headless Service, and the shard pods of a layer-sharded job (sharded/shard.yaml).
san="DNS:aloe-server,DNS:aloe-server.$ns,DNS:aloe-server.$ns.svc"
san+=",DNS:aloe-server.$ns.svc.cluster.local,DNS:*.aloe-server-headless.$ns.svc.cluster.local"
san+=",DNS:*.aloe-shard-headless.$ns.svc.cluster.local"
printf 'subjectAltName=%s\n' "$san" >san.ext
openssl x509 -req -in tls.csr -CA ca.crt -CAkey ca.key -CAcreateserial -days 365 \
  -extfile san.ext -out tls.crt 2>/dev/null
# The workers' token, and the one shard processes present to the coordinator.
token="$(openssl rand -hex 24)"
shard_token="$(openssl rand -hex 24)"
printf 'workers %s\nshards %s\n' "$token" "$shard_token" >tokens
printf '%s\n' "$token" >token
printf '%s\n' "$shard_token" >shard-token

# create --dry-run | apply: creates the Secret, or replaces the one already there.
secret() { kubectl -n "$ns" create secret generic "$@" --dry-run=client -o yaml | kubectl apply -f -; }
kubectl get namespace "$ns" >/dev/null 2>&1 || kubectl create namespace "$ns"
secret aloe-tls --from-file=ca.crt --from-file=tls.crt --from-file=tls.key
secret aloe-auth --from-file=tokens --from-file=token --from-file=shard-token
echo "make-secrets.sh: aloe-tls and aloe-auth are in namespace $ns (certificate valid 365 days)"
