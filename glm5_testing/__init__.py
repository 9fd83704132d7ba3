"""Test and benchmark support beside the package, not in its wheel (pyproject's
wheel.packages is glm5_jax alone): importable from the repository root by tests/
(`python -m pytest`), bench/ (`python -m bench`) and scripts/ (which put the root on
sys.path). The numpy oracle written from SPEC (`oracle`), the stock-op-order Triton
oracle (`triton_oracle`, needs torch + triton), the shared example cases of every op
(`cases`) and the SASS reader of the built module (`sass`)."""
