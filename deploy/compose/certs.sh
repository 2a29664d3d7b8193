#!/bin/sh
# Certificates of the compose mesh, made once by the `certs` job (the meshllm image, as root):
#
#   $OUT/ca/                 ca.pem + ca.key: the dev CA (scripts/dev-ca's code); no other
#                            container mounts this volume
#   $OUT/<identity>/         ca.pem, <identity>.pem, <identity>.key: one volume per identity,
#                            mounted only into that identity's sidecar (or Prometheus), so a
#                            sidecar can read its own key and no other
#   $OUT/public-tls/         tls.crt + tls.key of the public listener: the gateway's dev
#                            certificate, unless a tls.crt is there already (real certificates)
#
# Idempotent: an identity whose certificate exists is left alone; a missing one is issued by
# the existing CA. Keys end up 0400, owned by the user that reads them (Envoy runs as
# ENVOY_UID, Prometheus as PROMETHEUS_UID).
set -eu
OUT=${MESHLLM_CERTS_OUT:-/out}
IDENTITIES=${MESHLLM_IDENTITIES:-"gateway tokenizer scheduler worker embedder supervisor profiler kvstore prometheus"}
ENVOY_UID=${ENVOY_UID:-10001}
PROMETHEUS_UID=${PROMETHEUS_UID:-65534}

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
mkdir -p "$OUT/ca" "$OUT/public-tls"
if [ -f "$OUT/ca/ca.key" ]; then
  cp "$OUT/ca/ca.pem" "$OUT/ca/ca.key" "$work/"   # devca reuses the CA it finds
fi
missing=""
for id in $IDENTITIES; do
  [ -f "$OUT/$id/$id.pem" ] || missing="$missing,$id"
done
if [ -n "$missing" ]; then
  python -m services.common.devca "$work" --services "${missing#,}" >/dev/null
  cp "$work/ca.pem" "$work/ca.key" "$OUT/ca/"
  for id in $(echo "${missing#,}" | tr , ' '); do
    mkdir -p "$OUT/$id"
    cp "$work/ca.pem" "$work/$id.pem" "$work/$id.key" "$OUT/$id/"
  done
fi
if [ ! -f "$OUT/public-tls/tls.crt" ]; then
  cp "$OUT/gateway/gateway.pem" "$OUT/public-tls/tls.crt"
  cp "$OUT/gateway/gateway.key" "$OUT/public-tls/tls.key"
fi
chmod 0400 "$OUT/ca/ca.key"
for id in $IDENTITIES; do
  chmod 0400 "$OUT/$id/$id.key"
done
if [ "$(id -u)" = 0 ]; then
  for id in $IDENTITIES; do
    owner=$ENVOY_UID
    [ "$id" = prometheus ] && owner=$PROMETHEUS_UID
    chown -R "$owner" "$OUT/$id"
  done
  chown -R "$ENVOY_UID" "$OUT/public-tls" 2>/dev/null || true  # a read-only bind mount is fine
fi
echo "certificates ready in $OUT: $IDENTITIES"
