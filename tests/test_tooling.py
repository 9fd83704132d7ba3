"""Project tooling: one version source, the GPU capability guard of the kernels."""
import os
import re
import tomllib
import types
import warnings

import jax
import pytest

import glm5_jax
from glm5_jax import _ffi

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_version_has_one_source():
  """pyproject.toml reads the version from glm5_jax/__init__.py (no second copy)."""
  with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
    meta = tomllib.load(f)
  assert "version" not in meta["project"] and "version" in meta["project"]["dynamic"]
  source = meta["tool"]["scikit-build"]["metadata"]["version"]
  assert source["input"] == "glm5_jax/__init__.py"
  assert re.fullmatch(r"\d+\.\d+\.\d+\S*", glm5_jax.__version__)


def _devices(*caps):
  return lambda backend=None: [types.SimpleNamespace(compute_capability=c) for c in caps]


@pytest.mark.parametrize("caps", [("8.0",), ("9.0", "10.0"), ("12.0",)])
def test_kernels_refused_on_other_gpus(monkeypatch, caps):
  monkeypatch.setattr(jax, "devices", _devices(*caps))
  with pytest.warns(RuntimeWarning, match=r"need compute capability 9\.0.*reference"):
    assert not _ffi._supported_gpu.__wrapped__()


def test_kernels_accepted_on_hopper(monkeypatch):
  monkeypatch.setattr(jax, "devices", _devices("9.0", "9.0"))
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    assert _ffi._supported_gpu.__wrapped__()
