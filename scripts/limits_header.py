"""Writes cc/limits.h, the kernels' limits and tile sizes, from glm5_jax/limits.py (their one
declaration). Run it after changing a limit there; tests/test_cc_sources.py fails until the
checked-in header matches.

  python scripts/limits_header.py [--check]

--check writes nothing and exits 1 when cc/limits.h differs from what it would write.
"""
import argparse
import sys
from pathlib import Path

from glm5_jax import limits

HEADER = Path(__file__).resolve().parents[1] / "cc" / "limits.h"


def main():
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--check", action="store_true", help="compare only, write nothing")
  args = p.parse_args()
  text = limits.header()
  if args.check:
    same = HEADER.exists() and HEADER.read_text() == text
    print(f"{HEADER}: {'up to date' if same else 'differs: run ' + limits.COMMAND}")
    return 0 if same else 1
  HEADER.write_text(text)
  return 0


if __name__ == "__main__":
  sys.exit(main())
