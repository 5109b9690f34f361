#!/usr/bin/env bash
# Makes a throwaway certificate authority plus a server and a client certificate for TLS and
# mutual-TLS tests and trials (never for production). The server certificate is valid for
# localhost and 127.0.0.1.
#
# Usage: scripts/make-test-ca.sh OUT_DIR
#   writes ca.pem, ca.key, server.pem, server.key, client.pem, client.key into OUT_DIR
set -euo pipefail
if [ $# -ne 1 ] || [ "$1" = "--help" ] || [ "$1" = "-h" ]; then
  sed -n '2,8p' "$0"; [ $# -eq 1 ] && [ "$1" != "--help" ] && [ "$1" != "-h" ] && exit 2; exit 0
fi
command -v openssl >/dev/null || { echo "make-test-ca.sh: openssl is not installed" >&2; exit 1; }
out="$1"
mkdir -p "$out"
cd "$out"
openssl req -x509 -newkey rsa:2048 -nodes -days 2 -subj "/CN=aloe-test-ca" \
  -keyout ca.key -out ca.pem 2>/dev/null
for who in server client; do
  openssl req -newkey rsa:2048 -nodes -subj "/CN=aloe-$who" -keyout "$who.key" -out "$who.csr" \
    2>/dev/null
  printf 'subjectAltName=DNS:localhost,IP:127.0.0.1\n' > "$who.ext"
  openssl x509 -req -in "$who.csr" -CA ca.pem -CAkey ca.key -CAcreateserial -days 2 \
    -extfile "$who.ext" -out "$who.pem" 2>/dev/null
  rm -f "$who.csr" "$who.ext"
done
rm -f ca.srl
echo "make-test-ca.sh: wrote ca, server and client certificates to $out"
