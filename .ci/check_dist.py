"""Check what the built sdist and wheel hold: python .ci/check_dist.py DIST_DIR."""

from __future__ import annotations

import email
import sys
import tarfile
import zipfile
from pathlib import Path


def main(dist: Path) -> int:
    (wheel,) = dist.glob("todevice-*.whl")
    (sdist,) = dist.glob("todevice-*.tar.gz")
    problems: list[str] = []

    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
        (meta_name,) = [n for n in names if n.endswith(".dist-info/METADATA")]
        meta = email.message_from_bytes(zf.read(meta_name))
    if not any(n.endswith(".dist-info/licenses/LICENSE") for n in names):
        problems.append(f"{wheel.name}: no LICENSE under .dist-info/licenses/")
    src = Path(__file__).resolve().parent.parent / "src"
    modules = {path.relative_to(src).as_posix() for path in (src / "todevice").rglob("*.py")}
    if missing := sorted(modules - set(names)):
        problems.append(f"{wheel.name}: modules missing {missing}")
    if "todevice/py.typed" not in names:
        problems.append(f"{wheel.name}: no todevice/py.typed")
    if meta["License-Expression"] != "Apache-2.0" or meta["License-File"] != "LICENSE":
        problems.append(
            f"{wheel.name}: License-Expression {meta['License-Expression']!r}, License-File {meta['License-File']!r}"
        )
    extras = set(meta.get_all("Provides-Extra") or [])
    if extras != {"test", "bench", "plot"}:
        expected = "expected bench, plot and test (lint is a dependency group)"
        problems.append(f"{wheel.name}: extras {sorted(extras)}, {expected}")
    classifiers = set(meta.get_all("Classifier") or [])
    wanted = {f"Programming Language :: Python :: 3.{minor}" for minor in range(10, 14)} | {"Typing :: Typed"}
    if missing := wanted - classifiers:
        problems.append(f"{wheel.name}: classifiers missing {sorted(missing)}")
    if not any(c.startswith("Development Status ::") for c in classifiers):
        problems.append(f"{wheel.name}: no Development Status classifier")
    for field in ("Author", "Keywords"):
        if not meta[field]:
            problems.append(f"{wheel.name}: no {field}")

    with tarfile.open(sdist) as tf:
        members = {m.name.split("/", 1)[1] for m in tf.getmembers() if "/" in m.name}
    for wanted_file in ("LICENSE", "README.md", "CHANGELOG.md", "pyproject.toml", "tests/conftest.py", "docs/api.md"):
        if wanted_file not in members:
            problems.append(f"{sdist.name}: {wanted_file} missing")
    for unwanted in (".ci/", ".gitignore", ".git/"):
        if any(m == unwanted.rstrip("/") or m.startswith(unwanted) for m in members):
            problems.append(f"{sdist.name}: holds {unwanted}")

    for problem in problems:
        print(problem, file=sys.stderr)
    if not problems:
        print(f"{wheel.name} and {sdist.name}: license, metadata and contents as expected")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1])))
