"""Known deviations: the registry of an implementation's documented differences and their models."""
