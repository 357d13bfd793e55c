"""Run a DisaggregatedModel's engines and router as local processes, from the operator's own rendering
(`disagg-localrun`, docs/localrun.md)."""
