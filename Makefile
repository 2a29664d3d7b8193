.PHONY: setup serve test protos bench clean

setup:
	@bash scripts/setup.sh

protos: setup

serve: setup
	.venv/bin/meshllm up

test: setup
	.venv/bin/python -m pytest -q --durations=30 tests/unit tests/integration

bench: setup
	.venv/bin/python bench/throughput_cpu.py

clean:
	rm -rf .venv services/common/gen
