"""The profiler-control service: bounded torch.profiler captures on running workers and
trace-sampling changes on running services (control.proto ProfilerControl)."""
