"""The native kernels' build never waits forever: a builder killed mid-build leaves
torch's ``lock`` file behind, and the next start must build (or load) anyway; a
build dir per set of sources; a turn not had in time falls back as a failed build."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from splitserve.engine import kernels
from tests.waiting import wait_until

LOAD = textwrap.dedent(
    """
    from splitserve.engine import kernels
    print("built" if kernels.load() is not None else "fell back", flush=True)
    """
)


def _env(extensions: Path) -> dict[str, str]:
    return os.environ | {"TORCH_EXTENSIONS_DIR": str(extensions), "PYTHONPATH": os.pathsep.join(sys.path)}


@pytest.mark.slow
def test_a_builder_killed_mid_build_does_not_stop_the_next_start(tmp_path):
    """Kill a process while it compiles (its ``lock`` held); a new process builds."""
    if kernels.load() is None:
        pytest.skip("native CPU kernels do not build here (no compiler)")
    env = _env(tmp_path)
    first = subprocess.Popen([sys.executable, "-c", LOAD], env=env, start_new_session=True)
    try:
        directory = Path(
            subprocess.check_output(
                [
                    sys.executable,
                    "-c",
                    "from splitserve.engine import kernels; print(kernels.build_directory())",
                ],
                env=env,
                text=True,
            ).strip()
        )
        wait_until(lambda: (directory / "lock").exists(), "the first process started building", 300)
    finally:
        os.killpg(first.pid, signal.SIGKILL)  # it, and the compiler it runs
        first.wait(60)
    assert (directory / "lock").exists()  # what a killed builder leaves
    second = subprocess.run(
        [sys.executable, "-c", LOAD], env=env, capture_output=True, text=True, timeout=900
    )
    assert second.stdout.strip() == "built", second.stderr
    assert not (directory / "lock").exists()


def test_a_stale_lock_in_the_build_directory_is_removed_and_the_kernels_load():
    """The cheap form of the above, on this machine's cached build: a ``lock`` file
    left in the build directory, and a new process loads the kernels."""
    if kernels.load() is None:
        pytest.skip("native CPU kernels did not build here")
    directory = kernels.build_directory()
    (directory / "lock").touch()
    env = os.environ | {"PYTHONPATH": os.pathsep.join(sys.path)}
    done = subprocess.run([sys.executable, "-c", LOAD], env=env, capture_output=True, text=True, timeout=900)
    assert done.stdout.strip() == "built", done.stderr
    assert not (directory / "lock").exists()


def test_a_turn_held_by_another_ends_in_a_timeout_not_a_wait_without_end(tmp_path):
    with kernels.build_turn(tmp_path, 60):
        with pytest.raises(TimeoutError, match="over 0 s"):
            with kernels.build_turn(tmp_path, 0.3):
                pass
    with kernels.build_turn(tmp_path, 60):  # free again
        pass


def test_a_dead_holders_turn_is_free_and_its_lock_removed(tmp_path):
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            textwrap.dedent(
                f"""
                import time
                from pathlib import Path
                from splitserve.engine import kernels
                with kernels.build_turn(Path({str(tmp_path)!r}), 60):
                    (Path({str(tmp_path)!r}) / "lock").touch()  # as torch's builder does
                    print("holding", flush=True)
                    time.sleep(600)
                """
            ),
        ],
        stdout=subprocess.PIPE,
        text=True,
        env=_env(tmp_path / "unused"),
    )
    try:
        assert holder.stdout.readline().strip() == "holding"
        with pytest.raises(TimeoutError):
            with kernels.build_turn(tmp_path, 0.3):
                pass
    finally:
        holder.kill()
        holder.wait(60)
    with kernels.build_turn(tmp_path, 60):
        assert not (tmp_path / "lock").exists()


def test_different_sources_build_in_different_directories(tmp_path, monkeypatch):
    here = kernels.build_directory()
    copies = []
    for path in kernels._SOURCES:
        shutil.copy(path, tmp_path / path.name)
        copies.append(tmp_path / path.name)
    monkeypatch.setattr(kernels, "_SOURCES", copies)
    assert kernels.build_directory() == here  # the same bytes: the same build
    copies[-1].write_text(copies[-1].read_text() + "\n// changed\n")
    assert kernels.build_directory() != here


def test_another_kind_of_cpu_builds_in_another_directory(monkeypatch):
    """``-march=native``: a cache shared with a machine of other CPU features (a home
    directory on NFS) must not hand it a build with instructions it lacks."""
    here = kernels.build_directory()
    monkeypatch.setattr(kernels, "_cpu_features", lambda: "flags : fpu sse2")
    assert kernels.build_directory() != here


def test_another_ninja_builds_in_another_directory(tmp_path, monkeypatch):
    """ninja 1.11 and 1.12+ hash their logs' commands differently, each rebuilding all
    the other built: processes that find different ninjas on PATH (one started from an
    activated virtualenv, one not) must not share a build directory."""
    here = kernels.build_directory()
    other = tmp_path / "ninja"
    other.write_text("#!/bin/sh\necho 1.10.0\n")
    other.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    assert kernels._ninja_version() == "1.10.0"
    assert kernels.build_directory() != here
    monkeypatch.setenv("PATH", os.environ["PATH"].split(os.pathsep, 1)[1])
    assert kernels.build_directory() == here
