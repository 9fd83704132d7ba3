"""Does a change of cc/ change the machine code? Builds the CUDA module twice, at a base
revision and from the working tree, and compares the SASS of every kernel.

For device-code changes made without a GPU (a refactor, a helper shared between kernels):
a kernel whose SASS is the same instruction for instruction as the base's runs exactly what
was verified on the H200 at the base, so its tests and timings there carry over. A kernel
whose SASS differs is new code: run its GPU tests and benchmark on the H200 before it lands.
Only device code is compared: a change of host code (FFI handlers, launch plans) needs its
GPU tests whatever this says.

Both builds go through CMakeLists.txt (its flags and architectures, CMake's own generator),
with the nvcc that glm5_testing.sass.cuda_tool finds (PATH, else $CUDA_HOME/bin); the
answer holds for that toolkit (the H200's is nvcc 13.0, as on the CPU machines). cuobjdump
and nvdisasm likewise, or from PyPI's nvidia-cuda-cuobjdump and nvidia-cuda-nvdisasm.

  python scripts/sass_diff.py [--base REV] [--build-dir DIR]

Exit status: 0 when every kernel's SASS is the same, 1 when one differs or exists on one
side only, 2 when a build fails.
"""
import argparse
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the root: glm5_testing

from glm5_testing.sass import cuda_tool, module_sass  # noqa: E402


def export_tree(rev, into):
  """The files of revision `rev` in directory `into` (git archive: no worktree state)."""
  archive = into.with_suffix(".tar")
  subprocess.run(["git", "-C", str(ROOT), "archive", "--format=tar", "-o", str(archive), rev],
                 check=True)
  with tarfile.open(archive) as tar:
    tar.extractall(into, filter="data")
  archive.unlink()


def build(source, build_dir):
  """The CUDA module built from `source` by CMake in `build_dir`: the path of the .so."""
  nvcc = cuda_tool("nvcc")
  if nvcc is None:
    sys.exit("sass_diff: nvcc not found (PATH, $CUDA_HOME/bin)")
  configure = ["cmake", "-S", str(source), "-B", str(build_dir), "-DGLM5_JAX_ENABLE_CUDA=ON",
               "-DSKBUILD_PROJECT_NAME=glm5_jax", f"-DCMAKE_CUDA_COMPILER={nvcc}",
               f"-DPython_EXECUTABLE={sys.executable}", "-DCMAKE_BUILD_TYPE=Release"]
  for command in (configure, ["cmake", "--build", str(build_dir), "--target", "_glm5_cuda",
                              "-j", str(os.cpu_count() or 2)]):
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
      print(done.stdout[-4000:], done.stderr[-4000:], sep="\n", file=sys.stderr)
      sys.exit(2)
  (module,) = Path(build_dir).glob("_glm5_cuda*.so")
  return module


def main():
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--base", default="HEAD", help="revision to compare with (default HEAD)")
  p.add_argument("--build-dir", help="keep both builds here (default: a temporary directory)")
  p.add_argument("-v", "--verbose", action="store_true", help="list every kernel")
  args = p.parse_args()
  work = Path(args.build_dir or tempfile.mkdtemp(prefix="sass_diff."))
  work.mkdir(parents=True, exist_ok=True)
  base_tree = work / "base_tree"
  # A kept build directory rebuilds the base only when the base's commit changed.
  commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", args.base], check=True,
                          capture_output=True, text=True).stdout.strip()
  stamp = work / "base_commit"
  if not (base_tree.exists() and stamp.exists() and stamp.read_text() == commit):
    shutil.rmtree(base_tree, ignore_errors=True)
    export_tree(commit, base_tree)
    stamp.write_text(commit)
  base = module_sass(build(base_tree, work / "base_build"))
  mine = module_sass(build(ROOT, work / "tree_build"))
  if not args.build_dir:
    shutil.rmtree(work)

  differ = 0
  for name in sorted(set(base) | set(mine)):
    old, new = base.get(name), mine.get(name)
    if old == new:
      verdict = "same"
    elif old is None or new is None:
      verdict = "only in " + ("the tree" if old is None else args.base)
    else:
      verdict = f"differs ({len(old)} -> {len(new)} instructions)"
    differ += verdict != "same"
    if args.verbose or verdict != "same":
      print(f"{verdict:36} {name}")
  print(f"{len(set(base) | set(mine))} kernels, {differ} with other SASS than {args.base}")
  return 1 if differ else 0


if __name__ == "__main__":
  sys.exit(main())
