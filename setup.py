"""The wheel's layout (the rest of the build is in pyproject.toml): the repository's top folders
become subpackages of the one import name, `pagemesh.kernels` from kernels/ and so on. bench/,
tests/ and the training scripts stay in the repository (pagemesh/__init__.py reaches them in a clone)."""

from setuptools import find_packages, setup

FOLDERS = ("common", "gateway", "kernels", "services", "workers")
NOT_SHIPPED = ("diffusion.training", "diffusion.training.*")  # under workers/: the digits models' training

packages = ["pagemesh"]
package_dir = {"pagemesh": "pagemesh"}
for folder in FOLDERS:
    package_dir[f"pagemesh.{folder}"] = folder
    packages.append(f"pagemesh.{folder}")
    packages += [f"pagemesh.{folder}.{sub}" for sub in find_packages(folder, exclude=NOT_SHIPPED)]

setup(packages=packages, package_dir=package_dir)
