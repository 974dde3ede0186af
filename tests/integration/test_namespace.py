"""One import name, `pagemesh`, and nothing of the clone under a generic one (docs/design.md §0).

The clone's root holds kernels/, common/, ... and PyPI has distributions of those names: Hugging
Face's `kernels`, which transformers imports (diffusers too, through it), is in the lock. A
process that found the clone's kernels/ under that name failed to load a diffusion pipeline
(`cannot import name 'CUDAProperties' from 'kernels'`)."""

import base64
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path
from types import SimpleNamespace

import pytest

from pagemesh.bench.local_mesh import running_mesh
from pagemesh.tests.integration.conftest import openai_client

ROOT = Path(__file__).resolve().parents[2]
MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_hugging_face_kernels_is_installed_beside_us():
    """The collision is real in this venv: the lock installs HF's `kernels` with transformers."""
    from importlib.metadata import version

    assert version("kernels") and int(version("transformers").split(".")[0]) >= 5


PROBE = "import pagemesh.kernels, kernels\nprint(kernels.__file__, pagemesh.kernels.__name__)"


@pytest.mark.parametrize("how", ["-c", "-m", "PYTHONPATH"])
def test_kernels_is_hugging_faces_in_a_process_started_from_the_clone(how, tmp_path):
    """Python puts the working directory (here the clone's root) on sys.path for -c and -m, and
    PYTHONPATH=. does too; importing pagemesh takes the root off again, so `kernels` is HF's."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    argv = [sys.executable, "-c", PROBE]
    if how == "-m":
        (tmp_path / "probe_module.py").write_text(PROBE)
        argv = [sys.executable, "-m", "probe_module"]
        env["PYTHONPATH"] = str(tmp_path)
    elif how == "PYTHONPATH":
        env["PYTHONPATH"] = str(ROOT)
    done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stderr
    kernels_file, name = done.stdout.split()
    assert Path(kernels_file).parts[-3:] == ("site-packages", "kernels", "__init__.py")
    assert name == "pagemesh.kernels"


@pytest.mark.slow
@pytest.mark.parametrize("where", ["clone root", "another folder"])
def test_llm_and_diffusion_workers_load_and_serve(where, tmp_path):
    """`pagemesh up` with an LLM worker and a diffusion worker (the pipeline load went through
    transformers' kernels hub), started from the clone's root and from elsewhere."""
    cwd = ROOT if where == "clone root" else tmp_path
    with running_mesh("--diffusion", "1", cwd=cwd) as url:
        client = openai_client(SimpleNamespace(url=url))
        chat = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "What is 2+2?"}], max_tokens=8, temperature=0
        )
        assert chat.choices[0].message.content and chat.usage.completion_tokens > 0
        image = client.images.generate(prompt="a handwritten 7", n=1)
        assert base64.b64decode(image.data[0].b64_json).startswith(PNG_MAGIC)


@pytest.mark.slow
def test_the_wheel_installs_one_top_level_name(tmp_path):
    """The built wheel, installed into an empty folder: `pagemesh` (and its dist-info), nothing
    else; no benchmarks, tests or training scripts in it; its package data is there."""
    source, wheels = tmp_path / "source", tmp_path / "wheels"
    # a copy without the clone's build products: setuptools reads an old egg-info's file list back
    ignore = shutil.ignore_patterns(".venv", ".git", "build", "*.egg-info", "__pycache__", ".pytest_cache", "wheels")
    shutil.copytree(ROOT, source, ignore=ignore)
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", wheels, source],
        check=True,
        cwd=tmp_path,
    )
    (wheel,) = wheels.glob("pagemesh-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert {n.split("/")[0] for n in names if ".dist-info/" not in n} == {"pagemesh"}
    assert not [n for n in names if n.startswith(("pagemesh/bench/", "pagemesh/tests/"))]
    assert not [n for n in names if "/training/" in n]
    for data in ("pagemesh/kernels/cpu/", "pagemesh/gateway/static/", "pagemesh/workers/diffusion/models/digits-dit/"):
        assert any(n.startswith(data) and not n.endswith(".py") for n in names), data
    target = tmp_path / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", target, wheel], check=True, cwd=tmp_path
    )
    assert sorted(p.name for p in target.iterdir() if not p.name.endswith(".dist-info") and p.name != "bin") == [
        "pagemesh"
    ]
    top_level = next(target.glob("pagemesh-*.dist-info"))
    assert (top_level / "entry_points.txt").read_text().count("pagemesh = pagemesh.services.cli:main") == 1
    # the installed package, not the clone's: no pagemesh.bench, and `pagemesh bench` says why
    code = (
        "import sys; sys.path.insert(0, sys.argv[1]); import pagemesh, importlib.util; print(pagemesh.__file__); "
        "print(importlib.util.find_spec('pagemesh.bench')); from pagemesh.services.cli import main; main(['bench'])"
    )
    done = subprocess.run([sys.executable, "-P", "-c", code, target], cwd=tmp_path, capture_output=True, text=True)
    assert done.returncode == 2, done.stderr
    assert done.stdout.split() == [str(target / "pagemesh" / "__init__.py"), "None"]
    assert "runs from a clone of the repository" in done.stderr
