"""Test and benchmark support, importable by tests/, bench/ and scripts/ alike
(never imported by `import glm5_jax`): the numpy oracle written from SPEC
(`oracle`), the stock-op-order Triton oracle (`triton_oracle`, needs torch +
triton) and the shared example cases of every op (`cases`)."""
