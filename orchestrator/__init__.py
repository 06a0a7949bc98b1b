"""The driver, in floors that import only downward (contracts: pyproject.toml, importlinter)."""
