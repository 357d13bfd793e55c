"""The workshop: benchmarks of disagg-operator on real engines (bench/README.md). Nothing in the product imports it."""
