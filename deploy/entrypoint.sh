#!/bin/sh
# Image entry point: `<service> [flags]` runs `python -m services.<service>` (gateway, tokenizer,
# scheduler, worker, embedder, profiler, supervisor, ...); anything else is a `meshllm`
# command (health, models, serve, bench, ...).
set -e
if [ $# -gt 0 ] && [ -f "/app/services/$1/__main__.py" ]; then
  service="$1"
  shift
  exec python -m "services.${service}" "$@"
fi
exec meshllm "$@"
