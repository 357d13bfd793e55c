"""The DisaggregatedModel operator."""
