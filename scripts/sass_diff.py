"""Does a change of cc/ change the machine code? Builds the CUDA module twice, at a base
revision and from the working tree, and compares the SASS of every kernel.

For device-code changes made without a GPU (a refactor, a helper shared between kernels):
a kernel whose SASS is the same instruction for instruction as the base's runs exactly what
was verified on the H200 at the base, so its tests and timings there carry over. A kernel
whose SASS differs is new code: run its GPU tests and benchmark on the H200 before it lands.
Only device code is compared: a change of host code (FFI handlers, launch plans) needs its
GPU tests whatever this says.

Both builds go through CMakeLists.txt (its flags and architectures, CMake's own generator),
with the nvcc found on PATH or in /usr/local/cuda/bin; the answer holds for that toolkit
(the H200's is nvcc 13.0, as on the CPU machines). cuobjdump and nvdisasm come from the
same place or from PyPI's nvidia-cuda-cuobjdump and nvidia-cuda-nvdisasm wheels.

  python scripts/sass_diff.py [--base REV] [--build-dir DIR]

Exit status: 0 when every kernel's SASS is the same, 1 when one differs or exists on one
side only, 2 when a build fails.
"""
import argparse
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CUDA_BIN = Path("/usr/local/cuda/bin")

# A function's header in cuobjdump's SASS listing, and one instruction line of it
# (/*0070*/ ... ;): the text from the opcode to the semicolon, without the encoding.
FUNCTION = re.compile(r"\s*Function : (\S+)")
INSTRUCTION = re.compile(r"\s*/\*[0-9a-f]{4,}\*/\s+(.*?)\s*;")
# nvcc names an anonymous namespace after the source file and an 8-digit hash (the mangled
# length of the next name follows it directly): the same kernel built from two trees gets
# two names.
ANONYMOUS = re.compile(r"_GLOBAL__N__[0-9a-f]+_\d+_\w+?_cu_[0-9a-f]{8}")


def tool(name):
  """The CUDA tool `name` from PATH, /usr/local/cuda/bin or an nvidia-* wheel's bin/."""
  found = shutil.which(name) or (str(CUDA_BIN / name) if (CUDA_BIN / name).exists() else None)
  if found:
    return found
  purelib = Path(sysconfig.get_paths()["purelib"])
  for candidate in sorted(purelib.glob(f"nvidia/*/bin/{name}")):
    return str(candidate)
  sys.exit(f"sass_diff: {name} not found (PATH, {CUDA_BIN}, or pip install "
           f"nvidia-cuda-{name})")


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
  nvcc = tool("nvcc")
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


def kernels(module):
  """The SASS of every kernel in `module` (parse_listing's form)."""
  cuobjdump = tool("cuobjdump")
  env = dict(os.environ)
  env["PATH"] = f"{Path(tool('nvdisasm')).parent}{os.pathsep}{env.get('PATH', '')}"
  listing = subprocess.run([cuobjdump, "-sass", str(module)], capture_output=True, text=True,
                           env=env, check=True).stdout
  return parse_listing(listing)


def parse_listing(listing):
  """cuobjdump -sass text -> {kernel name, anonymous namespaces named alike: [instruction
  text without its encoding]}."""
  out, current = {}, None
  for line in listing.splitlines():
    if m := FUNCTION.match(line):
      current = ANONYMOUS.sub("_GLOBAL__N_", m.group(1))
      out[current] = []
    elif (m := INSTRUCTION.match(line)) and current is not None:
      out[current].append(m.group(1))
  return out


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
  base = kernels(build(base_tree, work / "base_build"))
  mine = kernels(build(ROOT, work / "tree_build"))
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
