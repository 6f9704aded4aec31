#!/usr/bin/env bash
# Debian packages the tests need, installed by `make setup` (idempotent; nothing is installed by hand):
#   etcd-server  a real etcd for the etcd store's conformance tests and the HA lighthouse
#   chromium     headless browser for the lighthouse page's rendering test
#   openssl      `fthsdp secrets` and the TLS tests make their certificates with it
set -euo pipefail
need=()
command -v etcd >/dev/null 2>&1 || need+=(etcd-server)
command -v chromium >/dev/null 2>&1 || need+=(chromium)
command -v openssl >/dev/null 2>&1 || need+=(openssl)
[ ${#need[@]} -eq 0 ] && exit 0
if ! command -v apt-get >/dev/null 2>&1; then
    echo "system-deps: apt-get not found; install ${need[*]} with your package manager" >&2
    exit 1
fi
SUDO=""
[ "$(id -u)" -ne 0 ] && SUDO="sudo"
echo "system-deps: installing ${need[*]}"
$SUDO apt-get update -qq
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
