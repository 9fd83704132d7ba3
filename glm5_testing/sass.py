"""The SASS of a built CUDA module as {kernel: [instruction, ...]}, read with cuobjdump: for
the SASS tests (tests/test_sass.py, which need the module, not a GPU) and
scripts/sass_diff.py.

cuobjdump and the nvdisasm it calls come from PATH, the CUDA toolkit's bin/ ($CUDA_HOME, else
/usr/local/cuda), or PyPI's nvidia-cuda-cuobjdump and nvidia-cuda-nvdisasm wheels (what CI
installs: the CPU machines' toolkit has nvcc without them)."""
import os
import re
import shutil
import subprocess
import sysconfig
from pathlib import Path

# A function's header, and one instruction line (/*0070*/ ... ;): the text from the opcode
# to the semicolon, without the encoding.
FUNCTION = re.compile(r"Function : (\S+)")
INSTRUCTION = re.compile(r"/\*[0-9a-f]{4,}\*/\s+(.*?)\s*;")
# nvcc names a file's anonymous namespace _GLOBAL__N__<hash>_<length>_<file>_cu_<hash>, the
# hashes of the source's path (8 hex digits each; the mangled length of the next name
# follows the second directly): the same kernel built from two trees would get two names.
ANONYMOUS = re.compile(r"_GLOBAL__N__[0-9a-f]{8}_\d+_(\w+?_cu)_[0-9a-f]{8}")


def cuda_tool(name: str) -> str | None:
  """The path of CUDA tool `name` (cuobjdump, nvdisasm, nvcc), or None."""
  toolkit = Path(os.environ.get("CUDA_HOME", "/usr/local/cuda")) / "bin" / name
  found = shutil.which(name) or (str(toolkit) if toolkit.exists() else None)
  if found:
    return found
  wheels = sorted(Path(sysconfig.get_paths()["purelib"]).glob(f"nvidia/*/bin/{name}"))
  return str(wheels[0]) if wheels else None


def kernel_name(mangled: str) -> str:
  """`mangled` with each anonymous namespace named by its file alone (no path hashes)."""
  return ANONYMOUS.sub(r"_GLOBAL__N__\1_", mangled)


def parse_listing(listing: str) -> dict[str, list[str]]:
  """{kernel_name: [instruction text without its encoding]} of cuobjdump -sass output. Two
  functions of one name (which kernel_name would have merged) raise ValueError."""
  out, current = {}, None
  for line in listing.splitlines():
    if m := FUNCTION.search(line):
      name = kernel_name(m.group(1))
      if name in out:
        raise ValueError(f"two functions named {name} in one listing")
      current = out[name] = []
    elif (m := INSTRUCTION.search(line)) and current is not None:
      current.append(m.group(1))
  return out


def module_sass(path) -> dict[str, list[str]]:
  """parse_listing of `cuobjdump -sass path` (a .so, cubin or object file). RuntimeError
  names what is missing when cuobjdump or nvdisasm is not found."""
  cuobjdump, nvdisasm = cuda_tool("cuobjdump"), cuda_tool("nvdisasm")
  if cuobjdump is None or nvdisasm is None:
    raise RuntimeError("cuobjdump and nvdisasm not found (PATH, $CUDA_HOME/bin, or pip install "
                       "nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm)")
  env = {**os.environ, "PATH": f"{Path(nvdisasm).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
  return parse_listing(subprocess.run([cuobjdump, "-sass", str(path)], check=True, env=env,
                                      capture_output=True, text=True).stdout)
