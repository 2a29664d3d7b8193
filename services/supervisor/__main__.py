import os

# The supervisor forks children while gRPC threads run; they exec at once, so gRPC's fork
# handlers have nothing to protect (and would log a line per fork). Set before grpc loads.
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "0")

from services.supervisor.main import main  # noqa: E402

raise SystemExit(main())
