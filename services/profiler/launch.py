"""How the local launcher (services/cli/launcher.py) starts the profiler service: its flags,
and the admin key it presents to the gateway, taken from the gateway's own security flags."""
from __future__ import annotations


def _flag_values(argv: list[str], flag: str) -> list[str]:
    return [argv[i + 1] for i, a in enumerate(argv[:-1]) if a == flag]


def profiler_argv(port: int, workers: dict[str, str], services: dict[str, str], gateway_grpc: str,
                  gateway_args: list[str], environ: dict[str, str],
                  profile_dir: str = "") -> tuple[list[str], dict[str, str]]:
    """(argv, extra environment) of `python -m services.profiler`.

    The gateway's public port joins the sampling fan-out only when the gateway has an admin
    key (TelemetryControl there is admin-only) and no public TLS (the profiler connects in
    plain gRPC). The key travels in the environment or as the key file's path, never in argv."""
    argv = ["--host", "127.0.0.1", "--port", str(port)]
    if profile_dir:
        argv += ["--artifact-dir", profile_dir]
    for name, addr in workers.items():
        argv += ["--worker", f"{name}={addr}"]
    for name, addr in services.items():
        argv += ["--service", f"{name}={addr}"]
    env: dict[str, str] = {}
    keys = _flag_values(gateway_args, "--admin-api-key")
    key_files = _flag_values(gateway_args, "--admin-api-key-file")
    env_keys = [k.strip() for k in environ.get("MESHLLM_ADMIN_API_KEYS", "").split(",") if k.strip()]
    if "--ssl-certfile" not in gateway_args and (keys or key_files or env_keys):
        host, _, gport = gateway_grpc.rpartition(":")
        if host in ("0.0.0.0", "::", "[::]", ""):
            host = "127.0.0.1"
        argv += ["--gateway-addr", f"{host}:{gport}"]
        if keys or env_keys:
            env["MESHLLM_CONTROL_API_KEY"] = (keys or env_keys)[0]
        else:
            argv += ["--control-api-key-file", key_files[0]]
    return argv, env
