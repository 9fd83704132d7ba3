"""Packaging: import without the CUDA module, diagnostics, the module's
registrations when it is built; the package's boundaries (what it imports, what its wheel
holds)."""
import ast
import importlib
import pathlib
import subprocess
import sys
import tomllib

import pytest

import glm5_jax
from glm5_jax import _ffi
from glm5_jax._primitive import Op


def test_diagnostics_list_every_op():
  out = subprocess.run([sys.executable, "-m", "glm5_jax.info"], capture_output=True,
                       text=True, check=True).stdout
  assert f"glm5_jax {glm5_jax.__version__}" in out
  for op in glm5_jax.OPS:
    assert op in out


def test_public_api():
  for name in glm5_jax.__all__:
    assert getattr(glm5_jax, name) is not None
  assert glm5_jax.OPS == tuple(Op.registry)
  assert set(glm5_jax.KERNEL_TARGETS) <= set(glm5_jax.OPS)
  assert all(t == f"glm5_{op}" for op, t in glm5_jax.KERNEL_TARGETS.items())
  assert glm5_jax.KERNEL_TARGETS == {n: op.kernel for n, op in Op.registry.items() if op.kernel}


def test_import_has_no_cycles():
  """Each public module imports on its own in a fresh interpreter (no function-level
  imports are needed to break a cycle)."""
  for module in ("glm5_jax.stage", "glm5_jax._primitive", "glm5_jax.info", "glm5_jax.plan",
                 "glm5_jax.sharding", "glm5_jax.reference"):
    subprocess.run([sys.executable, "-c", f"import {module}"], check=True)


@pytest.mark.gpu
def test_cuda_module_registers_every_kernel():
  assert _ffi.register_targets(), "the CUDA module is not built"
  assert set(_ffi._glm5_cuda.registrations()) == set(glm5_jax.KERNEL_TARGETS.values())
  assert _ffi.ffi_api_version()[0] == 0


# Boundaries ---------------------------------------------------------------------------

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "glm5_jax"


def imports(path):
  """The absolute names a Python file imports: `import a.b` gives a.b, `from .m import x`
  in package p gives p.m.x (a submodule or a name in one), function-level imports too."""
  package = path.relative_to(ROOT).parts[:-1]
  out = set()
  for node in ast.walk(ast.parse(path.read_text(), str(path))):
    if isinstance(node, ast.Import):
      out.update(alias.name for alias in node.names)
    elif isinstance(node, ast.ImportFrom):
      base = package[:len(package) - node.level + 1] if node.level else ()
      base = ".".join(base + ((node.module,) if node.module else ()))
      out.update(f"{base}.{alias.name}" for alias in node.names)
  return out


def test_imports_reads_relative_and_absolute_imports():
  """imports() resolves what the boundary tests below rely on."""
  got = imports(PACKAGE / "reference" / "update.py")
  assert "glm5_jax.reference.kpool.kpool_update" in got and "jax.numpy" in got
  assert "glm5_jax._ffi" in imports(PACKAGE / "_primitive.py")
  assert "glm5_jax.reference.numerics.DIM" in imports(PACKAGE / "_checks.py")
  assert "jax._src.dispatch" in imports(PACKAGE / "_compat.py")


def test_reference_imports_nothing_of_the_op_layer():
  """The reference is the executable spec: each of its modules imports numpy, jax and the
  reference alone (the op layer imports the reference, never the other way)."""
  for path in sorted((PACKAGE / "reference").glob("*.py")):
    for name in imports(path):
      top = name.split(".")[0]
      assert top in ("numpy", "jax", "ml_dtypes", "glm5_jax"), (path.name, name)
      assert top != "glm5_jax" or name.startswith("glm5_jax.reference."), (path.name, name)


def test_jax_internals_only_in_compat():
  """No file but glm5_jax/_compat.py imports jax._src (tests, bench and scripts included):
  _compat's uses are pinned by tests/test_compat.py."""
  for folder in ("glm5_jax", "glm5_testing", "tests", "bench", "scripts", "examples"):
    for path in sorted((ROOT / folder).rglob("*.py")):
      if path != PACKAGE / "_compat.py":
        internal = {n for n in imports(path) if n == "jax._src" or n.startswith("jax._src.")}
        assert not internal, (str(path.relative_to(ROOT)), internal)


def test_oracles_are_not_in_the_wheel():
  """The wheel is glm5_jax alone: the test oracles and cases live beside it in
  glm5_testing/, and no module of the package imports them, bench/ or tests/."""
  with open(ROOT / "pyproject.toml", "rb") as f:
    assert tomllib.load(f)["tool"]["scikit-build"]["wheel"]["packages"] == ["glm5_jax"]
  assert (ROOT / "glm5_testing" / "oracle.py").exists()
  assert not (PACKAGE / "testing").exists()
  for path in sorted(PACKAGE.rglob("*.py")):
    for name in imports(path):
      assert name.split(".")[0] not in ("glm5_testing", "bench", "tests"), (path, name)
  old = "glm5_jax" + ".testing", "glm5_jax" + "/testing"
  texts = [ROOT / "README.md", ROOT / "BENCHMARKS.md", *(ROOT / "docs").glob("*.md")]
  for folder in ("glm5_jax", "glm5_testing", "tests", "bench", "scripts", "examples"):
    texts += (ROOT / folder).rglob("*.py")
  for path in texts:
    assert not any(o in path.read_text() for o in old), f"{path} names the old place"


def glm5_names(path):
  """The glm5_jax names a Python file reads, with their lines: what it imports from the
  package, and the attribute chains it reads off those names (`glm5_jax.plan.chooses_kernel`;
  `plan.topk_chunks` after `from glm5_jax import plan`), function-level ones too."""
  tree = ast.parse(path.read_text(), str(path))
  bound = {}                                     # local name -> the glm5_jax name it holds
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      for alias in node.names:
        if alias.name.split(".")[0] == "glm5_jax":
          bound[alias.asname or "glm5_jax"] = alias.name if alias.asname else "glm5_jax"
    elif isinstance(node, ast.ImportFrom) and not node.level and (
        (node.module or "").split(".")[0] == "glm5_jax"):
      for alias in node.names:
        bound[alias.asname or alias.name] = f"{node.module}.{alias.name}"
  out = {(name, 0) for name in bound.values()}
  for node in ast.walk(tree):
    if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load):
      attrs, base = [], node
      while isinstance(base, ast.Attribute):
        attrs.append(base.attr)
        base = base.value
      if isinstance(base, ast.Name) and base.id in bound:
        out.add((".".join([bound[base.id], *reversed(attrs)]), node.lineno))
  return out


def missing(name):
  """Whether the dotted glm5_jax name resolves (attributes, or submodules not yet imported);
  the built CUDA module counts as present."""
  obj = importlib.import_module("glm5_jax")
  parts = name.split(".")
  for i, part in enumerate(parts[1:], 2):
    if part == "_glm5_cuda":
      return False
    if not hasattr(obj, part):
      try:
        obj = importlib.import_module(".".join(parts[:i]))
        continue
      except ImportError:
        return True
    obj = getattr(obj, part)
  return False


def test_every_glm5_jax_name_outside_the_package_exists():
  """Tests, bench, scripts and examples read only names the package has. The GPU tests run
  on no CPU runner: a name they read that a refactor removed would fail only on a GPU."""
  gone = sorted((str(path.relative_to(ROOT)), line, name)
                for folder in ("tests", "glm5_testing", "bench", "scripts", "examples")
                for path in sorted((ROOT / folder).rglob("*.py"))
                for name, line in glm5_names(path) if missing(name))
  assert not gone, gone


def test_glm5_names_reports_a_removed_name(tmp_path):
  """The check above sees a removed function read through the package, a submodule alias
  and a function-level import."""
  path = tmp_path / "gpu_test.py"
  path.write_text("import glm5_jax\nfrom glm5_jax import plan\n"
                  "def f():\n  from glm5_jax.logits import select_slots\n"
                  "  from glm5_jax.plan import gone_helper\n"
                  "  return glm5_jax.logits.select_slots_kernel_chosen, plan.topk_chunks, "
                  "plan.removed_rule, select_slots\n")
  names = glm5_names(path)
  assert {n for n, _ in names if missing(n)} == {
    "glm5_jax.plan.gone_helper", "glm5_jax.logits.select_slots_kernel_chosen",
    "glm5_jax.plan.removed_rule"}
  assert ("glm5_jax.plan.topk_chunks", 6) in names and not missing("glm5_jax.plan.topk_chunks")
