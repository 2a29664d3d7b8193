#!/usr/bin/env bash
# Development certificates for components/internal-mtls, as Secret manifests on stdout:
#   deploy/k8s/make-dev-certs.sh [NAMESPACE] | kubectl apply -f -
# One Secret meshllm-tls-<identity> per service (tls.crt, tls.key, ca.crt) from one dev CA
# (scripts/dev-ca), with the DNS names the services dial each other by. Not for production:
# use cert-manager (Certificate resources with the same secret names) there.
# Then the prefill/decode engines' identities (overlays/pd-mtls), from the same CA:
# meshllm-tls-<role>-scheduler and meshllm-tls-<role>-worker for role prefill and decode, each
# naming only its own role's pods (engine-<role>-N.engine-<role>) besides its identity.
set -euo pipefail
cd "$(dirname "$0")/../.."
NS=${1:-meshllm}
ENGINES=${MESHLLM_ENGINES:-4}         # engine-0.engine ... engine-(N-1).engine
PD_ENGINES=${MESHLLM_PD_ENGINES:-4}   # engine-<role>-0.engine-<role> ... per role
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
IDENTITIES="gateway tokenizer scheduler worker embedder supervisor profiler kvstore"
sans=()
for id in $IDENTITIES; do
  sans+=(--san "$id.$NS" --san "$id.$NS.svc" --san "$id.$NS.svc.cluster.local")
done
for ((i = 0; i < ENGINES; i++)); do
  sans+=(--san "engine-$i.engine" --san "engine-$i.engine.$NS.svc")
done
scripts/dev-ca "$work" --services "$(echo $IDENTITIES | tr ' ' ,)" "${sans[@]}" >/dev/null
PD_IDENTITIES=""
for role in prefill decode; do
  sts=engine-$role
  pd_sans=(--san "$sts" --san "$sts.$NS.svc")
  for ((i = 0; i < PD_ENGINES; i++)); do
    pd_sans+=(--san "$sts-$i.$sts" --san "$sts-$i.$sts.$NS.svc")
  done
  # the same $work: dev-ca reuses its CA (and rewrites only the client and CURVE files, unused here)
  scripts/dev-ca "$work" --services "$role-scheduler,$role-worker" "${pd_sans[@]}" >/dev/null
  PD_IDENTITIES+=" $role-scheduler $role-worker"
done
for id in $IDENTITIES $PD_IDENTITIES; do
  echo "---"
  kubectl create secret generic "meshllm-tls-$id" --namespace "$NS" \
    --from-file=tls.crt="$work/$id.pem" --from-file=tls.key="$work/$id.key" --from-file=ca.crt="$work/ca.pem" \
    --dry-run=client -o yaml
done
