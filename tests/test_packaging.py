"""What a user installs: the wheel (stable-ABI kernels), and a source install on a machine without a C compiler
(the numpy kernels), both giving the same dedup as the development tree."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest
from conftest import REPO, SAMPLE

# Runs smolctl as if the C extension had never been built: a None entry in sys.modules makes its import fail.
WITHOUT_C_KERNELS = (
    "import runpy, sys; sys.modules['smolctl.data._minhash'] = None; sys.argv[0] = 'smolctl'; "
    "runpy.run_module('smolctl', run_name='__main__')"
)
FALLBACK_WARNING = "numpy fallback"


def dedup_outputs(folder: Path) -> dict[str, bytes]:
    """The shards and duplicate report of a dedup output, and its manifest's statistics."""
    files = {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*.parquet"))}
    files["stats"] = json.dumps(json.loads((folder / "manifest.json").read_text())["stats"]).encode()
    return files


def run(command: list, **options) -> subprocess.CompletedProcess:
    done = subprocess.run(
        [str(c) for c in command], check=False, capture_output=True, text=True, timeout=300, **options
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done


def test_dedup_without_the_c_extension_gives_the_same_output(tmp_path):
    """The sample web corpus holds exact and near duplicates: the numpy kernels must remove the same ones."""
    options = ["--minhash", "--workers", "1", "--json"]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    # Both at once: most of each run is the interpreter starting.
    runs = {
        name: subprocess.Popen(
            [*map(str, start), "dedup", str(SAMPLE / "web"), str(tmp_path / name), *options],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for name, start in (
            ("c", [sys.executable, "-m", "smolctl"]),
            ("numpy", [sys.executable, "-c", WITHOUT_C_KERNELS]),
        )
    }
    (c_out, c_err), (_, numpy_err) = (runs[name].communicate(timeout=300) for name in ("c", "numpy"))
    assert runs["c"].returncode == runs["numpy"].returncode == 0, c_err + numpy_err
    assert FALLBACK_WARNING not in c_err
    assert numpy_err.count("\n") == 1 and FALLBACK_WARNING in numpy_err
    assert json.loads(c_out)["near_removed"] > 0
    assert dedup_outputs(tmp_path / "numpy") == dedup_outputs(tmp_path / "c")


def build_wheel(tmp_path: Path, name: str, env: dict) -> Path:
    """A wheel of a clean copy of the sources (no in-place build products), built offline as pip would."""
    source = tmp_path / f"{name}-src"
    shutil.copytree(REPO / "smolctl", source / "smolctl", ignore=shutil.ignore_patterns("*.so", "__pycache__"))
    for file in ("pyproject.toml", "setup.py", "README.md"):
        shutil.copy(REPO / file, source / file)
    out = tmp_path / f"{name}-dist"
    run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "--no-index",
            "-q",
            "-w",
            out,
            source,
        ],
        env=env,
    )
    (wheel,) = out.glob("*.whl")
    return wheel


def install(tmp_path: Path, name: str, wheel: Path, env: dict) -> Path:
    """A fresh venv holding the wheel; its dependencies come from this interpreter's site-packages (listed after
    the venv's own, so the installed smolctl is the one imported), so nothing is downloaded."""
    venv = tmp_path / f"{name}-venv"
    run([sys.executable, "-m", "venv", "--without-pip", venv])
    python = venv / "bin" / "python"
    run([sys.executable, "-m", "pip", "--python", python, "install", "--no-deps", "--no-index", "-q", wheel], env=env)
    site = run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], env=env).stdout.strip()
    shared = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
    (Path(site) / "shared-dependencies.pth").write_text("\n".join(sorted(shared)) + "\n")
    return venv


@pytest.mark.slow
def test_the_wheel_is_abi3_and_installs_with_or_without_a_compiler(tmp_path):
    """The wheel carries the kernels built for the stable ABI (tag cp311-abi3); a build where the compiler fails
    still installs, and its `smolctl dedup --minhash` on the sample corpus warns and removes the same documents."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    wheel = build_wheel(tmp_path, "abi3", env)
    assert "-cp311-abi3-" in wheel.name
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        wheel_file = archive.read(next(n for n in names if n.endswith(".dist-info/WHEEL"))).decode()
    assert "smolctl/data/_minhash.abi3.so" in names and "Tag: cp311-abi3-" in wheel_file
    assert "smolctl/data/_pack.abi3.so" in names
    # CC=false: the compiler exists but fails, as a missing one does; the optional extension is skipped.
    plain = build_wheel(tmp_path, "no-compiler", {**env, "CC": "false"})
    with zipfile.ZipFile(plain) as archive:
        assert not [n for n in archive.namelist() if n.endswith(".so")]

    outputs = {}
    for name, built in (("abi3", wheel), ("no-compiler", plain)):
        venv = install(tmp_path, name, built, env)
        # From tmp_path: in the repository, python -c would import the source tree's smolctl.
        where = run(
            [venv / "bin" / "python", "-c", "import smolctl; print(smolctl.__file__)"], env=env, cwd=tmp_path
        ).stdout
        assert where.startswith(str(venv))
        done = run(
            [
                venv / "bin" / "smolctl",
                "dedup",
                SAMPLE / "web",
                tmp_path / f"{name}-out",
                "--minhash",
                "--workers",
                "1",
            ],
            env=env,
            cwd=tmp_path,
        )
        assert (FALLBACK_WARNING in done.stderr) == (name == "no-compiler")
        outputs[name] = dedup_outputs(tmp_path / f"{name}-out")
    assert outputs["no-compiler"] == outputs["abi3"]
    assert json.loads(outputs["abi3"]["stats"])["near_removed"] > 0
