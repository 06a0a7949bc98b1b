"""The driver, in floors that import only downward: cli > studies > run > preflight | reports > cluster > config, results, status, errors, units."""
